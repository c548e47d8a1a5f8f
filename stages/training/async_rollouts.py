"""Asynchronous rollouts (issue 60), for grpo and ppo alike: workers generate a step's groups with a policy version
up to K = `async.max_staleness` steps older than the learner's, while the learner trains. On one machine the
workers are processes beside the learner; when the stage runs on a Ray cluster they are Ray actors placed by
`async.worker_resources` (`rollout_actors`), with the same schedule, messages and weight files.

The schedule is fixed, so a run is reproducible and resumable like the synchronous loop:
- the groups the learner consumes at step s (0-based; it then holds version s, the weights after s steps; version 0
  is the input model) are sampled with exactly version `behaviour_version(s, K)` = max(0, s - K), with the
  synchronous loop's prompts and seeds (`groups.sample_groups`: `rollouts.pick_prompts`, `rollouts.rollout_seed`),
  so every group's staleness is min(K, s), and nothing is dropped or reordered;
- worker i of N generates the steps s with s % N == i, in order; it starts step s only once version max(0, s - K)
  is published, so generation never runs more than K steps ahead of the learner (throttled by construction);
- the learner publishes each version after its step as a safetensors file of the trainable weights (the adapter
  under LoRA, every weight otherwise), written atomically into `<checkpoint_dir>/async-weights/`; a worker loads
  the version it needs between steps. Versions are kept back to K before the oldest checkpoint on disk, so a
  resumed learner finds the ones its next K steps were sampled with;
- the checkpoint records every consumed group as (step, index, prompt id, version) (`checkpoint_state`); a resumed
  learner checks the record covers exactly the steps before its own and restarts the workers there, so no group is
  replayed or skipped.

A worker scores its own groups (as `sample_groups` does: dynamic sampling's refills need the rewards, and the
scoring then overlaps training too); the learner computes the advantages and trains. The cores are split evenly
between the learner and its workers (`threads.stage_share`: each worker registers as a stage process), so on 2
cores one worker and the learner get one thread each; the products are thread-count independent (MKL_CBWR), so
the split does not change what is computed.

A worker that stays silent for `sync_timeout_s` (loading a version, or generating the step the learner waits for;
the start, model load included, may take max(sync_timeout_s, STARTUP_S)), or that reports an error, ends the stage
with one StageError line naming the worker, its pid, the host (and Ray node) and the version. A worker that dies
(killed, out of memory, its Ray node lost) is replaced, up to `async.worker_restarts` times in the run, by a new
one for the same steps, starting at the first of them whose groups the learner has not received: a step's groups
depend only on the seed, the step and the published version max(0, s - K) (which is still on disk: the learner
keeps every version from its own less K), so the replacement delivers the bytes the dead worker would have, and the
run's outputs do not change; each replacement is a warning line (the dead worker, its node, the step) and counts in
`async/worker_restarts`. One death beyond the bound ends the stage with the dead worker's one line. A local worker
writes to a pipe of its own (`Outbox`), not to a queue shared with the others: a process killed while writing leaves
a shared queue's lock held and a partial message in it, which would stall every other worker; the learner closes
its copy of each pipe's writing end, so a dead worker's pipe reads to its end and then says so. Generation and
training intervals are on the wall clock (time.time), which machines of a cluster share, unlike their monotonic
clocks.

May import: `schemas`, `stages.base`, `stages.math`, `stages.modeling`, `stages.rewards`, `stages.runtime`,
`stages.sampling`, and the rest of `stages.training`; never a stage module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import shutil
import socket
import threading
import time
from multiprocessing import connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from schemas.errors import StageError
from stages.base import Input, StageContext, seed_everything
from stages.math import offpolicy
from stages.runtime import distributed, threads
from stages.training import rollout_actors
from stages.training.checkpoints import complete_checkpoints, replace_synced, trainable_state
from stages.training.groups import Groups

if TYPE_CHECKING:
    from schemas.configs import RLConfig

WEIGHTS_DIR = "async-weights"
STARTUP_S = 120.0  # a worker's start (spawn, imports, model load) may take at least this long
POLL_S = 0.02
HANG_VAR = "R1FLOW_ASYNC_TEST_HANG"  # test hook, "<worker>:<version>": that worker stops answering at that sync
EXIT_VAR = "R1FLOW_ASYNC_TEST_EXIT"  # test hook, "<worker>:<step>": that worker exits with code 3 before that step
SLOW_VAR = "R1FLOW_ASYNC_TEST_SLOW"  # test hook, "<seconds>": every worker sleeps that long before each step's groups


def behaviour_version(step: int, max_staleness: int) -> int:
    """The policy version that samples step `step`'s groups: max(0, step - K)."""
    return max(0, step - max_staleness)


