"""Process reward models, the stages: `step_labels` (Math-Shepherd labels from rollouts, scripted and
with the tiny model) and `prm` (a head read at every step's last token, trained with BCE; held-out
step accuracy above the majority baseline on a learnable rule, AUROC, first-error accuracy; the
artifact loads as a `StepScorer`), then both through the pipeline: cached, and re-run alone with
`r1flow stage`."""

import hashlib
import json
import random

import pytest
import torch

from schemas.datasets import from_rows
from schemas.errors import ConfigError, SchemaError
from stages import prm, step_labels
from stages.base import LocalContext, write_dataset
from stages.sampling.completions import Completion
from tests.conftest import fake_input

PRMConfig = prm.CONFIG
StepLabelsConfig = step_labels.CONFIG

# ---------------------------------------------------------------------------- step_labels, scripted


class ScriptedBackend:
    """Continues a prefix with scripted texts: `script[prefix]` lists K continuations (the rollouts)."""

    def __init__(self, script: dict[str, list[str]]):
        self.script = script
        self.calls: list[tuple[str, int]] = []  # (prefix, K) per prefix rolled out
        self.batches: list[int] = []  # prefixes per generate call

    def generate(self, conversations, spec, n=1, seed=0, logprobs=False, desc="", progress=True, prefills=None):
        assert prefills is not None and len(prefills) == len(conversations)
        self.batches.append(len(prefills))
        out = []
        for prefix in prefills:
            self.calls.append((prefix, n))
            conts = self.script[prefix]
            assert len(conts) == n
            out.append([Completion(prefix + c, 3, "stop") for c in conts])
        return out, None


def samples_input(tmp_path, rows):
    full = [{"prompt_id": r["prompt_id"], "messages": [{"role": "user", "content": f"Say {r['prompt_id'][1:]}."}],
             "completion": r["completion"], "sample_index": i, "reward": None, "reward_components": "{}",
             "correct": None, "num_tokens": 5, "finish_reason": r.get("finish", "stop"), "metadata": "{}"}
            for i, r in enumerate(rows)]
    out = write_dataset(LocalContext(tmp_path / "s"), "s", from_rows(full, "samples"), "samples")
    return fake_input(out.path, "dataset", "samples")


RIGHT = "Step 1: think\n\nStep 2: more\n\n<answer>3</answer>"  # prompt p3 ("Say 3.", answer 3): right
WRONG = "Step 1: hmm\n\n<answer>6</answer>"  # prompt p5 (answer 5): wrong
CUT = "Step 1: a\n\nStep 2: b"  # prompt p7, cut by the token limit: its last step is rolled out too
SCRIPT = {
    "Step 1: think": ["\n\n<answer>3</answer>"] * 3 + ["\n\n<answer>4</answer>"],  # 3 of 4 right
    "Step 1: think\n\nStep 2: more": ["<answer>3</answer>"] + ["<answer>1</answer>"] * 3,  # 1 of 4
    "Step 1: hmm": ["\n\n<answer>9</answer>"] * 4,  # 0 of 4
    "Step 1: a": ["<answer>7</answer>", "x", "y", "<answer>7</answer>"],  # 2 of 4
    "Step 1: a\n\nStep 2: b": ["<answer>7</answer>", "<answer>7</answer>", "<answer>7</answer>", "z"],  # 3 of 4
}


def run_scripted(tmp_path, monkeypatch, digit_prompts, tiny_model_input, **cfg):
    backend = ScriptedBackend(SCRIPT)
    monkeypatch.setattr(step_labels, "make_backend", lambda *a, **k: backend.made.append(k) or backend)
    backend.made = []
    data = samples_input(tmp_path, [{"prompt_id": "p3", "completion": RIGHT}, {"prompt_id": "p5", "completion": WRONG},
                                    {"prompt_id": "p7", "completion": CUT, "finish": "length"}])
    ctx = LocalContext(tmp_path / cfg.get("label", "soft"))
    out = step_labels.run(StepLabelsConfig(rollouts=4, **cfg),
                          {"model": tiny_model_input, "prompts": digit_prompts, "solutions": data}, ctx)["steps"]
    return backend, fake_input(out.path, "dataset", "steps").table("steps").to_pylist(), out.metrics


