"""`r1flow worker`: a Prefect worker for a work pool, in this process, that stops within seconds.

`prefect worker start` in a child process stopped on SIGTERM by forwarding SIGINT to itself and then tearing down
its services; under load that took 12-23 s, past `r1flow down`'s grace, and the worker was SIGKILLed (issue 44
item 8). Here the worker runs in this process's event loop and a signal ends the process at once (os._exit: no
teardown, no interpreter exit draining Prefect's log and event workers; the worker's record on the server just
ages out), and the flow runs it started end with it: they carry this process's run token (stages.runtime.lifetime.adopt), so the
sentinel sends them SIGTERM, then SIGKILL, once this process is gone. The flow run's own SIGTERM handling marks
it Crashed; its finished stages stay cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable

from prefect.workers.base import BaseWorker

from schemas.errors import ConfigError
from stages.runtime import lifetime

UNREGISTER_WAIT_S = 1.0  # on a signal: how long to try to remove this worker from `r1flow up`'s record


def worker_class(kind: str):
    """The installed Prefect worker class of pool type `kind` (process, docker, kubernetes, ...)."""
    cls = BaseWorker.get_worker_class_from_type(kind)
    if cls is None:
        raise ConfigError(f"--type {kind}: no Prefect worker of that type is installed (process is built in; others "
                          "come from their prefect-<type> package)")
    return cls


def run_worker(pool: str, kind: str = "process", limit: int | None = None,
               on_exit: Callable[[], None] | None = None) -> None:
    """Poll `pool` and run its flow runs until SIGTERM, SIGINT or SIGHUP; never returns: os._exit(0) once stopped (a
    stop asked for is a clean end), 1 with one line if the worker fails. `on_exit` runs first (unregistering)."""
    cls = worker_class(kind)
    lifetime.adopt()  # the flow runs this worker starts carry its token: they end with it, however it ends

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def stop(signum: int) -> None:
            print(f"r1flow: worker stopped ({signal.Signals(signum).name}); flow runs in progress end with it",
                  flush=True)
            if on_exit is not None:  # `r1flow down` holds the record's lock while it waits for us: 1 s at most
                done = threading.Thread(target=on_exit, daemon=True)
                done.start()
                done.join(UNREGISTER_WAIT_S)
            sys.stderr.flush()
            os._exit(0)  # Prefect's teardown of an idle worker took 12-23 s under load; the sentinel ends flow runs

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(sig, stop, sig)
        worker = cls(work_pool_name=pool, limit=limit, create_pool_if_not_found=True)
        await worker.start(printer=lambda *a, **k: print(*a, flush=True))

    code = 0
    try:
        asyncio.run(main())
    except Exception as e:  # one line: the worker's own traceback is for its log, not the terminal
        code = 1
        print(f"r1flow: error: worker for work pool {pool!r} failed: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        if on_exit is not None:
            with contextlib.suppress(Exception):
                on_exit()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