def version_file(root: Path, version: int) -> Path:
    return root / f"weights-v{version:06d}.safetensors"


# ---------------------------------------------------------------------------- the worker process


@dataclasses.dataclass
class WorkerJob:
    """What a rollout worker needs (picklable: the config as its dump)."""

    index: int
    workers: int
    stage: str
    config: dict
    model: Input
    reward_model: Input | None
    rows: list[dict]
    seed: int
    device: str
    weights_dir: Path
    start: int  # the first step this worker generates is the first of its own from here
    parent: int | None  # the learner's pid: a worker whose learner is gone stops; None: a Ray actor (Ray ends it)

    def steps(self, total: int) -> range:
        first = self.start + (self.index - self.start) % self.workers
        return range(first, total, self.workers)


def _hook(var: str, index: int, at: int) -> bool:
    spec = os.environ.get(var, "")
    return bool(spec) and spec == f"{index}:{at}"


def _wait_for(path: Path, parent: int | None) -> None:
    while not path.exists():
        if parent is not None and os.getppid() != parent:
            raise SystemExit(0)
        time.sleep(POLL_S)


def _load_version(job: WorkerJob, version: int, params: dict[str, torch.nn.Parameter]) -> None:
    """Version `version`'s published weights into the worker's policy, once the learner has written them."""
    path = version_file(job.weights_dir, version)
    _wait_for(path, job.parent)
    while _hook(HANG_VAR, job.index, version):  # test hook: a sync that never completes
        _wait_for(path.with_suffix(".never"), job.parent)
    tensors = load_file(path)
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)


def _config(job: WorkerJob) -> RLConfig:
    """The stage's config, validated again from its dump (grpo's or ppo's: the one RL skeleton)."""
    from schemas.configs import GRPOConfig, PPOConfig

    return {"grpo": GRPOConfig, "ppo": PPOConfig}[job.stage].model_validate(job.config)


def _generate(job: WorkerJob, out) -> None:
    from stages.sampling.generation import TransformersBackend
    from stages.training import env_rollouts, groups
    from stages.training.optim import load_trainable, resolve_precision

    cfg = _config(job)
    seed_everything(job.seed)
    model, tokenizer, _ = load_trainable(job.model, cfg, job.device)
    model.requires_grad_(False)
    params = dict(model.named_parameters())
    precision = resolve_precision(cfg.precision, job.device)
    engine = cfg.generation.backend == "vllm"  # a vLLM engine samples; the model holds each version to push it in
    if engine:
        from stages.sampling.vllm_backend import serving_engine

        backend = serving_engine(job.model, model, tokenizer, seed=job.seed)
    else:
        backend = TransformersBackend(model, tokenizer, precision)
    env = env_rollouts.open_environment(job.stage, cfg, backend, precision)
    scorer = None
    if job.reward_model is not None and cfg.reward.weights.get("reward_model", 0) != 0:
        from stages.modeling.heads import RewardScorer

        scorer = RewardScorer.from_input(job.reward_model, device=job.device)
    out.put(("ready", job.index, -1, -1, None, 0.0, 0.0))
    held = None
    for step in job.steps(cfg.steps):
        version = behaviour_version(step, cfg.async_.max_staleness)
        if version != held:
            _load_version(job, version, params)
            if engine:  # in place, LoRA folded in (the engine holds version 0, the directory's, from the start)
                backend.sync(model, version, cfg.generation.sync_timeout_s)
            held = version
            out.put(("synced", job.index, step, version, None, 0.0, 0.0))
        if _hook(EXIT_VAR, job.index, step):
            # what it sent has left first (os._exit skips the outbox's thread), so the step it dies before is the
            # test's step, not an earlier one whose groups were still in the outbox
            getattr(out, "flush", lambda: None)()
            os._exit(3)
        t0 = time.time()
        out.put(("generating", job.index, step, version, None, t0, 0.0))
        time.sleep(float(os.environ.get(SLOW_VAR) or 0))  # test hook: a slow worker
        # dynamic sampling is grpo's (ppo's synchronous loop samples without it)
        g = groups.sample_groups(backend, job.rows, cfg, job.seed, step, distributed.SINGLE, scorer,
                                 getattr(cfg, "dynamic_sampling", False), getattr(cfg, "max_refill_rounds", 0),
                                 logprobs=True, env=env)
        g.rewards = [r.tolist() for r in g.rewards]  # plain lists through the queue (no shared-memory handles)
        out.put(("groups", job.index, step, version, g, t0, time.time()))