def test_step_labels_from_scripted_rollouts_soft(tmp_path, monkeypatch, digit_prompts, tiny_model_input):
    """p3's steps: 3/4 and 1/4 of the rollouts from steps 1 and 2 say 3, and the solution itself is right
    (its last step is labelled by its own verdict, no rollouts); p5: 0/4, then its own wrong answer; p7 was
    cut by the token limit: both steps are rolled out, 2/4 and 3/4."""
    backend, rows, metrics = run_scripted(tmp_path, monkeypatch, digit_prompts, tiny_model_input)
    by_id = {r["id"]: r for r in rows}
    assert by_id["p3-0"]["steps"] == ["Step 1: think", "Step 2: more", "<answer>3</answer>"]
    assert by_id["p3-0"]["labels"] == [0.75, 0.25, 1.0]
    assert by_id["p5-0"]["labels"] == [0.0, 0.0]
    assert by_id["p7-0"]["labels"] == [0.5, 0.75]
    assert sorted(backend.calls) == sorted([(p, 4) for p in SCRIPT])  # each prefix once, K rollouts
    assert backend.batches == [5]  # the 5 prefixes of the 3 solutions in one generate call
    meta = json.loads(by_id["p3-0"]["metadata"])
    assert meta["rollouts"] == [4, 4, 0] and meta["rollouts_correct"] == [3, 1, 1] and meta["correct"] is True
    assert metrics["rollouts"] == 20 and metrics["steps"] == 7 and metrics["solutions"] == 3
    assert metrics["solution_accuracy"] == pytest.approx(1 / 3)


def test_step_labels_samples_at_its_precision(tmp_path, monkeypatch, digit_prompts, tiny_model_input):
    """precision: auto samples in the weights' dtype on a CPU (no autocast); bf16 asks the backend for it."""
    backend, _, _ = run_scripted(tmp_path, monkeypatch, digit_prompts, tiny_model_input)
    assert backend.made[0]["autocast_dtype"] is None
    backend, _, _ = run_scripted(tmp_path / "bf16", monkeypatch, digit_prompts, tiny_model_input, precision="bf16")
    assert backend.made[0]["autocast_dtype"] is torch.bfloat16


class CrashingBackend:
    """The real backend, killed at its `crash_at`-th generate call (0: the solutions)."""

    def __init__(self, real, crash_at: int | None):
        self.real, self.crash_at, self.calls = real, crash_at, 0

    def generate(self, *args, **kwargs):
        if self.calls == self.crash_at:
            raise KeyboardInterrupt("killed")
        self.calls += 1
        return self.real.generate(*args, **kwargs)


LEAKY_ENV = """
from schemas.configs import RewardSpec
from stages.environments.base import Observation
from stages.rewards.verifiers import score


class Episode:
    def __init__(self, row):
        self.row, self.turns = row, 0

    def step(self, turn):
        self.turns += 1
        if self.turns > 1:
            return None
        return Observation("\\n\\n<answer>" + self.row["answer"] + "</answer>\\n\\n", tool_call=True)


class Leaky:
    name, stop = "leaky", ()

    def start(self, row):
        return Episode(row)

    def score(self, row, completion, num_tokens=None, rm_score=None):
        return score(row, completion, RewardSpec(), num_tokens=num_tokens)


def environment(**options):
    return Leaky()
"""


