"""benchmarks/gpu_check.sh, the one-shot GPU check, in its CPU smoke mode: every part runs (or says why
not) and its numbers reach the summary the lent GPU machine would send back; and the pieces it carries
there (the random-weight SmolLM2 builder, the wheel installer's version test)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cpu_smoke_run_fills_every_part_of_the_summary(tmp_path):
    """`bash benchmarks/gpu_check.sh --device cpu --quick` with this interpreter: the summary has each part's
    numbers (GRPO step split, generation tokens/s of all five modes, SFT tokens/s, DPO pairs/s, peak memory),
    or the reason a part did not run (TRL where this venv has none), and
    what comes back fits the device's limits (at most 8 files, none in a sub-folder)."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert {"gpu_check.log", "summary.json", "summary.md", "suite.json"} <= set(files) and len(files) <= 8
    assert all((out / f).is_file() for f in files)
    parts = json.loads((out / "summary.json").read_text())["parts"]

    env_part = parts["env"]["numbers"]
    assert parts["env"]["status"] == "ok"
    assert not str(env_part["modules"]["stages.grpo"]).startswith("ERROR")
    assert parts["tests"]["status"] == "ok" and parts["tests"]["numbers"].get("skipped", 0) >= 1  # no CUDA here

    trl_runs = env_part["trl_side"] == "runs"
    for name, tasks in (("grpo", ["grpo"]), ("sft_dpo", ["sft", "dpo"])):
        assert parts[f"{name}/r1flow"]["status"] == "ok", parts[f"{name}/r1flow"]
        numbers = parts[name]["numbers"]
        if trl_runs:
            assert numbers["trl"] and all(numbers["ratios"][t] for t in tasks)
        else:
            assert parts[f"{name}/trl"]["status"] == "skipped" and "trl" in parts[f"{name}/trl"]["reason"]
        for task in tasks:
            got = numbers["r1flow"][task]
            assert got["peak_mib"] > 0
            if task == "grpo":
                assert got["total"] > 0 and got["generation"] > 0 and got["gen_tokens_per_s"] > 0
            else:
                assert got["rate"] > 0 and got["step_s"] > 0

    modes = parts["generation"]["numbers"]["modes"]
    assert [m["mode"] for m in modes] == ["generate() dynamic", "r1flow decode_rows", "generate() static",
                                          "r1flow static", "r1flow graph"]
    assert all(m["tokens_per_s"] > 0 and m["rows_equal_to_generate_dynamic"] == m["rows"] for m in modes)
    learning = parts["learning"]  # the tiny model's smoke run of benchmarks/learning.py, r1flow's side
    assert learning["status"] == "ok", learning
    assert learning["numbers"]["r1flow"]["steps"] >= 1 and learning["numbers"]["table"][0]["model"] == "start model"
    # benchmarks/learning.py's own smoke checks (that run is this one; test_learning.py has the pure parts)
    from benchmarks.common import SEED
    from benchmarks.learning_plan import QUICK, TASK, TRANSFER

    assert (out / "learning.png").stat().st_size > 10_000
    raw = json.loads((out / "learning.json").read_text())
    assert len(raw["runs"]["r1flow"]) == QUICK["seeds"]  # one run a seed
    for k, run in enumerate(raw["runs"]["r1flow"]):
        assert 1 <= run["steps"] <= QUICK["max_steps"] and run["seed"] == SEED + k
        assert {r["task"] for r in raw["evals"][f"r1flow_end_s{k}"]["rows"]} == {TASK, TRANSFER}
        assert [s["name"] for s in run["snapshots"]] and all(s["name"].startswith("t") for s in run["snapshots"])
        assert all(c["generation_s"] > 0 and c["training_s"] > 0 for c in run["curve"])  # phases timed
    assert len(raw["evals"]["start"]["rows"]) == QUICK["eval_prompts"] + QUICK["transfer_prompts"]
    assert raw["summary"]["rows"][-1]["steps"] == [r["steps"] for r in raw["runs"]["r1flow"]]
    log = (out / "gpu_check.log").read_text()
    assert "| start model | 0 |" in log and "| r1flow, budget |" in log

    md = (out / "summary.md").read_text()
    assert "| grpo total |" in md and "| sft rate |" in md and "| r1flow decode_rows |" in md and "| r1flow | " in md


def test_smollm2_random_has_the_config_and_tokenizer_it_was_given(tmp_path, tiny_tokenizer):
    """build_smollm2_random from a config directory (here a small Llama config and the tiny tokenizer): the
    saved model has that architecture, seeded weights (built twice, equal), and the tokenizer's vocabulary."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from benchmarks.common import build_smollm2_random

    config_dir = tmp_path / "config"
    LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True).save_pretrained(config_dir)
    tiny_tokenizer.save_pretrained(config_dir)
    models = []
    for name in ("a", "b"):
        dest = build_smollm2_random(tmp_path / name, config_dir)
        assert build_smollm2_random(dest, config_dir) == dest  # built once, then reused
        models.append(AutoModelForCausalLM.from_pretrained(dest))
        assert len(AutoTokenizer.from_pretrained(dest)) == len(tiny_tokenizer)
    assert models[0].config.num_hidden_layers == 2 and models[0].config.hidden_size == 32
    for (n, a), (_, b) in zip(models[0].state_dict().items(), models[1].state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert math.isfinite(float(models[0].model.embed_tokens.weight.std()))


@pytest.mark.parametrize("have, spec, ok", [
    ("4.15.0", "typing-extensions>=4.16.0", False), ("4.16.0", "typing-extensions>=4.16.0", True),
    (None, "typing-extensions>=4.16.0", False), ("2026.10.0", "fsspec>=2023.1.0,<=2026.9.0", False),
    ("2025.3.0", "fsspec>=2023.1.0,<=2026.9.0", True)])
def test_if_older_wheels_install_only_where_the_machine_fails_the_requirement(have, spec, ok):
    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_wheels import _satisfies

    assert _satisfies(have, spec) is ok
