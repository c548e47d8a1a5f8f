"""Run a stage on N processes: `accelerate launch` from the caller's process, this module in every rank.

`run_stage(module, cfg, inputs, ctx)` is what a runner calls instead of `module.run(...)`: with
`cfg.resources.num_processes` at 1 (the default, and every stage without `resources`) it is
`module.run(cfg, inputs, ctx)` in this process (on CPU with glibc's freed memory kept for reuse
while it runs: `stages.runtime.host_memory`; each rank does the same). With N > 1 it

1. writes a spec (stage module, config, the already-verified local input directories, the
   directories the runner's context gives for outputs, checkpoints and caches);
2. starts `accelerate launch --multi_gpu --num_processes N -m stages.training.launch SPEC` (accelerate's
   torchrun launcher; on CPU the processes join a gloo group, `--cpu` would start one process
   and expect mpirun for more) and waits for it;
3. while it runs, replays what rank 0 logs (params, metrics, files; a JSON-lines event file)
   into the caller's context, so MLflow curves appear live and only the caller talks to MLflow;
4. returns rank 0's outputs, already written into the caller's output directories, for the caller
   to publish as it publishes an in-process stage's. A failing rank raises `StageError` with the
   rank and the tail of its traceback.

In each rank `main()` joins the process group (`stages.runtime.distributed`), rebuilds inputs and config,
and runs `module.run` with a `RankContext`: rank 0's writes outputs where the caller asked and
records events; the others write into a scratch directory that is thrown away and record nothing.
Stages themselves keep rank-0-only work (checkpoints, saving, final evaluation) behind
`distributed.of(ctx).is_main`. Nothing here imports Prefect or MLflow: a benchmark on a machine
without them can launch a stage with a LocalContext.
"""

from __future__ import annotations

import dataclasses
import fcntl
import importlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any

from schemas.artifacts import Manifest
from schemas.errors import ConfigError, StageError
from stages.base import Input, Output, StageContext, check_finite_losses
from stages.runtime import distributed, host_memory, lifetime

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC_FILE, EVENTS_FILE, RESULT_FILE, OUTPUT_LOG = "spec.json", "events.jsonl", "result.json", "output.log"
TAIL_LINES = 40
RANKS_WAIT_S = 60.0  # how long a launch waits for the ranks of an earlier, killed run of the same stage to exit
WORK_PREFIX = "r1flow-launch-"


def ranks_lock_path(checkpoint_dir: Path) -> Path:
    """Every rank holds this file shared-locked while it lives; a launch takes it exclusively first."""
    return checkpoint_dir.parent / f"{checkpoint_dir.name}.ranks.lock"


