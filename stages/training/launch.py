"""Run a stage on N processes: `accelerate launch` from the caller's process, this module in every rank.

`run_stage(module, cfg, inputs, ctx)` is what a runner calls instead of `module.run(...)`: with
`cfg.resources.num_processes` and `nodes` at 1 (the defaults, and every stage without `resources`) it is
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

With `cfg.resources.nodes` > 1 the same happens across the machines of a Ray cluster
(`run_multi_node`): the spec goes into a work directory beside the checkpoints (R1FLOW_HOME, which
every node must share), `stages.training.ray_launch` starts one Ray actor per rank in a placement
group and each actor calls `run_rank`, the rank body `accelerate launch` runs here through `main()`;
the caller replays events and output the same way.

In each rank `run_rank` joins the process group (`stages.runtime.distributed`), rebuilds inputs and config,
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
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
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
RANKS_WORK_PREFIX = "r1flow-ranks-"  # multi-node work directories, on the shared filesystem
OWNER_FILE = "owner.json"  # in a multi-node work directory: the machine and process of its caller


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


def this_machine() -> str:
    """Host name and boot id: what a pid is relative to (a shared directory is seen from several machines)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def sweep_work_dirs(root: Path | None = None, prefix: str = WORK_PREFIX) -> int:
    """Remove launch work directories whose runner process is gone (named <prefix><stage>-<pid>-<ticks>-*).
    A directory with an OWNER_FILE (multi-node, on a shared filesystem) is judged only on the machine that
    made it: elsewhere its pid means nothing."""
    root = Path(root or tempfile.gettempdir())
    removed = 0
    for path in root.glob(f"{prefix}*"):
        parts = path.name.removeprefix(prefix).split("-")
        try:
            pid, ticks = int(parts[-3]), int(parts[-2])
        except (IndexError, ValueError):
            continue  # not ours, or from before pids were in the name
        if (path / OWNER_FILE).exists():
            try:
                if json.loads((path / OWNER_FILE).read_text())["machine"] != this_machine():
                    continue
            except (OSError, ValueError, KeyError):
                continue
        if not lifetime.alive(pid, ticks):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def num_processes(cfg: Any) -> int:
    """Processes per node (`resources.num_processes`, alias processes_per_node)."""
    resources = getattr(cfg, "resources", None)
    return resources.num_processes if resources is not None else 1


def num_nodes(cfg: Any) -> int:
    resources = getattr(cfg, "resources", None)
    return getattr(resources, "nodes", 1) if resources is not None else 1