def test_step_labels_with_a_tool_cut_steps_from_the_transcript_and_verify_only_the_models_text(
        tmp_path, digit_prompts, tiny_model_input):
    """A tool that answers every first turn with the right answer as its own step: the steps show it (they are
    cut from the transcript), yet no label or verdict counts it (only the model's own text is verified, the
    rollouts' prefixes included), though the transcripts themselves would verify."""
    from schemas.configs import EnvironmentSpec, GenerationSpec

    env_file = tmp_path / "leaky.py"
    env_file.write_text(LEAKY_ENV)
    cfg = StepLabelsConfig(rollouts=2, solutions_per_prompt=1, max_prompts=3, max_solutions=3,
                           environment=EnvironmentSpec(name=str(env_file), max_turns=2, max_total_tokens=100),
                           generation=GenerationSpec(max_new_tokens=6, temperature=1.0))
    step_labels.check(cfg)
    assert step_labels.cache_salt(cfg) == hashlib.sha256(LEAKY_ENV.encode()).hexdigest()
    out = step_labels.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, LocalContext(tmp_path / "r"))
    rows = fake_input(out["steps"].path, "dataset", "steps").table("steps").to_pylist()
    assert len(rows) == 3
    for row in rows:
        answer = json.loads(row["metadata"])["answer"]
        assert f"<answer>{answer}</answer>" in row["steps"]  # the tool's answer is a step of the transcript
        assert step_labels.verdict({"answer": answer, "verifier": "exact"}, "\n\n".join(row["steps"]), cfg)
        assert row["labels"] == [0.0] * len(row["labels"])
    assert out["steps"].metrics["solution_accuracy"] == 0.0 and out["steps"].metrics["rollouts"] > 0
    with pytest.raises(ConfigError, match="vllm samples one turn"):
        step_labels.check(cfg.model_copy(update={"generation": GenerationSpec(backend="vllm")}))


def test_step_labels_resume_after_a_kill_labels_what_an_unbroken_run_does(tmp_path, monkeypatch, digit_prompts,
                                                                        tiny_model_input):
    """Killed while rolling out its second group, then run again in the same place: the first group is read from
    the journal (one generate call fewer) and the rows equal those of an unbroken run. A journal file of other
    solutions is not trusted."""
    cfg = StepLabelsConfig(rollouts=2, solutions_per_prompt=2, max_prompts=8, delimiter="newline", max_steps=3,
                           generation={"max_new_tokens": 12, "temperature": 1.0, "batch_size": 1})
    inputs = {"model": tiny_model_input, "prompts": digit_prompts}
    real = step_labels.make_backend
    made: list[CrashingBackend] = []

    def run(root, crash_at=None):
        monkeypatch.setattr(step_labels, "make_backend",
                            lambda *a, **k: made.append(CrashingBackend(real(*a, **k), crash_at)) or made[-1])
        out = step_labels.run(cfg, inputs, LocalContext(root))["steps"]
        return fake_input(out.path, "dataset", "steps").table("steps").to_pylist()

    unbroken = run(tmp_path / "a")
    groups = made[-1].calls - 1  # one generate call per group, after the solutions
    assert groups >= 3
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", crash_at=2)  # the solutions, group 0, then killed at group 1
    journal = tmp_path / "b" / "checkpoints" / "step_labels"
    assert sorted(p.name for p in journal.iterdir()) == ["group-00000.json"]
    assert run(tmp_path / "b") == unbroken and made[-1].calls == groups  # group 0 read back, not rolled out
    # a group file naming other solutions is labelled again
    (journal / "group-00001.json").write_text(json.dumps({"solutions": ["x-0"], "texts_sha256": "0", "results": []}))
    (journal / "group-00002.json").write_text("{torn")
    assert run(tmp_path / "b") == unbroken and made[-1].calls == 1 + 2
    saved = json.loads((journal / "group-00000.json").read_text())
    (journal / "group-00000.json").write_text(json.dumps(saved | {"results": saved["results"][:-1]}))  # one short
    assert run(tmp_path / "b") == unbroken and made[-1].calls == 1 + 1


def test_chunks_group_solutions_by_prefixes_to_roll_out():
    """Solutions with 3, 0, 3, 3, 1 prefixes, at least 4 per generate call: [3, 0, 3] then [3, 1]; the rest
    (fewer than 4) is a last group of its own."""
    plans = [step_labels.Plan([], None, list(range(k))) for k in (3, 0, 3, 3, 1, 2)]
    assert step_labels.prefix_batches(plans, 4) == [range(0, 3), range(3, 5), range(5, 6)]
    assert step_labels.prefix_batches(plans, 100) == [range(0, 6)] and step_labels.prefix_batches([], 4) == []


