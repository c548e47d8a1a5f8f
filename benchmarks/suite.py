"""r1flow against TRL on the same configuration: SFT, DPO, GRPO (two shapes; generation inside GRPO), side by side.

    make bench-setup                      # once: .bench-venv with TRL (not an r1flow dependency) and r1flow -e
    make bench                            # tiny (a smoke run) and SmolLM2-135M on this machine's device
    make bench ARGS="--models smollm2 --repeats 2"                    # the targets' run (issue 25)
    make bench ARGS="--models tiny --quick"
    make bench ARGS="--models smollm2 --tasks sft,dpo --repeats 3"   # alternating runs, pooled medians
    make bench ARGS="--allocator glibc"                               # glibc's defaults on both sides
    .bench-venv/bin/python benchmarks/suite.py --models smollm2 --tasks grpo --json out.json

Printed per model: SFT tokens/s, DPO pairs/s, GRPO step time split into generation / scoring /
training, generation tokens/s (the GRPO rollouts), peak memory; each as r1flow, TRL and a `ratio`
(speed: how many times faster r1flow is; memory: TRL's peak / r1flow's, above 1 means r1flow
uses less), then the run as a RESULTS.md section (heading, command, environment, one table per model
`| measurement | r1flow | TRL | ratio | target |`). Every (framework, task) runs in its own subprocess,
so imports, allocator state and peak memory are its own; both sides run in the same interpreter with the
same torch, transformers, peft and accelerate.

Targets (SmolLM2 only; `tiny` is a smoke run of every code path, without targets): on CPU SFT and DPO
>= 1.5x, both GRPO shapes >= 3x; on CUDA GRPO >= 10x.

What is equal on both sides (benchmarks/common.py SHAPES and LONG_GRPO hold the numbers):
- the environment: every child (r1flow, TRL, r1flow's DPO reference pass) gets the environment
  built by one function (`child_env`), so the same variables. The allocator: `--allocator tuned`
  (default) gives both sides r1flow's glibc tuning (stages/runtime/host_memory.py: freed blocks up to 1 GiB kept
  in the heap) as MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_; `--allocator glibc` gives both glibc's
  defaults. r1flow's in-process tuning is off in both (R1FLOW_MALLOC_TUNING=0). Each child reports the
  setting it ran under (the variables, whether r1flow tuned anything itself, and where glibc put a 48 and
  a 160 MiB block); the suite stops if two children's reports differ, and states the one setting in the
  header. MALLOC_* variables or malloc GLIBC_TUNABLES of the caller's own are refused unless the mode
  sets the same. The data preparation runs in the parent, before any measured process.
- the model artifact (the same directory, fp32 weights), tokenizer and chat template; the same
  synthetic SFT / preference data (random words, fixed token counts) and the same reasoning-gym
  basic_arithmetic prompts; sequences fit max_length, so nothing is truncated on either side;
- precision: fp32 on CPU; bf16 autocast on CUDA (r1flow `precision: auto`, TRL `bf16=True`);
- full fine-tuning by default (`--lora R` puts the same LoRA on both: r1flow's LoraSpec defaults,
  alpha 32, all linear layers); AdamW, weight decay 0, clip 1.0, constant LR 1e-6, no warm-up;
  one micro-batch per optimizer step for SFT/DPO; no gradient checkpointing (TRL's default is
  on; r1flow has none); no checkpoints, logging or evaluation during the timed steps;
- SFT: batch of `sft_batch` conversations, loss on the assistant turn only (TRL: prompt-completion
  data, `completion_only_loss=True`), no packing, padding to the longest in the batch;
- DPO: sigmoid loss, beta 0.1, `dpo_batch` pairs per step through one concatenated forward pass;
  the reference log-probs are computed before training on both sides: r1flow's
  `reference_logprobs` stage in its own process (the cached artifact the issue asks about; its
  time is printed, not counted in pairs/s), TRL's `precompute_ref_log_probs=True` with the same
  batch (2 * dpo_batch sequences), inside the trainer, so its memory window includes it;
- GRPO, two shapes: `grpo` (CPU: 4 prompts x 4 completions x <= 32 tokens; CUDA: 16 x 8 x 128) and
  `grpo_long` (CPU: 4 x 8 x <= 128 tokens, closer to real use: prefix sharing saves less there; one
  warm-up and two timed steps a run). The same prompts, in the same order, each step: the parent lists
  every step's prompt ids (r1flow's own seeded pick, `stages.training.rollouts.pick_prompts`), TRL's trainer reads
  exactly that list, unshuffled, and both sides record the ids they sampled for; the suite stops if
  either differs from the list. So completion lengths differ by sampling only (both printed).
  `grpo_prompts` prompts x `grpo_group` completions x at most `grpo_new_tokens` new tokens,
  temperature 1, top-p 1, no top-k, beta 0 (no reference model), one optimisation epoch
  (mu = num_iterations = 1), clip 0.2, per-group std-scaled advantages, per-sequence mean loss
  (TRL `loss_type="grpo"`), `grpo_minibatch` sequences per forward/backward and one optimizer
  step per rollout batch (TRL: per_device_train_batch_size = minibatch, gradient accumulation =
  prompts * group / minibatch); transformers generation on both (TRL `use_vllm=False`), all
  prompts of a step in one generate() call; the reward on both is r1flow's scorer
  (`stages.rewards.verifiers.score`, accuracy + 0.2 format). Neither side runs a separate old-log-prob pass
  at mu = 1 (r1flow takes them from the epoch's own forward, TRL skips them).
- timing: the first step is warm-up and not timed; the median of the remaining steps is reported.
  SFT/DPO step = interval between two consecutive step ends (r1flow: its per-step metric log; TRL:
  on_step_end), GRPO split = r1flow's own time/* metrics, and for TRL clocks around
  `_generate` and `_calculate_rewards` with training = step - generation - scoring.
- peak memory: CPU, the resident-set high-water mark of the window from just before the data is
  read and the model loaded to the end of training (r1flow: the whole stage run, final save included), minus RSS at its start (VmHWM reset via /proc/self/clear_refs);
  CUDA, torch.cuda.max_memory_allocated over the same window.

Shapes: on CPU a small batch (SFT 4-8 sequences, DPO 2-4 pairs, the two GRPO shapes above) for `tiny`
and `smollm2`; on CUDA the issue's shape, GRPO 16 prompts x 8 x 128 tokens, and a random ~1B Llama (`1b`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import (  # noqa: E402
    ALLOCATOR_MODES,
    CACHE_DIR,
    MODEL_REFS,
    SEED,
    AllocatorProbe,
    Shape,
    UnfairComparison,
    allocator_env,
    check_same_allocator,
    ensure_model_dir,
    grpo_long_shape,
    shape_for,
)
from benchmarks.speed_report import (  # noqa: E402
    FRAMEWORKS,
    GRPO_TASKS,
    TASKS,
    environment_line,
    pool,
    report,
    shape_line,
    speed_markdown_section,
)

RESULT_MARK = "BENCH-RESULT "
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
             "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true", "PYTHONWARNINGS": "ignore"}
# rough wall seconds of one repeat of a task, both sides and model loads together, on 2 quiet AVX-512 cores (runs of
# 66df32b; grpo_long from a contended run and r1flow's quiet step, ~26 s): for the printed estimate only
EXPECTED_S = {("cpu", "smollm2"): {"sft": 105, "dpo": 130, "grpo": 210, "grpo_long": 300},
              ("cpu", "tiny"): {"sft": 40, "dpo": 45, "grpo": 35, "grpo_long": 40}}


def child_env(allocator: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of every child, r1flow's and TRL's alike: the caller's, CHILD_ENV and the allocator
    variables of `allocator` (ALLOCATOR_MODES); UnfairComparison for the caller's own malloc settings."""
    return allocator_env(allocator, {**(os.environ if environ is None else environ), **CHILD_ENV})


