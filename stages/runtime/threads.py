"""How r1flow's processes use the machine's cores when they share it with each other or with anything else.

torch's CPU wheels run their intra-op thread pool on GNU OpenMP (libgomp). By default a libgomp thread that
finishes its share of a parallel region spins on its core for a while before it sleeps, waiting for the next
region. Alone on a machine that costs nothing; beside another busy process the spinning threads take the cores
the working threads need, and every process slows down many times over (benchmarks/contention.py; on the 2-core
machine, busy with other work at a load of 8-9, two of the test suite's files on two workers took 8m14s and 262
CPU-seconds with the default, 55 s and 29 CPU-seconds with the threads told to sleep when idle). Sleeping has a
cost too: alone on an idle machine, waking the threads for each of a small model's many short parallel regions
made decoding about a third slower. `choose_wait_policy` sets PASSIVE for this process and everything it starts
when the machine is already busy as it starts, leaves libgomp's default when it is idle, and keeps a policy the
user chose; libgomp reads it once, when torch first loads it, so it must run before `import torch` (the CLI's
first step; tests/conftest.py sets PASSIVE for the suite, which always runs beside itself).

How many threads a stage process uses (`stage_share`): an equal share of the cores among the r1flow processes
running a stage on this host at the moment it starts (each registers its pid in a per-user folder while its stage
runs), so two runs or two evals side by side take half the cores each instead of all of them twice over. A run
alone gets every core, as before. R1FLOW_THREADS wins; under `--parallel N` each worker's share of the pool is
that override (flows.run.placement.use_threads). A running stage recounts between decode steps and training steps,
at most once a second (`rebalance`): one that started alone gives up half its threads when another arrives.

Other work counts too, not only r1flow's stage processes: `rebalance` also measures how many cores the rest of the
machine kept busy since its last check (/proc/stat's busy time less this process's own CPU time) and leaves them
free (`free_cores`). A tiny `r1flow run` loop beside the default run spends most of its time in imports and its
servers, none of it a registered stage process: the default run kept both threads, spinning against that
process (its wait policy is libgomp's default when it started on an idle machine), and its first stages took
2.7-3.0x their time alone (benchmarks/RESULTS.md, issue 49).

A thread count that follows the machine's load must not change what a stage computes. MKL, torch's BLAS on x86,
splits a matrix product's inner dimension among its threads when the output is small and the inner dimension long
(a weight's gradient over every token of a batch), so the same training step rounded differently on 1 and on 2
threads, and Adam carried the last bits into every weight: the same cache key gave other model bytes depending on
what else ran on the machine (a `--parallel 2` or cluster run differed from the sequential run).
`reproducible_products` turns on MKL's strict conditional numerical reproducibility (MKL_CBWR=AUTO,STRICT: the same
code path as before, results independent of the thread count); with it a SmolLM2-shaped training step (loss,
gradients, clipped norm, AdamW) gives the same bytes on 1 and 2 threads, and the tiny `r1` the same fingerprints at
every stage, at no measurable cost (benchmarks/RESULTS.md). Not covered: torch's own sum of a whole tensor of more
than 32768 numbers is split among threads too (`x.sum()` of 65536 floats differs on 1 and 2 threads); none on the
training path changed those checks' bytes, but a stage that adds one can depend on its thread count again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from schemas.errors import ConfigError

WAIT_POLICY_VAR = "OMP_WAIT_POLICY"
REPRODUCIBLE_VAR, REPRODUCIBLE = "MKL_CBWR", "AUTO,STRICT"  # MKL's products independent of the thread count
THREADS_VAR = "R1FLOW_THREADS"  # threads per stage process (default: an equal share of the cores)
REGISTRY_VAR = "R1FLOW_STAGE_PROCESSES"  # the folder of running stage processes (default: per user, in /dev/shm)
REBALANCE_EVERY_S = 1.0  # `rebalance` recounts at most this often
_running: dict = {}  # this process's stage, while one runs: registry folder, cores, last count time


def choose_wait_policy(env: dict[str, str] | os._Environ = os.environ, load: float | None = None,
                       cores: int | None = None) -> str:
    """The OpenMP wait policy of this process and everything it starts, chosen before torch loads libgomp: a
    policy the environment names is kept; otherwise, when the machine is already busy (load average over the
    last minute at least its cores), OMP_WAIT_POLICY=PASSIVE, so idle threads sleep instead of spinning on cores
    other work needs; on an idle machine libgomp's default (a short spin), which decodes a small model about a
    third faster alone (benchmarks/RESULTS.md). r1flow processes that meet later split the cores between them
    (`stage_share`, `rebalance`): with one thread each there is no idle thread left to spin. Returns the policy in
    effect ("default" when none is set)."""
    if env.get(WAIT_POLICY_VAR):
        return env[WAIT_POLICY_VAR]
    load = os.getloadavg()[0] if load is None else load
    if load >= (cores or available_cpus()):
        env[WAIT_POLICY_VAR] = "PASSIVE"
        return "PASSIVE"
    return "default"


def reproducible_products(env: dict[str, str] | os._Environ = os.environ) -> str:
    """MKL_CBWR=AUTO,STRICT for this process and everything it starts, unless the environment names a mode: MKL's
    matrix products then give the same bits on any number of threads, so a stage's outputs do not depend on the
    share of the cores it was given. The mode also picks MKL's code path: a reward model's score head (a
    matrix-vector product) rounds differently without it, even on one thread. MKL reads the variable once, at the
    process's first product (not when torch is imported), and keeps that mode for good: it must be set before then
    (the CLI's first step; `stage_share` again, for processes that did not start from the CLI). A Ray worker may
    already have run a product when a stage task starts in it, so a cluster run hands the driver's mode to its
    workers' environment as they start (flows.run.placement.worker_env), where a node's own environment may have none.
    Returns the mode in effect."""
    return env.setdefault(REPRODUCIBLE_VAR, REPRODUCIBLE)


def describe() -> str:
    """For a run's header: the wait policy and MKL's reproducibility mode in effect."""
    return (f"{WAIT_POLICY_VAR}={os.environ.get(WAIT_POLICY_VAR) or 'unset (libgomp default: the machine was idle)'}, "
            f"{REPRODUCIBLE_VAR}={os.environ.get(REPRODUCIBLE_VAR) or 'unset'}")


def thread_share(processes: int, cpus: int, override: str | None = None) -> int:
    """Threads for each of `processes` stage processes sharing `cpus` cores: an equal share, at least one (torch's
    default of one thread per core in every process makes N processes spin-wait on each other's cores). override:
    R1FLOW_THREADS, a positive integer, wins."""
    if override:
        try:
            n = int(override)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigError(f"{THREADS_VAR}={override!r}: expected a positive number of threads")
        return n
    return max(1, cpus // max(1, processes))


def available_cpus() -> int:
    """The cores this process may run on (its affinity mask, which a container or taskset narrows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def registry_dir() -> Path:
    """Where running stage processes register: R1FLOW_STAGE_PROCESSES, else a per-user folder in /dev/shm (the
    temp folder where there is none). Host-wide on purpose: runs in different homes share the same cores."""
    base = os.environ.get(REGISTRY_VAR)
    if base:
        return Path(base)
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return root / f"r1flow-{os.getuid() if hasattr(os, 'getuid') else 'user'}-stages"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22): tells a live registrant from
    a new process that reuses a dead one's pid. None: no such process (or no /proc: then liveness by signal 0)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"


def running_stage_processes(directory: Path) -> int:
    """How many processes are registered in `directory` and still alive; entries of dead processes are removed."""
    live = 0
    for entry in directory.glob("*.pid"):
        try:
            pid, started = int(entry.stem), entry.read_text().strip()
        except (ValueError, OSError):
            continue
        now = _start_time(pid)
        if now is not None and (now == started or "?" in (now, started)):
            live += 1
        else:
            entry.unlink(missing_ok=True)
    return live


@contextlib.contextmanager
def stage_share(log: logging.Logger | logging.LoggerAdapter | None = None,
                directory: Path | None = None) -> Iterator[int]:
    """While a stage runs in this process: register it, set torch's intra-op threads to this process's share of
    the cores (thread_share over the stage processes running on this host, this one included) and log the choice.
    Yields the thread count; deregisters on the way out. A registry that cannot be written (read-only /dev/shm)
    counts this process alone."""
    reproducible_products()  # before the stage's first matrix product
    import torch

    directory = directory or registry_dir()
    entry = directory / f"{os.getpid()}.pid"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        entry.write_text(_start_time(os.getpid()) or "?")
        processes = max(1, running_stage_processes(directory))
    except OSError:
        entry, processes = None, 1
    cpus = available_cpus()
    threads = thread_share(processes, cpus, os.environ.get(THREADS_VAR))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    if entry is not None:
        checked = time.monotonic()
        _running.update(directory=directory, cpus=cpus, checked=checked, busy=busy_sample(checked))
    if log is not None:
        chosen = f"{THREADS_VAR}" if os.environ.get(THREADS_VAR) else f"{processes} r1flow stage process(es) on {cpus} cores"
        log.info("threads: %d (%s; set %s to choose)", threads, chosen, THREADS_VAR)
    try:
        yield threads
    finally:
        _running.clear()
        torch.set_num_threads(before)
        if entry is not None:
            entry.unlink(missing_ok=True)


def machine_busy_seconds() -> float | None:
    """CPU seconds every core of the machine has spent busy since boot: /proc/stat's first line, all but idle and
    iowait (user, nice, system, irq, softirq, steal), in clock ticks. None without /proc."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def busy_sample(now: float) -> tuple[float, float, float] | None:
    """(wall, machine busy seconds, this process's CPU seconds) now, for `other_busy_cores`; None without /proc."""
    busy = machine_busy_seconds()
    return None if busy is None else (now, busy, time.process_time())


def other_busy_cores(before: tuple[float, float, float], after: tuple[float, float, float]) -> float:
    """(pure) How many cores other processes kept busy between two `busy_sample`s: the machine's busy seconds less
    this process's own CPU seconds, over the wall seconds between them (0 when no time passed)."""
    wall = after[0] - before[0]
    if wall <= 0:
        return 0.0
    return max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / wall)


def free_cores(cpus: int, others: float) -> int:
    """(pure) The cores this process may use while others keep `others` cores busy: the rest, rounded to the nearest
    core (half a core of other work does not take a core away), at least one."""
    return max(1, cpus - int(others + 0.5))


def rebalance(now: float | None = None) -> int | None:
    """Between batches or steps of a running stage: at most every REBALANCE_EVERY_S, recount the stage processes
    on this host and measure the cores other work kept busy since the last check; set torch's threads to this
    process's share (`thread_share`), no more than the cores left free (`free_cores`), if that moved. Returns the
    threads in use; None outside a stage, or when R1FLOW_THREADS fixes them. A directory listing, a /proc read per
    registrant and one of /proc/stat: microseconds."""
    if not _running or os.environ.get(THREADS_VAR):
        return None
    import torch

    now = time.monotonic() if now is None else now
    if now - _running["checked"] < REBALANCE_EVERY_S:
        return torch.get_num_threads()
    _running["checked"] = now
    try:
        processes = max(1, running_stage_processes(_running["directory"]))
    except OSError:
        return torch.get_num_threads()
    threads = thread_share(processes, _running["cpus"])
    sample, before = busy_sample(now), _running.get("busy")
    if sample is not None:
        _running["busy"] = sample
        if before is not None:
            threads = min(threads, free_cores(_running["cpus"], other_busy_cores(before, sample)))
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    return threads