def test_step_labels_hard_and_max_steps(tmp_path, monkeypatch, digit_prompts, tiny_model_input):
    """hard: any right rollout → 1. max_steps=2 folds p3's steps 2 and 3 into one (its end keeps the
    solution's own verdict), so only the first prefix of p3 is rolled out."""
    _, rows, _ = run_scripted(tmp_path, monkeypatch, digit_prompts, tiny_model_input, label="hard")
    assert {r["id"]: r["labels"] for r in rows} == {"p3-0": [1.0, 1.0, 1.0], "p5-0": [0.0, 0.0], "p7-0": [1.0, 1.0]}
    backend, rows, _ = run_scripted(tmp_path / "cap", monkeypatch, digit_prompts, tiny_model_input, max_steps=2)
    p3 = next(r for r in rows if r["id"] == "p3-0")
    assert p3["steps"] == ["Step 1: think", "Step 2: more\n\n<answer>3</answer>"] and p3["labels"] == [0.75, 1.0]
    assert ("Step 1: think\n\nStep 2: more", 4) not in backend.calls


def test_step_labels_refuses_solutions_of_unknown_prompts(tmp_path, monkeypatch, digit_prompts, tiny_model_input):
    data = samples_input(tmp_path, [{"prompt_id": "p99", "completion": RIGHT}])
    with pytest.raises(SchemaError, match="row 0: its prompt is not in the prompts input"):
        step_labels.run(StepLabelsConfig(), {"model": tiny_model_input, "prompts": digit_prompts, "solutions": data},
                        LocalContext(tmp_path / "x"))


def test_step_labels_samples_its_own_solutions_with_the_tiny_model(tmp_path, digit_prompts, tiny_model_input):
    """No solutions input: 2 prompts x 2 solutions sampled, cut at newlines, K = 2 rollouts per step. The
    random tiny model is never right: every label is 0 and the rollouts add up."""
    cfg = StepLabelsConfig(rollouts=2, solutions_per_prompt=2, max_prompts=2, delimiter="newline", max_steps=3,
                           generation={"max_new_tokens": 12, "temperature": 1.0})
    out = step_labels.run(cfg, {"model": tiny_model_input, "prompts": digit_prompts}, LocalContext(tmp_path))["steps"]
    rows = fake_input(out.path, "dataset", "steps").table("steps").to_pylist()
    assert 1 <= len(rows) <= 4 and all(1 <= len(r["steps"]) <= 3 for r in rows)
    assert all(x == 0.0 for r in rows for x in r["labels"])
    metas = [json.loads(r["metadata"]) for r in rows]
    assert out.metrics["rollouts"] == sum(sum(m["rollouts"]) for m in metas) + 2 * sum(m["unlabelled_steps"] for m in metas)
    assert all(all(k in (0, 2) for k in m["rollouts"]) for m in metas)


# ---------------------------------------------------------------------------- prm