def worker_main(job: WorkerJob, out) -> None:
    """A rollout worker's body (a local process or a Ray actor): load the policy, then generate its steps' groups
    into `out`; an exception is one ("error", ...) message and exit code 1."""
    try:  # a local worker takes its share of the machine's cores; Ray sets an actor's from its num_cpus
        with threads.stage_share() if job.parent is not None else contextlib.nullcontext():
            _generate(job, out)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the learner reports it in one line
        out.put(("error", job.index, -1, -1, f"{type(e).__name__}: {e}", 0.0, 0.0))
        raise SystemExit(1) from None


class Outbox:
    """A local worker's end of its pipe to the learner: a thread sends what `put` is given, so the worker never
    waits for the learner to read (as a multiprocessing queue's feeder thread); `close` sends what is left."""

    def __init__(self, conn: connection.Connection) -> None:
        self.conn, self.pending = conn, queue.Queue()
        self.thread = threading.Thread(target=self._send, daemon=True, name="rollout-outbox")
        self.thread.start()

    def put(self, message: tuple) -> None:
        self.pending.put(message)

    def _send(self) -> None:
        gone = False
        while (message := self.pending.get()) is not None:
            try:
                if not gone:
                    self.conn.send(message)
            except OSError:  # the learner is gone: nobody reads (what is left is dropped, so `flush` returns)
                gone = True
            finally:
                self.pending.task_done()

    def flush(self) -> None:
        """Wait until every message put so far has been sent."""
        self.pending.join()

    def close(self) -> None:
        self.pending.put(None)
        self.thread.join()
        self.conn.close()


def local_worker_main(job: WorkerJob, conn: connection.Connection) -> None:
    """A local worker process: `worker_main` writing to its own pipe, flushed when it ends (not when it is killed)."""
    out = Outbox(conn)
    try:
        worker_main(job, out)
    finally:
        out.close()


# ---------------------------------------------------------------------------- the workers on one machine


class LocalWorker:
    """The learner's handle on one worker process and the reading end of its pipe."""

    def __init__(self, proc, conn: connection.Connection) -> None:
        self.proc, self.conn, self.host = proc, conn, socket.gethostname()

    def describe(self) -> str:
        return f"pid {self.proc.pid} on {self.host}"

    def exit_status(self) -> str | None:
        """None while the process runs; else how it ended, as the rest of a sentence."""
        return None if self.proc.exitcode is None else f"exited with code {self.proc.exitcode}"