def run_stage(module: ModuleType, cfg: Any, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    """`module.run(cfg, inputs, ctx)`: in this process; on `cfg.resources.num_processes` local processes
    when that is > 1; on `nodes` × `num_processes` Ray actors across a cluster when `nodes` > 1."""
    n = num_processes(cfg)
    if num_nodes(cfg) > 1:
        return run_multi_node(module, cfg, inputs, ctx)
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


def _write_spec(module: ModuleType, cfg: Any, inputs: dict[str, Input], ctx: StageContext, work: Path) -> Path:
    """What every rank needs to rebuild the stage call (see `run_rank`), as work/SPEC_FILE."""
    spec = {
        "module": module.__name__, "config": cfg.model_dump(mode="json"), "seed": ctx.seed,
        "device": "cpu" if ctx.device == "cpu" else "cuda", "backend": cfg.resources.backend,
        "inputs": {name: _input_spec(inp) for name, inp in inputs.items()},
        "outputs": {name: str(ctx.output_dir(name)) for name in module.OUTPUTS},
        "checkpoint_dir": str(ctx.checkpoint_dir), "cache_dir": str(ctx.cache_dir), "work": str(work),
        "ranks_lock": str(ranks_lock_path(ctx.checkpoint_dir)),
    }
    (work / SPEC_FILE).write_text(json.dumps(spec))
    return work / SPEC_FILE


def _follow(ctx: StageContext, work: Path, finished: Callable[[], bool], logs: list[Path]) -> None:
    """Until `finished()`: replay rank 0's events into ctx and log the ranks' output lines; then the rest."""
    events = _Tail(work / EVENTS_FILE)
    outputs = [_Tail(path) for path in logs]
    while True:
        done = finished()
        _forward_events(events.lines(), ctx)
        for output in outputs:
            for line in output.lines():
                ctx.log.info("%s", line)
        if done:
            break
        time.sleep(0.5)
    _forward_events(events.lines(final=True), ctx)
    for output in outputs:
        for line in output.lines(final=True):
            ctx.log.info("%s", line)


def _result(work: Path) -> dict[str, Output]:
    result = json.loads((work / RESULT_FILE).read_text())
    return {name: Output(o["kind"], o["schema"], Path(o["path"]), o["rows"], o["metrics"], o["extra"])
            for name, o in result["outputs"].items()}


def run_distributed(module: ModuleType, cfg: Any, inputs: dict[str, Input], ctx: StageContext, n: int) -> dict[str, Output]:
    stage = module.__name__.rsplit(".", 1)[-1]
    if ctx.device.startswith("cuda"):
        import torch

        if torch.cuda.device_count() < n:
            raise ConfigError(f"{stage}.resources.num_processes={n}: only {torch.cuda.device_count()} CUDA device(s) "
                              f"here (one process per GPU)")
    wait_for_earlier_ranks(ctx.checkpoint_dir, stage, ctx.log)
    sweep_work_dirs()
    work = Path(tempfile.mkdtemp(prefix=f"{WORK_PREFIX}{stage}-{os.getpid()}-{lifetime.start_ticks(os.getpid())}-"))
    spec = _write_spec(module, cfg, inputs, ctx, work)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))  # N processes share the cores
    ctx.log.info("%s: launching %d processes: %s", stage, n, " ".join(launch_command(n, spec)))
    proc = None
    try:
        with open(work / OUTPUT_LOG, "wb") as log_file:
            proc = subprocess.Popen(launch_command(n, spec), stdout=log_file, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, cwd=REPO_ROOT, start_new_session=True)
            _follow(ctx, work, lambda: proc.poll() is not None, [work / OUTPUT_LOG])
        rc = proc.returncode
        if rc != 0 or not (work / RESULT_FILE).exists():
            raise StageError(_failure_message(stage, n, rc, work))
        return _result(work)
    finally:
        if proc is not None and proc.poll() is None:  # interrupted (cancelled task, Ctrl-C): stop our launcher group
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(work, ignore_errors=True)