def rule_rows(n: int, seed: int = 0) -> list[dict]:
    """A learnable step rule: a step ending in "yes" is right, "no" wrong; once a solution goes wrong it
    stays wrong (so the first error is meaningful). One solution per prompt, 1-4 steps."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = rng.randint(1, 4)
        first_bad = rng.randint(0, k)  # k: no error
        steps = [f"s{j} {rng.randint(0, 9)} {'yes' if j < first_bad else 'no'}" for j in range(k)]
        rows.append({"id": f"r{i}", "messages": [{"role": "user", "content": f"Q{i}?"}], "steps": steps,
                     "labels": [1.0 if j < first_bad else 0.0 for j in range(k)], "source": "rule", "metadata": "{}"})
    return rows


@pytest.fixture()
def rule_steps(tmp_path):
    out = write_dataset(LocalContext(tmp_path / "rule"), "steps", from_rows(rule_rows(60), "steps"), "steps")
    return fake_input(out.path, "dataset", "steps")


PRM_CFG = dict(max_steps=25, batch_size=8, learning_rate=3e-3, max_length=128, lora={"r": 0}, eval_fraction=0.25,
               validation_fraction=0.0, checkpoint_every=20, warmup_ratio=0.1)


def test_prm_learns_a_step_rule_above_the_majority_baseline(tmp_path, rule_steps, tiny_model_input):
    """Held out (15 prompts): step accuracy above the held-out labels' majority class, AUROC near 1,
    first errors found; then the artifact loads as a StepScorer and scores a new completion's steps."""
    from stages.modeling.heads import StepScorer

    out = prm.run(PRMConfig(**PRM_CFG), {"model": tiny_model_input, "steps": rule_steps},
                  LocalContext(tmp_path / "run"))["model"]
    m = out.metrics
    assert m["eval_solutions"] == 15 and m["solutions_train"] == 45
    assert m["eval_step_accuracy"] > m["eval_majority_baseline"] + 0.1, m
    assert m["eval_accuracy_gain"] == pytest.approx(m["eval_step_accuracy"] - m["eval_majority_baseline"])
    assert 0 < m["eval_accuracy_gain_low"] < m["eval_accuracy_gain"] < m["eval_accuracy_gain_high"] and m["eval_prompts"] == 15
    assert m["eval_auroc"] > 0.9 and m["eval_first_error_accuracy"] > 0.6, m
    assert m["train_loss_final"] < 0.5
    assert out.schema == "process_reward_model"

    scorer = StepScorer.from_input(fake_input(out.path, "model", out.schema))
    conv = [{"role": "user", "content": "Q99?"}]
    scored = scorer.score_steps([conv, conv], ["s0 1 yes\n\ns1 2 no", "one step, no delimiter yes"])
    (ends, probs), (_, one) = scored
    assert ends == [8, 17] and len(probs) == 2 and probs[0] > 0.5 > probs[1]
    assert len(one) == 1
    texts = ["s0 1 yes\n\ns1 2 no", "s0 1 yes\n\ns1 3 yes", "  "]
    mins = scorer.score([conv] * 3, texts, aggregation="min")
    assert mins[0] == pytest.approx(min(probs), abs=1e-5) and mins[1] > mins[0] and mins[2] is None
    prods = scorer.score([conv] * 3, texts, aggregation="product")
    assert prods[0] == pytest.approx(probs[0] * probs[1], abs=1e-5)
    with pytest.raises(ValueError, match="unknown step-score aggregation"):
        scorer.score([conv], ["a"], aggregation="max")


def test_split_rows_keeps_prompts_on_one_side_and_the_held_out_share_fixed():
    """train / validation / held-out never share a prompt; adding a validation share takes it from the training
    prompts and leaves the held-out solutions as they were."""
    rows = rule_rows(40)
    rows += [dict(r, id=r["id"] + "b") for r in rows[:20]]  # 20 prompts with two solutions each
    prompt = [json.dumps(r["messages"]) for r in rows]
    train0, val0, held0 = prm.split_rows(rows, PRMConfig(eval_fraction=0.25, validation_fraction=0.0), seed=3)
    train, val, held = prm.split_rows(rows, PRMConfig(eval_fraction=0.25, validation_fraction=0.2), seed=3)
    assert val0 == [] and held == held0 and sorted(train + val) == sorted(train0)
    assert sorted(train + val + held) == list(range(len(rows)))
    sides = [{prompt[i] for i in side} for side in (train, val, held)]
    assert not (sides[0] & sides[1] or sides[0] & sides[2] or sides[1] & sides[2])
    assert len(sides[2]) == 10 and len(sides[1]) == 6  # round(0.25 * 40) prompts held out; round(0.2 * 30) validate