class LocalWorkers:
    """The workers as spawned processes beside the learner, each writing to a pipe of its own."""

    def __init__(self, stage: str, jobs: list[WorkerJob]) -> None:
        self.stage, self.mp = stage, torch.multiprocessing.get_context("spawn")
        self.workers: list[LocalWorker] = [self._start(job) for job in jobs]

    def _start(self, job: WorkerJob) -> LocalWorker:
        reader, writer = self.mp.Pipe(duplex=False)
        p = self.mp.Process(target=local_worker_main, args=(job, writer), daemon=True,
                            name=f"{self.stage}-rollout-{job.index}")
        p.start()
        writer.close()  # the worker holds the only writing end: its pipe ends (EOFError) when the worker does
        return LocalWorker(p, reader)

    def replace(self, index: int, job: WorkerJob) -> None:
        """A new process for worker `index` (whose process has ended), starting at `job.start`."""
        old = self.workers[index]
        old.conn.close()
        old.proc.join(timeout=5)
        self.workers[index] = self._start(job)

    def get(self, timeout: float) -> tuple:
        """The next message of any worker (queue.Empty after `timeout` s without one)."""
        for conn in connection.wait([w.conn for w in self.workers if not w.conn.closed], timeout):
            try:
                return conn.recv()
            except (EOFError, OSError):  # its worker ended and everything it sent was read
                conn.close()
        raise queue.Empty

    def drain(self, index: int) -> list[tuple]:
        """The messages an ended worker sent that are still unread (a message cut short by its death is dropped)."""
        out, conn = [], self.workers[index].conn
        while not conn.closed and conn.poll():
            try:
                out.append(conn.recv())
            except (EOFError, OSError):
                conn.close()
        return out

    def params(self) -> dict[str, str]:
        return {"async.placement": "processes"}

    def close(self) -> None:
        """Stop the processes by their pids: SIGTERM, then SIGKILL after 10 s."""
        procs = [w.proc for w in self.workers]
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for w in self.workers:
            w.conn.close()


# ---------------------------------------------------------------------------- the learner's side


@dataclasses.dataclass
class Delivery:
    """A step's groups as the learner consumes them."""

    groups: Groups
    version: int
    staleness: int
    generated: tuple[float, float]  # the worker's generation interval (wall clock: shared across machines)


