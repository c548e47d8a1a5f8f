"""The servers a run uses, watched: one that stops answering ends the run with one line (issue 44 items 11, 12).

Left to themselves, Prefect's client retried a killed server for about 6 minutes, printing a traceback per try,
and MLflow's retried for over 7 minutes in silence. A daemon thread of `r1flow run` and `r1flow stage` asks each
server's health route every WATCH_EVERY_S; once one has not answered for SILENT_S it writes one line naming the
server and its URL and ends the run as SIGTERM does (`lifetime.stop_run`): the stage in progress stops (its
checkpoints stay), MLflow and Prefect record the end where they still can, and the process exits within
lifetime's grace. Finished stages are artifacts and cache records under the home: the next run reuses them.

Standard library only; nothing runs for a temporary Prefect server or a local MLflow store.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from stages.runtime import lifetime

WATCH_EVERY_S = 2.0
PROBE_TIMEOUT_S = 5.0
SILENT_S = 15.0  # a busy server on 2 cores answers within seconds (a probe that times out waits this long)
REFUSED_S = 2.0  # a killed one refuses at once: nothing listens on its port (two refusals in a row, no wait)
EXIT_CODE = 1


@dataclass(frozen=True)
class Watched:
    name: str  # "Prefect", "MLflow"
    url: str  # as the user knows it (the UI's address)
    health: str


def watched(env: dict[str, str] | None = None) -> list[Watched]:
    """The servers this process's settings point at (PREFECT_API_URL, an http(s) MLFLOW_TRACKING_URI)."""
    env = os.environ if env is None else env
    out = []
    api = env.get("PREFECT_API_URL", "").rstrip("/")
    if api.startswith(("http://", "https://")):
        out.append(Watched("Prefect", api.removesuffix("/api"), f"{api}/health"))
    uri = env.get("MLFLOW_TRACKING_URI", "").rstrip("/")
    if uri.startswith(("http://", "https://")):
        out.append(Watched("MLflow", uri, f"{uri}/health"))
    return out


def probe(url: str, timeout: float = PROBE_TIMEOUT_S) -> str:
    """"ok" (200), "refused" (nothing listens there: the server's process is gone) or "silent" (anything else: a
    timeout, an error status, a busy server)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return "ok" if r.status == 200 else "silent"
    except urllib.error.URLError as e:
        return "refused" if isinstance(e.reason, ConnectionRefusedError) else "silent"
    except ConnectionRefusedError:
        return "refused"
    except (OSError, ValueError):
        return "silent"


def answers(url: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    return probe(url, timeout) == "ok"


def lost_message(server: Watched, silent_s: float | None = None) -> str:
    silent = f" (no answer for {silent_s:.0f} s)" if silent_s is not None else ""
    return (f"r1flow: error: {server.name} server at {server.url} stopped responding{silent}; "
            "the run stops. Finished stages are kept: start the server again (`r1flow up`) and re-run, they are "
            "reused")


def not_answering(servers: list[Watched]) -> list[Watched]:
    """Those of `servers` that do not answer now: what an error raised while one is gone is really about (a
    server killed as a run starts fails it at once, with Prefect's "Failed to reach API" traceback)."""
    return [s for s in servers if not answers(s.health)]


def _on_lost(server: Watched, silent_s: float) -> None:
    # what the run does on its way out (close its MLflow runs) must not retry the lost server for minutes
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = "5"
    lifetime.stop_run(lost_message(server, silent_s), EXIT_CODE)


def watch(servers: list[Watched], on_lost=_on_lost, every_s: float = WATCH_EVERY_S,
          silent_s: float = SILENT_S, refused_s: float = REFUSED_S) -> threading.Thread | None:
    """Start the watching thread (a daemon); None when there is nothing to watch. A server is lost when it has
    refused connections for `refused_s` (its process is gone: the run stops within seconds, not after `silent_s`)
    or not answered for `silent_s`.

    Prefect's API log handler, which writes "--- Error logging to API ---" and the error without a newline for
    every batch of log lines the lost server does not take (the next line, ours included, glued to it), is
    silenced the stdlib's way (`logging.raiseExceptions = False`): the server's loss is this thread's one line."""
    if not servers:
        return None
    logging.raiseExceptions = False

    def loop():
        last_ok = {s.url: time.monotonic() for s in servers}
        refused_since: dict[str, float] = {}
        while True:
            time.sleep(every_s)
            for s in servers:
                now, seen = time.monotonic(), probe(s.health)
                if seen == "ok":
                    last_ok[s.url] = now
                if seen == "refused":
                    refused_since.setdefault(s.url, now)
                else:
                    refused_since.pop(s.url, None)
                if now - last_ok[s.url] >= silent_s or now - refused_since.get(s.url, now) >= refused_s:
                    on_lost(s, now - last_ok[s.url])
                    return

    thread = threading.Thread(target=loop, name="r1flow-server-watch", daemon=True)
    thread.start()
    return thread