def test_best_keeps_the_lowest_validation_loss_and_resumes(tmp_path):
    """`Best` saves the weights of the lowest validation loss, loads them back, and after a resume keeps only
    the best file its checkpoint state names (an orphan written after that checkpoint is deleted); a named
    file that is torn or missing restarts the choice."""
    net = torch.nn.Linear(2, 1)
    frozen = torch.nn.Linear(2, 1)
    model = torch.nn.ModuleDict({"net": net, "frozen": frozen})
    frozen.requires_grad_(False)
    ctx = LocalContext(tmp_path / "ctx")
    best = prm.Best(tmp_path / "ck")
    with torch.no_grad():
        net.weight.fill_(1.0)
    assert best.offer(10, 0.5, 0.7, model)
    with torch.no_grad():
        net.weight.fill_(2.0)
    assert not best.offer(20, 0.6, 0.6, model) and best.step == 10
    with torch.no_grad():
        net.weight.fill_(3.0)
        frozen.weight.fill_(5.0)
    best.load_into(model)
    assert net.weight.eq(1.0).all() and frozen.weight.eq(5.0).all()  # only the trainable weights come back
    state = best.state()
    assert state == {"best_step": 10, "best_loss": 0.5, "validation": [[10, 0.5, 0.7], [20, 0.6, 0.6]]}

    assert best.offer(30, 0.4, 0.8, model)  # a new best; the checkpoint at 30 never got written: a kill
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["best-step-000010.safetensors",
                                                                   "best-step-000030.safetensors"]
    resumed = prm.Best.restore(tmp_path / "ck", {"step": 20, **state}, ctx)
    assert (resumed.step, resumed.loss) == (10, 0.5)
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["best-step-000010.safetensors"]
    assert [m for s, m in ctx.metrics if s is not None] == [{"val/loss": 0.5, "val/step_accuracy": 0.7},
                                                           {"val/loss": 0.6, "val/step_accuracy": 0.6}]
    f = tmp_path / "ck" / "best-step-000010.safetensors"
    f.write_bytes(f.read_bytes()[:20])  # a torn write: unreadable
    torn = prm.Best.restore(tmp_path / "ck", state, ctx)
    assert (torn.step, torn.loss) == (0, float("inf")) and len(torn.history) == 2
    assert not f.exists()  # the unreadable file is not kept either
    lost = prm.Best.restore(tmp_path / "ck", state, ctx)
    assert (lost.step, lost.loss) == (0, float("inf")) and len(lost.history) == 2


def test_prm_saves_the_checkpoint_with_the_lowest_validation_loss(tmp_path, rule_steps, tiny_model_input):
    """With a validation split the run is validated at every checkpoint, and the saved PRM is the one with the
    lowest validation loss: scoring the validation solutions with the artifact gives that loss again."""
    from stages.modeling.heads import StepScorer

    cfg = PRMConfig(**dict(PRM_CFG, max_steps=12, checkpoint_every=4, validation_fraction=0.2))
    ctx = LocalContext(tmp_path / "run")
    out = prm.run(cfg, {"model": tiny_model_input, "steps": rule_steps}, ctx)["model"]
    m = out.metrics
    val = {s: x["val/loss"] for s, x in ctx.metrics if s is not None and "val/loss" in x}
    assert sorted(val) == [4, 8, 12]
    assert m["best_step"] == min(val, key=val.get) and m["val_loss_best"] == min(val.values())
    assert m["solutions_validation"] == 9 and m["solutions_train"] == 36 and m["eval_solutions"] == 15

    rows = rule_steps.table("steps").to_pylist()
    _, val_idx, _ = prm.split_rows(rows, cfg, ctx.seed)
    scorer = StepScorer.from_input(fake_input(out.path, "model", out.schema))
    examples = prm.encode([rows[i] for i in val_idx], scorer.tokenizer, cfg)
    again = prm.held_out_step_metrics(scorer.model, examples, scorer.pad_id, 8, "cpu")
    assert again["eval_loss"] == pytest.approx(m["val_loss_best"], abs=1e-4)


