"""benchmarks/trl_settings.py: its candidates' parsing and the per-phase summary (no compute)."""

import pytest

from benchmarks import trl_settings


def test_a_candidate_is_fields_separated_by_semicolons_with_yaml_values():
    assert trl_settings.parse_candidate("") == {}
    assert trl_settings.parse_candidate("per_device_train_batch_size=64;use_transformers_continuous_batching=true") \
        == {"per_device_train_batch_size": 64, "use_transformers_continuous_batching": True}
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        trl_settings.parse_candidate("bf16")


def test_the_summary_leaves_out_the_warm_up_step():
    step = {"scoring_s": 0.0}
    run = {"steps": 3, "train_s": 90.0, "curve": [
        {**step, "step_s": 50.0, "generation_s": 20.0, "training_s": 30.0},
        {**step, "step_s": 20.0, "generation_s": 8.0, "training_s": 12.0},
        {**step, "step_s": 20.0, "generation_s": 6.0, "training_s": 14.0}]}
    s = trl_settings.step_timing(run)
    assert s["first_step_s"] == 50.0 and s["steps"] == 3 and s["timed_steps"] == 2 and s["total"] == 20.0
    assert s["generation"] == 7.0 and s["training"] == 13.0


def test_an_r1flow_candidate_is_checked_against_r1flows_config_before_any_compute():
    from pydantic import ValidationError

    from benchmarks.learning_plan import Plan

    base = Plan()
    trl_settings.check_candidate("r1flow", {"precision": "bf16"}, base)  # a field, a valid value: no error
    with pytest.raises(ValidationError, match="precison"):
        trl_settings.check_candidate("r1flow", {"precison": "bf16"}, base)
    with pytest.raises(ValidationError, match="precision"):
        trl_settings.check_candidate("r1flow", {"precision": "bf17"}, base)
    assert "precision=bf16" in trl_settings.CANDIDATES["r1flow"] and "" in trl_settings.CANDIDATES["r1flow"]