# ---------------------------------------------------------------------------- preparation (parent)


def prepare_shared_inputs(name: str, shape: Shape, work: Path, grpo_shapes: dict[str, Shape] | None = None) -> dict:
    """Model artifact and datasets both sides read: written once, before any measured process starts.

    grpo_shapes: GRPO task -> its shape; for each, `grpo_step_prompts[task]` lists the prompt ids of every
    step (warm-up included), the list both sides sample for.
    """
    from transformers import AutoTokenizer

    from benchmarks.common import path_fingerprint, preference_rows, sft_rows
    from schemas.artifacts import MODEL_DIR
    from schemas.configs import ModelConfig, PromptsConfig
    from schemas.datasets import from_rows
    from stages import import_model, prompts
    from stages.base import LocalContext, write_dataset

    ctx = LocalContext(work / "prep", cache_dir=CACHE_DIR)
    ref = MODEL_REFS[name]
    source = ensure_model_dir(name)
    model = import_model.run(ModelConfig(ref=ref if name != "1b" else str(source)), {}, ctx)["model"]
    tokenizer = AutoTokenizer.from_pretrained(model.path / MODEL_DIR)
    n_sft = max(64, shape.sft_batch * (shape.sft_steps + 2))
    n_dpo = max(32, shape.dpo_batch * (shape.dpo_steps + 2))
    sft = write_dataset(ctx, "sft", from_rows(sft_rows(tokenizer, n_sft, shape.sft_prompt_tokens,
                                                       shape.sft_completion_tokens), "sft"), "sft")
    prefs = write_dataset(ctx, "prefs", from_rows(preference_rows(tokenizer, n_dpo, shape.dpo_prompt_tokens,
                                                                  shape.dpo_completion_tokens), "preferences"),
                          "preferences")
    grpo_shapes = grpo_shapes or {"grpo": shape}
    size = max([64] + [4 * s.grpo_prompts * (s.grpo_steps + 1) for s in grpo_shapes.values()])
    prm = prompts.run(PromptsConfig(size=size), {}, ctx)["prompts"]
    out = {}
    for key, o in (("model", model), ("sft", sft), ("prefs", prefs), ("prompts", prm)):
        out[key] = {"kind": o.kind, "schema": o.schema, "path": str(o.path), "rows": o.rows,
                    "fingerprint": path_fingerprint(o.path)}
    out["grpo_step_prompts"] = {task: grpo_step_prompts(prm.path, s) for task, s in grpo_shapes.items()}
    return out