def test_prm_loss_is_the_same_for_batch_4x1_and_2x2(tmp_path, rule_steps, tiny_model_input):
    """The loss of an optimizer step is the mean over all its steps: accumulation changes nothing."""
    base = dict(PRM_CFG, max_steps=3, eval_fraction=0.0, warmup_ratio=0.0)
    a, b = LocalContext(tmp_path / "a"), LocalContext(tmp_path / "b")
    prm.run(PRMConfig(**dict(base, batch_size=4, grad_accum=1)), {"model": tiny_model_input, "steps": rule_steps}, a)
    prm.run(PRMConfig(**dict(base, batch_size=2, grad_accum=2)), {"model": tiny_model_input, "steps": rule_steps}, b)
    la = [m["train/loss"] for s, m in a.metrics if s is not None]
    lb = [m["train/loss"] for s, m in b.metrics if s is not None]
    assert len(la) == 3 and la == pytest.approx(lb, rel=1e-4)


def test_prm_from_files_with_lora_and_one_error_for_a_bad_file(tmp_path, tiny_model_input):
    """User step files alone (no steps input), LoRA merged on save; a bad file fails `check` before any
    compute with one error naming the file, line and field."""
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"prompt": r["messages"][0]["content"], "steps": r["steps"],
                                          "ratings": [1 if x else -1 for x in r["labels"]]}) for r in rule_rows(12)))
    cfg = PRMConfig(**dict(PRM_CFG, max_steps=2, lora={"r": 4, "alpha": 8, "merge": True}, files=[str(good)]))
    prm.check(cfg)
    out = prm.run(cfg, {"model": tiny_model_input}, LocalContext(tmp_path / "run"))["model"]
    assert (out.path / "model" / "prm.json").exists() and not (out.path / "model" / "adapter_config.json").exists()
    assert out.metrics["solutions_train"] + out.metrics["eval_solutions"] == 12
    assert prm.cache_salt(cfg) != prm.cache_salt(cfg.model_copy(update={"files": []})) == ""
    # a single-stage run (flows.run.deploy.run_single_stage) validates its JSON config first: the same salt
    assert prm.cache_salt(cfg) == prm.cache_salt(PRMConfig.model_validate(cfg.model_dump(mode="json")))

    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text().split("\n")[0] + "\n" + json.dumps({"prompt": "q", "steps": ["a"], "labels": [2]}))
    with pytest.raises(SchemaError, match=rf"^{bad}: line 2: field 'labels': label 0 is 2"):
        prm.check(cfg.model_copy(update={"files": [str(bad)]}))
    with pytest.raises(ConfigError, match="prm.files: .*missing.jsonl does not exist"):
        prm.check(cfg.model_copy(update={"files": [str(tmp_path / "missing.jsonl")]}))
    with pytest.raises(SchemaError, match="no step-labelled solutions"):
        prm.run(cfg.model_copy(update={"files": []}), {"model": tiny_model_input}, LocalContext(tmp_path / "none"))


def test_boundary_tokens_are_the_steps_last_characters(tiny_tokenizer):
    """The PRM reads each step at the token of its last character, after the chat-templated prompt."""
    from stages.modeling.heads import encode_steps

    conv = [{"role": "user", "content": "Q?"}]
    ids, pos = encode_steps(tiny_tokenizer, conv, "ab\n\ncd", [2, 6], max_length=128)
    assert [tiny_tokenizer.decode([ids[p]]) for p in pos] == ["b", "d"] and pos[1] == len(ids) - 1
    cut, pos_cut = encode_steps(tiny_tokenizer, conv, "ab\n\ncd", [2, 6], max_length=len(ids) - 1)
    assert cut == ids[:-1] and pos_cut == pos[:1]  # the step past the limit is dropped
    assert torch.equal(torch.tensor(cut), torch.tensor(ids[:-1]))


# ---------------------------------------------------------------------------- through the pipeline


