"""How r1flow's processes use the machine's cores when they share it with each other or with anything else.

torch's CPU wheels run their intra-op thread pool on GNU OpenMP (libgomp). By default a libgomp thread that
finishes its share of a parallel region spins on its core for a while before it sleeps, waiting for the next
region. Alone on a machine that costs nothing; beside another busy process the spinning threads take the cores
the working threads need, and every process slows down many times over (benchmarks/contention.py; on the 2-core
machine, busy with other work at a load of 8-9, two of the test suite's files on two workers took 8m14s and 262
CPU-seconds with the default, 55 s and 29 CPU-seconds with the threads told to sleep when idle). `yield_when_idle` sets that policy (OMP_WAIT_POLICY=PASSIVE) for this
process and everything it starts, unless the user chose one; libgomp reads it once, when torch first loads it,
so it must run before `import torch` (the CLI's first step; tests/conftest.py).

How many threads each process gets when several stage processes run at once (`--parallel N`) is
flows.placement.thread_share.
"""

from __future__ import annotations

import os

WAIT_POLICY_VAR = "OMP_WAIT_POLICY"


def yield_when_idle(env: dict[str, str] | os._Environ = os.environ) -> str:
    """OpenMP threads sleep instead of spinning when they run out of work (OMP_WAIT_POLICY=PASSIVE), unless the
    environment already names a policy. Returns the policy in effect."""
    return env.setdefault(WAIT_POLICY_VAR, "PASSIVE")


def describe() -> str:
    """For a run's header: the wait policy in effect."""
    return f"{WAIT_POLICY_VAR}={os.environ.get(WAIT_POLICY_VAR) or 'unset'}"