def grpo_step_prompts(prompts_dir: Path, shape: Shape) -> list[list[str]]:
    """The prompt ids of each GRPO step (warm-up first): the rows r1flow's grpo stage trains on (split
    train, with an answer) as its seeded pick chooses them (`pick_prompts`, context seed SEED)."""
    import pyarrow.parquet as pq

    from schemas.artifacts import DATA_FILE
    from schemas.configs import GRPOConfig
    from stages.training.rollouts import pick_prompts

    split = GRPOConfig.model_fields["split"].default
    rows = [r for r in pq.read_table(Path(prompts_dir) / DATA_FILE, columns=["id", "split", "answer"]).to_pylist()
            if r["split"] == split and r["answer"] is not None]
    return [[rows[i]["id"] for i in pick_prompts(len(rows), shape.grpo_prompts, SEED, step, 0)]
            for step in range(shape.grpo_steps + 1)]


# ---------------------------------------------------------------------------- children


def speed_child_main(args: argparse.Namespace) -> None:
    import torch

    prep = json.loads(Path(args.prep).read_text())
    shape = Shape(**json.loads(args.shape))
    framework, task = args.child.split(":")
    # a fresh directory per run: a stage finding an earlier run's checkpoints would resume instead of training
    work = Path(tempfile.mkdtemp(prefix=f"{framework}-{task}-", dir=args.work))
    with AllocatorProbe() as probe:  # r1flow: the setting inside its stage; TRL: the process's
        try:
            result = run_task(framework, task, prep, shape, args.device, work, args.reference)
        finally:
            # checkpoints and saved models: ~2 GB a SmolLM2 run, ~13 GB a whole suite; the DPO runs read the reference
            if task != "reference" and not args.keep_artifacts:
                shutil.rmtree(work, ignore_errors=True)
    result["threads"] = torch.get_num_threads()
    result["allocator"] = probe.report()
    print(RESULT_MARK + json.dumps(result), flush=True)


def run_task(framework: str, task: str, prep: dict, shape: Shape, device: str, work: Path,
             reference: str | None) -> dict:
    if task == "allocator":  # the allocator report alone (tests): r1flow's through run_stage, as a stage's
        if framework == "r1flow":
            from stages.base import LocalContext
            from stages.training.launch import run_stage

            run_stage(_NoStage, None, {}, LocalContext(work, device=device))
        return {}
    if framework == "r1flow":
        from benchmarks import r1flow_side as side
    else:
        from benchmarks import trl_side as side
    if task == "reference":
        return side.run_reference(prep, shape, device, work)
    if task == "dpo" and framework == "r1flow":
        return side.run_dpo(prep, shape, device, work, json.loads(Path(reference).read_text()))
    if task in GRPO_TASKS and framework == "trl":  # r1flow's stage picks the listed prompts itself (seed SEED)
        return side.run_grpo(prep, shape, device, work, prep["grpo_step_prompts"][task])
    if task in GRPO_TASKS:
        return side.run_grpo(prep, shape, device, work)
    return getattr(side, f"run_{task}")(prep, shape, device, work)