def wait_for_earlier_ranks(checkpoint_dir: Path, stage: str, log: logging.Logger, timeout: float = RANKS_WAIT_S) -> None:
    """Return once no rank of an earlier run of this stage (same checkpoint directory) is alive.

    The runner's stage lock serialises runners, but ranks outlive a runner killed with -9 by up to
    a second or two (stages.runtime.lifetime ends them): a re-run must not train into the same checkpoint
    folder meanwhile. StageError if they are still there after `timeout` seconds."""
    path = ranks_lock_path(checkpoint_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        deadline = time.monotonic() + timeout
        said = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StageError(f"{stage}: processes of an earlier run still hold {path} after {timeout:.0f} s "
                                     f"(`fuser {path}` names them); stop them and re-run") from None
                if not said:
                    log.warning("%s: waiting for the processes of an earlier run of this stage to exit", stage)
                    said = True
                time.sleep(0.2)
        fcntl.flock(f, fcntl.LOCK_UN)


def sweep_work_dirs(root: Path | None = None) -> int:
    """Remove launch work directories whose runner process is gone (named WORK_PREFIX<stage>-<pid>-<ticks>-*)."""
    root = Path(root or tempfile.gettempdir())
    removed = 0
    for path in root.glob(f"{WORK_PREFIX}*"):
        parts = path.name.removeprefix(WORK_PREFIX).split("-")
        try:
            pid, ticks = int(parts[-3]), int(parts[-2])
        except (IndexError, ValueError):
            continue  # not ours, or from before pids were in the name
        if not lifetime.alive(pid, ticks):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def num_processes(cfg: Any) -> int:
    resources = getattr(cfg, "resources", None)
    return resources.num_processes if resources is not None else 1


def run_stage(module: ModuleType, cfg: Any, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    """`module.run(cfg, inputs, ctx)`, on `cfg.resources.num_processes` processes when that is > 1."""
    n = num_processes(cfg)
    if n <= 1:
        with host_memory.reuse_freed_memory(ctx.device):  # CPU: freed tensors' memory is reused, not unmapped
            return module.run(cfg, inputs, ctx)
    return run_distributed(module, cfg, inputs, ctx, n)


# ---------------------------------------------------------------------------- the caller's side


def launch_command(n: int, spec: Path) -> list[str]:
    """accelerate's launcher for N local processes on a free port (the stage sets its own autocast)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(n),
            "--num_machines", "1", "--main_process_port", "0", "--mixed_precision", "no", "--dynamo_backend", "no",
            "-m", "stages.training.launch", str(spec)]


def _input_spec(inp: Input) -> dict[str, Any]:
    return {"path": str(inp.path), "manifest": json.loads(inp.manifest.to_json()),
            "base": _input_spec(inp.base) if inp.base is not None else None}


def _input_from(spec: dict[str, Any]) -> Input:
    base = _input_from(spec["base"]) if spec["base"] else None
    return Input(Path(spec["path"]), Manifest.model_validate(spec["manifest"]), base)


def run_distributed(module: ModuleType, cfg: Any, inputs: dict[str, Input], ctx: StageContext, n: int) -> dict[str, Output]:
    stage = module.__name__.rsplit(".", 1)[-1]
    backend = cfg.resources.backend
    if ctx.device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < n:
            raise ConfigError(f"{stage}.resources.num_processes={n}: only {torch.cuda.device_count()} CUDA device(s) "
                              f"here (one process per GPU)")
    wait_for_earlier_ranks(ctx.checkpoint_dir, stage, ctx.log)
    sweep_work_dirs()
    work = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{stage}-{os.getpid()}-{lifetime.start_ticks(os.getpid())}-"))
    spec = {
        "module": module.__name__, "config": cfg.model_dump(mode="json"), "seed": ctx.seed,
        "device": "cpu" if ctx.device == "cpu" else "cuda", "backend": backend,
        "inputs": {name: _input_spec(inp) for name, inp in inputs.items()},
        "outputs": {name: str(ctx.output_dir(name)) for name in module.OUTPUTS},
        "checkpoint_dir": str(ctx.checkpoint_dir), "cache_dir": str(ctx.cache_dir), "work": str(work),
        "ranks_lock": str(ranks_lock_path(ctx.checkpoint_dir)),
    }
    (work / SPEC_FILE).write_text(json.dumps(spec))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))  # N processes share the cores
    ctx.log.info("%s: launching %d processes: %s", stage, n, " ".join(launch_command(n, work / SPEC_FILE)))
    events = _Tail(work / EVENTS_FILE)
    output = _Tail(work / OUTPUT_LOG)
    proc = None
    try:
        with open(work / OUTPUT_LOG, "wb") as log_file:
            proc = subprocess.Popen(launch_command(n, work / SPEC_FILE), stdout=log_file, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=REPO_ROOT, start_new_session=True)
            while True:
                rc = proc.poll()
                _forward_events(events.lines(), ctx)
                for line in output.lines():
                    ctx.log.info("%s", line)
                if rc is not None:
                    break
                time.sleep(0.5)
        _forward_events(events.lines(final=True), ctx)
        for line in output.lines(final=True):
            ctx.log.info("%s", line)
        if rc != 0 or not (work / RESULT_FILE).exists():
            raise StageError(_failure_message(stage, n, rc, work))
        result = json.loads((work / RESULT_FILE).read_text())
        return {name: Output(o["kind"], o["schema"], Path(o["path"]), o["rows"], o["metrics"], o["extra"])
                for name, o in result["outputs"].items()}
    finally:
        if proc is not None and proc.poll() is None:  # interrupted (cancelled task, Ctrl-C): stop our launcher group
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)


class _Tail:
    """Complete new lines of a file another process appends to (a `\\r`-redrawn line: its last state)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.partial = path, 0, b""

    def lines(self, final: bool = False) -> list[str]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        data = self.partial + data
        *complete, self.partial = data.split(b"\n")
        if final and self.partial:
            complete, self.partial = [*complete, self.partial], b""
        out = [c.decode(errors="replace").rsplit("\r", 1)[-1].rstrip() for c in complete]
        return [line for line in out if line]


def _forward_events(lines: list[str], ctx: StageContext) -> None:
    for line in lines:
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a rank that was killed mid-write
            continue
        if ev["op"] == "metrics":
            ctx.log_metrics(ev["metrics"], ev["step"])
        elif ev["op"] == "params":
            ctx.log_params(ev["params"])
        elif ev["op"] == "file":
            ctx.log_file(Path(ev["path"]), ev["subdir"])


def _failure_message(stage: str, n: int, rc: int | None, work: Path) -> str:
    errors = sorted(work.glob("error-rank*.txt"))
    if errors:  # the first rank that raised; the others usually died of its absence
        first = min(errors, key=lambda p: p.stat().st_mtime)
        tail = first.read_text().splitlines()[-TAIL_LINES:]
        return f"{stage} on {n} processes: {first.stem.removeprefix('error-')} failed:\n" + "\n".join(tail)
    log = (work / OUTPUT_LOG).read_text(errors="replace").splitlines()[-TAIL_LINES:] if (work / OUTPUT_LOG).exists() else []
    return (f"{stage} on {n} processes: the launcher exited with status {rc} before rank 0 wrote its result; "
            f"its output ends:\n" + "\n".join(line.rsplit("\r", 1)[-1] for line in log))


# ---------------------------------------------------------------------------- each rank's side


class RankContext:
    """The StageContext of one launched process. Rank 0: outputs where the caller asked, events for it
    to replay. Other ranks: a scratch output directory, nothing logged."""

    def __init__(self, spec: dict[str, Any], dist: distributed.Dist, device: str):
        self.dist = dist
        self.seed = spec["seed"]
        self.device = device
        self.cache_dir = Path(spec["cache_dir"])
        self.checkpoint_dir = Path(spec["checkpoint_dir"])  # rank 0 writes; every rank resumes from it
        self.log = logging.getLogger("r1flow.stage")
        self.work = Path(spec["work"])
        self.outputs = {k: Path(v) for k, v in spec["outputs"].items()}
        self._files = 0

    def output_dir(self, name: str) -> Path:
        path = self.outputs[name] if self.dist.is_main else self.work / f"rank-{self.dist.rank}" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _emit(self, event: dict[str, Any]) -> None:
        if self.dist.is_main:
            with open(self.work / EVENTS_FILE, "a") as f:
                f.write(json.dumps(event, default=str) + "\n")

    def log_params(self, params: dict[str, Any]) -> None:
        self._emit({"op": "params", "params": params})

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        check_finite_losses(metrics, step)
        self._emit({"op": "metrics", "metrics": {k: float(v) for k, v in metrics.items()}, "step": step})

    def log_file(self, path: Path, subdir: str = "") -> None:
        if self.dist.is_main:  # a copy: the stage may delete its file before the caller gets to it
            self._files += 1
            copy = self.work / "files" / str(self._files) / Path(path).name
            copy.parent.mkdir(parents=True)
            shutil.copy2(path, copy)
            self._emit({"op": "file", "path": str(copy), "subdir": subdir})


def _output_spec(out: Output) -> dict[str, Any]:
    return {"kind": out.kind, "schema": out.schema, "path": str(out.path), "rows": out.rows,
            "metrics": {k: float(v) for k, v in out.metrics.items()}, "extra": out.extra}


def main(argv: list[str] | None = None) -> None:
    import torch

    spec_path = Path((argv or sys.argv[1:])[0])
    spec = json.loads(spec_path.read_text())
    work = Path(spec["work"])
    lifetime.watch_parent()  # the runner killed (even with -9): this rank dies at once, it writes checkpoints
    ranks_lock = open(spec["ranks_lock"], "a")  # held shared until this process exits: see wait_for_earlier_ranks
    fcntl.flock(ranks_lock, fcntl.LOCK_SH)
    dist, device = distributed.init_from_env(spec["backend"], cuda=spec["device"] == "cuda")
    resources = spec["config"].get("resources") or {}
    dist = dataclasses.replace(dist, fsdp=resources.get("distributed_type") == "fsdp")
    logging.basicConfig(level=logging.INFO if dist.is_main else logging.WARNING,
                        format=f"[rank {dist.rank}] %(levelname)s %(name)s: %(message)s")
    try:
        module = importlib.import_module(spec["module"])
        cfg = module.CONFIG.model_validate(spec["config"])
        inputs = {name: _input_from(s) for name, s in spec["inputs"].items()}
        with host_memory.reuse_freed_memory(device):
            outputs = module.run(cfg, inputs, RankContext(spec, dist, device))
        if dist.is_main:
            tmp = work / f".{RESULT_FILE}.tmp"
            tmp.write_text(json.dumps({"outputs": {k: _output_spec(v) for k, v in outputs.items()}}))
            tmp.rename(work / RESULT_FILE)
    except BaseException:
        (work / f"error-rank{dist.rank}.txt").write_text(traceback.format_exc())
        raise
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