@pytest.mark.slow
def test_prm_recipe_end_to_end_cached_and_each_new_stage_reruns_alone(tmp_path):
    """`r1flow run --recipe prm --profile tiny` runs every node; a second run reuses step_labels and prm
    from the cache; `r1flow stage` runs each new stage alone on the recorded artifacts: the same config
    is a cache hit with the same output, a changed one runs, and the PRM it publishes loads as a StepScorer."""
    from flows.cli.app import main
    from stages.modeling.heads import StepScorer
    from tests.conftest import harness_home

    with harness_home(tmp_path / "home") as home:
        out = home / "run.json"
        args = ["run", "--recipe", "prm", "--profile", "tiny", "--json", str(out)]
        assert main(args) == 0
        first = {s["node"]: s for s in json.loads(out.read_text())["stages"]}
        assert {n: s["status"] for n, s in first.items()} == dict.fromkeys(
            ["base", "prompts", "eval_base", "cold_start", "sft_cold", "eval_sft_cold", "samples", "step_labels",
             "prm", "eval_prm", "grpo_prm", "eval_grpo_prm"], "run")
        steps_fp, prm_fp = first["step_labels"]["outputs"]["steps"], first["prm"]["outputs"]["model"]
        steps = json.loads((home / "artifacts" / steps_fp / "manifest.json").read_text())
        assert steps["schema"] == "steps" and steps["rows"] >= 1 and steps["metrics"]["rollouts"] > 0
        model = json.loads((home / "artifacts" / prm_fp / "manifest.json").read_text())
        assert model["schema"] == "process_reward_model" and "train_loss_final" in model["metrics"]
        assert sorted(model["parents"]) == sorted([first["sft_cold"]["outputs"]["model"], steps_fp])
        # (its results may be byte-identical to eval_sft_cold's, one artifact: the run's record has its own metrics)
        assert {"rerank/prm_accuracy", "rerank/majority_accuracy", "rerank/pass_at_1"} <= set(first["eval_prm"]["metrics"])

        assert main(args) == 0
        again = {s["node"]: s for s in json.loads(out.read_text())["stages"]}
        assert again["step_labels"]["status"] == again["prm"]["status"] == "cached"
        assert again["prm"]["outputs"]["model"] == prm_fp

        sft_fp, prompts_fp = first["sft_cold"]["outputs"]["model"], first["prompts"]["outputs"]["prompts"]
        samples_fp = first["samples"]["outputs"]["samples"]
        st = home / "stage.json"
        assert main(["stage", "step_labels", "--recipe", "prm", "--profile", "tiny", "--input", f"model={sft_fp}",
                     "--input", f"prompts={prompts_fp}", "--input", f"solutions={samples_fp}", "--json", str(st)]) == 0
        alone = json.loads(st.read_text())
        assert alone["status"] == "cached" and alone["outputs"]["steps"] == steps_fp
        assert main(["stage", "prm", "--recipe", "prm", "--profile", "tiny", "--input", f"model={sft_fp}",
                     "--input", f"steps={steps_fp}", "--set", "max_steps=2", "--json", str(st)]) == 0
        alone = json.loads(st.read_text())
        assert alone["status"] == "run" and alone["outputs"]["model"] != prm_fp
        scorer = StepScorer.from_dir(home / "artifacts" / alone["outputs"]["model"] / "model")
        assert scorer.delimiter == "newline"
        [(ends, probs)] = scorer.score_steps([[{"role": "user", "content": "1+1?"}]], ["1 + 1 = 2\n<answer>2</answer>"])
        assert ends == [9, 28] and len(probs) == 2 and all(0.0 < p < 1.0 for p in probs)


def test_accuracy_gain_over_the_majority_label_hand_worked():
    """Prompt A's solution: probs 0.9, 0.2 for labels 1, 0 (both right); prompt B's: 0.8 for label 0 (wrong). The
    labels' majority class is 0 (1 of 3 positive), right on A's second step and on B's: the PRM's 2 of 3 minus the
    majority's 2 of 3 is 0. Resampling the 2 prompts: AA (4 - 2) / 4 = +0.5, AB 0, BB (0 - 1) / 1 = -1, each
    with probability >= 1/4, so the 95% interval is [-1, +0.5]."""
    gain, low, high = prm.accuracy_gain([torch.tensor([0.9, 0.2]), torch.tensor([0.8])],
                                        [torch.tensor([1.0, 0.0]), torch.tensor([0.0])], ["A", "B"])
    assert (gain, low, high) == (0.0, -1.0, 0.5)