def run_multi_node(module: ModuleType, cfg: Any, inputs: dict[str, Input], ctx: StageContext) -> dict[str, Output]:
    """The stage on `nodes` × `num_processes` ranks, Ray actors across a cluster (`stages.training.ray_launch`).

    ConfigError before anything else when there is no Ray (not installed, or neither connected nor
    RAY_ADDRESS). The work directory is made beside the checkpoints, on the filesystem the nodes share."""
    from stages.training import ray_launch

    stage = module.__name__.rsplit(".", 1)[-1]
    nodes, per_node = num_nodes(cfg), num_processes(cfg)
    ray = ray_launch.connect(stage, nodes)
    wait_for_earlier_ranks(ctx.checkpoint_dir, stage, ctx.log)
    root = ctx.checkpoint_dir.parent
    root.mkdir(parents=True, exist_ok=True)
    sweep_work_dirs(root, RANKS_WORK_PREFIX)
    work = Path(tempfile.mkdtemp(dir=root, prefix=f"{RANKS_WORK_PREFIX}{stage}-{os.getpid()}-"
                                                  f"{lifetime.start_ticks(os.getpid())}-"))
    world = nodes * per_node
    try:
        (work / OWNER_FILE).write_text(json.dumps({"machine": this_machine(), "pid": os.getpid()}))
        os.chmod(work, 0o755)  # mkdtemp's 0700 would hide it from ranks running as another user
        spec = _write_spec(module, cfg, inputs, ctx, work)
        with ray_launch.RayRanks(ray, stage, nodes, per_node, cuda=ctx.device != "cpu", log=ctx.log) as ranks:
            ctx.log_params(ranks.params())
            ranks.start(run_rank, spec, [work / rank_log(r) for r in range(world)])
            _follow(ctx, work, ranks.finished, [work / rank_log(r) for r in range(world)])
            failed = ranks.failure()
        if failed is not None or not (work / RESULT_FILE).exists():
            raise StageError(_failure_message(stage, world, None, work, ranks.node_ips, failed,
                                              where=f"{world} processes on {nodes} nodes"))
        return _result(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def rank_log(rank: int) -> str:
    """A multi-node rank's stdout and stderr, in the work directory (rank 0's is OUTPUT_LOG, as under accelerate)."""
    return OUTPUT_LOG if rank == 0 else f"output-rank{rank}.log"


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
        elif ev["op"] == "tags":
            ctx.set_tags(ev["tags"])


def _failure_message(stage: str, n: int, rc: int | None, work: Path, node_ips: dict[int, str] | None = None,
                     fallback: str | None = None, where: str | None = None) -> str:
    """The first rank's traceback tail (its error file); else `fallback` (multi-node: what Ray said about a
    rank that died or could not start), else the end of the launcher's output. `node_ips`: rank -> node."""
    where = where or f"{n} processes"
    errors = sorted(work.glob("error-rank*.txt"))
    if errors:  # the first rank that raised; the others usually died of its absence
        first = min(errors, key=lambda p: p.stat().st_mtime)
        tail = first.read_text().splitlines()[-TAIL_LINES:]
        name = first.stem.removeprefix("error-")
        rank = name.removeprefix("rank")
        if node_ips and rank.isdigit() and int(rank) in node_ips:
            name += f" on node {node_ips[int(rank)]}"
        return f"{stage} on {where}: {name} failed:\n" + "\n".join(tail)
    if fallback:
        return f"{stage} on {where}: {fallback}"
    log = (work / OUTPUT_LOG).read_text(errors="replace").splitlines()[-TAIL_LINES:] if (work / OUTPUT_LOG).exists() else []
    return (f"{stage} on {where}: the launcher exited with status {rc} before rank 0 wrote its result; "
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

    def set_tags(self, tags: dict[str, str]) -> None:
        self._emit({"op": "tags", "tags": tags})

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
    """`python -m stages.training.launch SPEC`: one rank under `accelerate launch`."""
    lifetime.exit_without_final_collection()  # the launcher waits for every rank to exit
    run_rank(Path((argv or sys.argv[1:])[0]))


def run_rank(spec_path: Path, watch_parent: bool = True) -> None:
    """The body of every rank, under either launcher: the process group from RANK, WORLD_SIZE,
    LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (torchrun's, or
    the ones `stages.training.ray_launch` sets), then `module.run` with a RankContext; rank 0 writes
    work/RESULT_FILE, a failing rank work/error-rank<N>.txt. `watch_parent`: die with the runner
    (same machine only: a Ray actor is ended by Ray when its owner dies)."""
    import torch

    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["work"])
    if watch_parent:
        lifetime.watch_parent()  # the runner killed (even with -9): this rank dies at once, it writes checkpoints
    ranks_lock = open(spec["ranks_lock"], "a")  # held shared until this process exits: see wait_for_earlier_ranks
    fcntl.flock(ranks_lock, fcntl.LOCK_SH)
    dist, device = distributed.init_from_env(spec["backend"], cuda=spec["device"] == "cuda")
    resources = spec["config"].get("resources") or {}
    dist = dataclasses.replace(dist, fsdp=resources.get("distributed_type") == "fsdp")
    logging.basicConfig(level=logging.INFO if dist.is_main else logging.WARNING,
                        format=f"[rank {dist.rank}] %(levelname)s %(name)s: %(message)s", force=True)
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