class AsyncRollouts:
    """The learner's side: publishes versions, starts the workers, takes each step's groups in order, records what
    it consumed, and measures how generation and training overlap."""

    def __init__(self, stage: str, cfg: RLConfig, ctx: StageContext, inputs: dict[str, Input], rows: list[dict],
                 model: torch.nn.Module, state: dict) -> None:
        self.stage, self.cfg, self.k = stage, cfg, cfg.async_.max_staleness
        self.timeout, self.start, self.log = cfg.async_.sync_timeout_s, state["step"], ctx.log
        self.dir = ctx.checkpoint_dir / WEIGHTS_DIR
        self.consumed: list[list] = resumed_record(state, self.start)
        self.next = self.start  # the step the learner takes next
        self.restarts = 0  # dead workers replaced in this run (at most async.worker_restarts)
        self._prepare_versions(model)
        n, on_ray = cfg.async_.rollout_workers, rollout_actors.on_ray()
        device = ("cuda" if cfg.async_.worker_resources.gpus else "cpu") if on_ray else ctx.device
        self.jobs = [WorkerJob(i, n, stage, cfg.model_dump(mode="json", by_alias=True), inputs["model"],
                               inputs.get("reward_model"), rows, ctx.seed, device, self.dir, self.start,
                               None if on_ray else os.getpid()) for i in range(n)]
        self.pool = (rollout_actors.RayWorkers(stage, self.jobs, worker_main, cfg.async_.worker_resources,
                                               max(STARTUP_S, self.timeout), ctx.log)
                     if on_ray else LocalWorkers(stage, self.jobs))
        self.workers = self.pool.workers  # the pool's list: a replacement takes its predecessor's place in it
        ctx.log_params(self.pool.params())
        self.heard = [self._startup_deadline()] * n  # when each worker last answered (at its start: later)
        self.synced = [-1] * n
        self.buffer: dict[int, Delivery] = {}
        self.generation: list[tuple[float, float]] = []  # workers' generation intervals not yet counted
        self.generating: dict[int, float] = {}  # worker -> when its generation under way began
        self.mark = self.taken = time.time()  # the start of the current step's window; when training last resumed

    def _prepare_versions(self, model: torch.nn.Module) -> None:
        """A fresh start: the folder emptied, version 0 published. A resumed one: versions after its step (of the
        interrupted attempt) removed, the K before it checked, its own republished."""
        if self.start == 0:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in self.dir.glob("weights-v*.safetensors"):
            if int(path.stem.split("-v")[1]) > self.start:
                path.unlink()
        for v in range(behaviour_version(self.start, self.k), self.start):
            if not version_file(self.dir, v).exists():
                raise StageError(f"{self.stage}: cannot resume the asynchronous loop at step {self.start}: policy "
                                 f"version {v}, which sampled step {v + self.k}, is missing from {self.dir}")
        self.publish(self.start, model)

    def publish(self, version: int, model: torch.nn.Module) -> None:
        """The trainable weights after `version` steps, atomically; versions no resume or worker needs any more
        (before the oldest checkpoint on disk, less K) removed."""
        state = trainable_state(model)
        replace_synced(version_file(self.dir, version), lambda p: save_file(state, p))
        ckpts = [int(p.name.split("-")[1]) for p in complete_checkpoints(self.dir.parent)]
        keep_from = min([version, *ckpts]) - self.k
        for path in self.dir.glob("weights-v*.safetensors"):
            if int(path.stem.split("-v")[1]) < keep_from:
                path.unlink(missing_ok=True)

    def _who(self, i: int) -> str:
        return f"{self.stage}: async rollout worker {i} ({self.workers[i].describe()})"

    def _startup_deadline(self) -> float:
        """A starting worker's `heard`: it has max(sync_timeout_s, STARTUP_S) to answer first."""
        return time.monotonic() + max(0.0, STARTUP_S - self.timeout)

    def _receive(self, step: int) -> None:
        """One message, or a check of the workers: a dead one that owes groups is replaced (or ends the stage), and
        the owner of `step` silent past its deadline ends the stage."""
        owner = step % len(self.workers)
        version = behaviour_version(step, self.k)
        try:
            self._handle(self.pool.get(timeout=0.2))
        except queue.Empty:
            for i, w in enumerate(self.workers):
                ended = w.exit_status()
                if ended is not None:
                    self._dead(i, ended)
            if step in self.buffer:
                return
            if time.monotonic() - self.heard[owner] > self.timeout:
                what = (f"did not load policy version {version}" if self.synced[owner] < version
                        else f"did not deliver step {step}'s groups (policy version {version})")
                raise StageError(f"{self._who(owner)} {what} within async.sync_timeout_s={self.timeout:g} s") from None

    def _owed(self, i: int) -> int | None:
        """Worker i's first step whose groups the learner has not received (taken or buffered); None: none is left."""
        n = len(self.workers)
        s = self.next + (i - self.next) % n
        while s in self.buffer:
            s += n
        return s if s < self.cfg.steps else None

    def _dead(self, i: int, ended: str) -> None:
        """Worker i has ended (`ended`: how): what it sent before is handled; if it still owes a step, a new worker
        starts at that step while replacements are left, else the stage ends in one line."""
        for message in self.pool.drain(i):
            self._handle(message)
        step = self._owed(i)
        if step is None:  # it finished its steps
            return
        bound = self.cfg.async_.worker_restarts
        what = f"{self._who(i)} {ended} before delivering step {step}'s groups (policy version " \
               f"{behaviour_version(step, self.k)})"
        if self.restarts >= bound:
            spent = f"; no replacement left (async.worker_restarts={bound})" if bound else ""
            raise StageError(what + spent) from None
        self.restarts += 1
        self.jobs[i] = dataclasses.replace(self.jobs[i], start=step)
        self.pool.replace(i, self.jobs[i])
        self.heard[i], self.synced[i] = self._startup_deadline(), -1
        self.generating.pop(i, None)
        self.log.warning("%s; replaced (%d of async.worker_restarts=%d) by %s, from step %d", what, self.restarts,
                         bound, self.workers[i].describe(), step)

    def _handle(self, message: tuple) -> None:
        kind, i, s, v, payload, t0, t1 = message
        self.heard[i] = time.monotonic()
        if kind == "error":
            raise StageError(f"{self._who(i)} failed: {payload}")
        if kind == "synced":
            self.synced[i] = v
        elif kind == "generating":
            self.generating[i] = t0
        elif kind == "groups":
            self.generation.append((t0, t1))
            self.generating.pop(i, None)
            if s >= self.next and s not in self.buffer:  # (a dead Ray actor's last message may follow its successor's)
                payload.rewards = [torch.tensor(r) for r in payload.rewards]
                self.buffer[s] = Delivery(payload, v, step_staleness(s, v), (t0, t1))

    def take(self, step: int) -> Delivery:
        """Step `step`'s groups (waiting for them), recorded as consumed."""
        owner = step % len(self.workers)
        self.next = step
        self.heard[owner] = max(self.heard[owner], time.monotonic())  # silence counts from when the learner waits
        while step not in self.buffer:
            self._receive(step)
        d = self.buffer.pop(step)
        self.next = step + 1
        if d.staleness > self.k:
            raise StageError(f"{self.stage}: step {step}'s groups came from policy version {d.version}, "
                             f"{d.staleness} > async.max_staleness={self.k} versions old")
        self.consumed += [[step, j, row["id"], d.version] for j, row in enumerate(d.groups.rows)]
        self.taken = time.time()  # training busy from here to `step_metrics`
        return d

    def step_metrics(self, d: Delivery) -> dict[str, float]:
        """The step's staleness (histogram bins `async/staleness_<s>`, mean, max) and, over the wall-clock since
        the previous step's metrics, the idle fractions of generation (every worker's generating and scoring) and
        of training (from `take` to here), and the share with both busy (overlap); the dead workers replaced so far
        in this run (`async/worker_restarts`)."""
        with contextlib.suppress(queue.Empty):
            while True:  # what the workers said while the learner trained
                self._handle(self.pool.get(timeout=0))
        now = time.time()
        hist = offpolicy.staleness_histogram([d.staleness] * len(d.groups.rows), self.k)
        generation = self.generation + [(t0, now) for t0 in self.generating.values()]
        busy = offpolicy.busy_fractions((self.mark, now), generation, [(self.taken, now)])
        self.generation = []
        self.mark = now
        return {**{f"async/staleness_{s}": float(c) for s, c in enumerate(hist)},
                "async/staleness_mean": float(d.staleness), "async/staleness_max": float(d.staleness),
                "async/policy_version": float(d.version), "async/generation_idle": 1.0 - busy["generation"],
                "async/training_idle": 1.0 - busy["training"], "async/overlap": busy["overlap"],
                "async/worker_restarts": float(self.restarts)}

    def checkpoint_state(self) -> dict[str, Any]:
        return {"async_consumed": list(self.consumed)}

    def close(self, finished: bool) -> None:
        """Stop the workers; after a finished run, remove the published versions."""
        self.pool.close()
        if finished:
            shutil.rmtree(self.dir, ignore_errors=True)