class _NoStage:
    """A stage that does nothing: `run_stage` enters its allocator block around it as around any stage."""

    @staticmethod
    def run(cfg, inputs, ctx) -> dict:
        return {}


def cpu_busy_seconds() -> float | None:
    """CPU seconds spent busy by the whole machine since boot (all cores), from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_until_quiet(max_wait: float, threshold: float = 0.2) -> float:
    """Wait (up to max_wait s) until other processes use less than `threshold` of the CPUs; return that share.

    This machine is shared (tests of other work may run): a run measured beside them is slower by
    an unknown factor, so the suite waits for a quiet moment and reports the share it saw.
    """
    deadline, share = time.monotonic() + max_wait, 1.0
    while True:
        b0 = cpu_busy_seconds()
        time.sleep(1.0)
        b1 = cpu_busy_seconds()
        if b0 is None or b1 is None:
            return 0.0
        share = (b1 - b0) / (os.cpu_count() or 1)
        if share < threshold or time.monotonic() > deadline:
            return share
        time.sleep(4.0)


def run_speed_child(what: str, device: str, prep_file: Path, shape: Shape, work: Path, log: Path,
                    reference: Path | None = None, timeout: float = 3600, quiet_wait: float = 0.0,
                    keep_artifacts: bool = False, allocator: str = "tuned") -> dict | None:
    """One (framework, task) in a fresh process under `child_env(allocator)`; its result, or None if it failed."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", what, "--prep", str(prep_file),
           "--shape", json.dumps(shape.to_dict()), "--device", device, "--work", str(work)]
    if keep_artifacts:
        cmd.append("--keep-artifacts")
    if reference is not None:
        cmd += ["--reference", str(reference)]
    if quiet_wait > 0:
        wait_until_quiet(quiet_wait)
    busy0, own0 = cpu_busy_seconds(), _children_cpu()
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=fh, text=True, cwd=ROOT,
                              env=child_env(allocator), timeout=timeout)
    wall = time.perf_counter() - t0
    busy1, own1 = cpu_busy_seconds(), _children_cpu()
    # CPU used by other processes while this run was measured, as a share of the machine's cores
    foreign = None if busy0 is None or busy1 is None else max(0.0, (busy1 - busy0) - (own1 - own0)) / (
        wall * (os.cpu_count() or 1))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)]
    if proc.returncode or not lines:
        tail = log.read_text()[-2500:]
        print(f"  !! {what} failed (exit {proc.returncode}); log {log}:\n{tail}", file=sys.stderr, flush=True)
        return None
    result = json.loads(lines[-1][len(RESULT_MARK):])
    result["wall_s"] = wall
    result["foreign_cpu"] = foreign
    return result


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def code_version() -> str:
    """The commit measured, with '+dirty' when stages/ or schemas/ differ from it (numbers belong to that code)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "stages", "schemas"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def device_info(device: str) -> dict:
    import torch
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "code": code_version()}
    if importlib.util.find_spec("trl") is not None:
        import trl

        info["trl"] = trl.__version__
    if device.startswith("cuda"):
        info["device_name"] = torch.cuda.get_device_name(0)
    else:
        info["device_name"] = (f"cpu ({os.cpu_count()} cores, {platform.machine()}, {cpu_model()}, "
                               f"torch kernels {torch.backends.cpu.get_cpu_capability()})")
    return info


def cpu_model() -> str:
    """The processor's name (/proc/cpuinfo): ratios differ between CPUs (AVX2 vs AVX-512 GEMM speed)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,smollm2", help=f"comma list of {sorted(MODEL_REFS)} (1b: CUDA only)")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    ap.add_argument("--quick", action="store_true", help="fewer timed steps (a smoke run)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run each (task, framework) this many times, alternating which side goes first; the "
                    "medians are over all repeats' warm steps and each repeat's ratio is printed beside them")
    ap.add_argument("--allocator", choices=sorted(ALLOCATOR_MODES), default="tuned",
                    help="glibc malloc settings of every child, the same on both sides: tuned = r1flow's (freed "
                    "blocks up to 1 GiB kept for reuse) through MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_, "
                    "glibc = glibc's defaults; r1flow's in-process tuning is off in both")
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank on both sides (0: full fine-tuning)")
    ap.add_argument("--cache", choices=["dynamic", "static", "graph"], default="dynamic",
                    help="KV cache of the GRPO rollouts, on both sides (r1flow generation.cache, TRL cache_implementation; "
                    "graph: r1flow's CUDA-graph decode, an implementation TRL does not have: TRL keeps its default dynamic cache)")
    ap.add_argument("--r1flow-backend", choices=["transformers", "vllm"], default="transformers",
                    help="r1flow's GRPO generation backend (vllm: a colocated engine, CUDA and the vllm extra); TRL's "
                         "GRPOTrainer keeps transformers generation, the issue's comparison")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--json", help="write every raw measurement here")
    ap.add_argument("--markdown", help="append the run's RESULTS.md section here")
    ap.add_argument("--work-dir", help="logs, prepared data and the DPO reference go here (default: a temp dir)")
    ap.add_argument("--keep-artifacts", action="store_true",
                    help="keep each run's checkpoints and saved model in the work dir (default: removed once measured)")
    ap.add_argument("--quiet-wait", type=float, default=300.0,
                    help="before each run, wait up to this many seconds for other processes to leave the CPU idle")
    for hidden in ("--child", "--prep", "--shape", "--work", "--reference"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.child:
        return speed_child_main(args)
    try:
        child_env(args.allocator)
    except UnfairComparison as e:
        ap.error(str(e))

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = [m for m in args.models.split(",") if m]
    tasks = [t for t in args.tasks.split(",") if t]
    frameworks = [f for f in args.frameworks.split(",") if f]
    for bad, known, what in ((names, MODEL_REFS, "model"), (tasks, TASKS, "task"), (frameworks, FRAMEWORKS, "framework")):
        unknown = [x for x in bad if x not in known]
        if unknown:
            ap.error(f"unknown {what}(s) {unknown}; known: {list(known)}")
    if "trl" in frameworks and importlib.util.find_spec("trl") is None:
        sys.exit("TRL is not installed in this interpreter; it lives only in the benchmark venv: run `make bench-setup`, "
                 "then `make bench` (or .bench-venv/bin/python benchmarks/suite.py), or pass --frameworks r1flow")
    command = os.environ.get("R1FLOW_BENCH_COMMAND") or "python benchmarks/suite.py " + shlex.join(sys.argv[1:])
    info = device_info(device)
    root = Path(args.work_dir or tempfile.mkdtemp(prefix="r1flow-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"r1flow vs TRL benchmark: models {names}, tasks {tasks}, device {info['device_name']}, allocator "
          f"{args.allocator} ({' '.join(f'{k}={v}' for k, v in ALLOCATOR_MODES[args.allocator].items())}) on both "
          f"sides; work dir {root}", flush=True)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    known = [EXPECTED_S[(kind, m)] for m in names if (kind, m) in EXPECTED_S]
    if len(known) == len(names) and not args.quick:
        minutes = sum(e.get(t, 0) for e in known for t in tasks) * args.repeats * len(frameworks) / len(FRAMEWORKS) / 60
        print(f"expected: about {minutes:.0f} min on 2 quiet cores, more while other processes use the CPUs (each run "
              f"first waits up to {args.quiet_wait:.0f} s for them)", flush=True)
    try:
        tables, raw, alloc = run_models(args, device, names, tasks, frameworks, root, info)
    except UnfairComparison as e:
        sys.exit(f"benchmark stopped, the two sides did not run under the same conditions: {e}")
    environment = environment_line(args.allocator, alloc, info)
    section = speed_markdown_section(command, info["device_name"], info.get("code", "unknown"), environment, tables)
    if args.json:
        for entry in raw.values():
            entry.update(allocator=alloc, environment=environment)
        Path(args.json).write_text(json.dumps(raw, indent=1))
    if args.markdown:
        with open(args.markdown, "a") as fh:
            fh.write(section)
    print("\nRESULTS.md section:\n\n" + section)


def run_models(args: argparse.Namespace, device: str, names: list[str], tasks: list[str], frameworks: list[str],
               root: Path, info: dict) -> tuple[list, dict, dict]:
    """Every (model, task, framework, repeat) run; the tables, the raw results and the one allocator setting of
    every child. UnfairComparison as soon as two children's allocator settings, or a side's GRPO prompts, differ."""
    tables, raw = [], {}
    fair = SameConditions()
    for name in names:
        shape = shape_for(device, name, quick=args.quick, lora_r=args.lora, cache=args.cache,
                          r1flow_backend=args.r1flow_backend)
        shapes = {t: shape for t in TASKS}
        shapes["grpo_long"] = grpo_long_shape(shape, device, name, quick=args.quick)
        model_tasks = [t for t in tasks if shapes[t] is not None]
        if "grpo_long" in tasks and shapes["grpo_long"] is None:
            print(f"[{name}] grpo_long: no second GRPO shape for {name} on {device} (on CUDA the GRPO shape is "
                  f"already 16 x 8 x 128)", flush=True)
        shapes = {t: shapes[t] for t in model_tasks}
        work = root / name
        prep_file = work / "prep.json"
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        prep = prepare_shared_inputs(name, shape, work, {t: shapes[t] for t in model_tasks if t in GRPO_TASKS})
        prep_file.write_text(json.dumps(prep))
        print(f"[{name}] prepared model and data in {time.perf_counter() - t0:.1f} s", flush=True)

        res: dict = {}
        for task in model_tasks:
            reference = None
            if task == "dpo" and "r1flow" in frameworks:
                ref = fair.check(f"{name} r1flow:reference", run_speed_child(
                    "r1flow:reference", device, prep_file, shape, work, work / "r1flow-reference.log",
                    quiet_wait=args.quiet_wait, keep_artifacts=args.keep_artifacts, allocator=args.allocator))
                if ref is not None:
                    reference = work / "reference.json"
                    reference.write_text(json.dumps(ref))
            runs: dict[str, list] = {fw: [] for fw in frameworks}
            for rep in range(args.repeats):
                # alternate which side goes first, so a drift in the machine's speed falls on both
                for fw in (frameworks if rep % 2 == 0 else frameworks[::-1]):
                    if fw == "r1flow" and task == "dpo" and reference is None:
                        continue
                    tag = f" (repeat {rep + 1}/{args.repeats})" if args.repeats > 1 else ""
                    print(f"[{name}] {task} / {fw}{tag} ...", flush=True)
                    suffix = f"-{rep + 1}" if args.repeats > 1 else ""
                    out = fair.check(f"{name} {fw}:{task}{suffix}", run_speed_child(
                        f"{fw}:{task}", device, prep_file, shapes[task], work, work / f"{fw}-{task}{suffix}.log",
                        reference=reference if fw == "r1flow" else None,
                        quiet_wait=args.quiet_wait if not device.startswith("cuda") else 0.0,
                        keep_artifacts=args.keep_artifacts, allocator=args.allocator),
                        prep["grpo_step_prompts"].get(task))
                    runs[fw].append(out)
                    if out is not None:
                        info["threads"] = out.get("threads", info["threads"])
                        print(f"[{name}] {task} / {fw}{tag}: {out['wall_s']:.0f} s", flush=True)
            for fw in frameworks:
                res[(task, fw)] = pool(runs[fw])
        line = shape_line(name, device, shapes)
        print(f"\n== {line} ==\n   device: {info['device_name']}; r1flow {info.get('code')}\n"
              f"   environment: {environment_line(args.allocator, fair.allocator, info)}")
        tables.append((line, report(name, device, shapes, res)))
        raw[name] = {"shape": shape.to_dict(), "shapes": {t: sh.to_dict() for t, sh in shapes.items()}, "info": info,
                     "grpo_step_prompts": prep["grpo_step_prompts"],
                     "results": {f"{t}/{f}": r for (t, f), r in res.items()}}
    return tables, raw, fair.allocator


class SameConditions:
    """Checks each child's result as it comes: every child of a run under one allocator setting, and each GRPO
    run sampling for the prompts of the list both sides read. UnfairComparison otherwise."""

    def __init__(self):
        self.reports: dict[str, dict | None] = {}  # child -> its allocator report
        self.allocator: dict = {}  # the one setting they share

    def check(self, what: str, result: dict | None, step_prompts: list[list[str]] | None = None) -> dict | None:
        if result is None:  # a failed run: nothing measured, nothing to compare
            return None
        if result.get("allocator") is None:
            raise UnfairComparison(f"{what} reported no allocator setting")
        self.reports[what] = result["allocator"]
        self.allocator = check_same_allocator(self.reports)
        if step_prompts is not None and result.get("step_prompts") != step_prompts:
            raise UnfairComparison(f"{what} sampled for the prompts {result.get('step_prompts')}, not the list "
                                   f"both sides read: {step_prompts}")
        return result


if __name__ == "__main__":
    main()