def step_staleness(step: int, version: int) -> int:
    """How many versions older than the learner's (version `step` when it consumes step `step`) a group is."""
    return step - version


def resumed_record(state: dict, start: int) -> list[list]:
    """The consumed groups a checkpoint recorded, checked to cover exactly steps 0..start-1 (each step's groups
    numbered from 0), so a resumed learner neither replays nor skips a group."""
    record = [list(x) for x in state.get("async_consumed", [])]
    steps = sorted({x[0] for x in record})
    if steps != list(range(start)):
        raise StageError(f"the checkpoint at step {start} records consumed groups of steps {steps[:3]}...{steps[-3:]}"
                         f" (expected 0..{start - 1}): it was not written by this asynchronous run")
    for s in steps:
        if [x[1] for x in record if x[0] == s] != list(range(sum(x[0] == s for x in record))):
            raise StageError(f"the checkpoint at step {start} records step {s}'s groups out of order")
    return record


def weight_metrics(prox_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor,
                   cap: float) -> dict[str, float]:
    """A step's importance-weight diagnostics over its trained tokens (`offpolicy.weight_stats`): mean and
    normalised ESS of min(pi_prox / mu, C), share truncated."""
    w, raw = offpolicy.importance_weights(prox_logp, behaviour_logp, mask, cap)
    return {f"async/{k}": float(v) for k, v in offpolicy.weight_stats(w, raw, mask, cap).items()}
