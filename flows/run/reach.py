"""Can this cluster node reach what a stage needs? Checked on the node before any compute.

A driver's settings name a store, a Prefect API and an MLflow tracking URI that work on the driver's machine;
on another node a local path may not exist (the store is not shared), and 127.0.0.1 is that node's own loopback.
`check_reachable` tries each one from where it runs and fails with ONE line naming the node, what it could not
reach, the URI or path, and what to do, instead of a stage failing later with a traceback (or, worse, a stage
writing its artifacts to a local directory that no other node sees).

Standard library plus fsspec (for a remote store's probe); no Prefect or MLflow import.
"""

from __future__ import annotations

import contextlib
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import fsspec

from schemas.errors import ConfigError

TIMEOUT_S = 5.0


def describe_node(node_id: str | None = None) -> str:
    """`cluster node <id[:8]> (host <hostname>)`, or `node <hostname>` without an id: the `where` of messages."""
    host = socket.gethostname()
    return f"cluster node {node_id[:8]} (host {host})" if node_id else f"node {host}"


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reason(e: BaseException, timeout_s: float) -> str:
    """A short cause: connection refused, timed out, name not resolved, HTTP 503, ..."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code}"
    inner = e.reason if isinstance(e, urllib.error.URLError) else e
    if isinstance(inner, ConnectionRefusedError):
        return "connection refused"
    if isinstance(inner, TimeoutError | socket.timeout):
        return f"no answer within {timeout_s:g} s"
    if isinstance(inner, socket.gaierror):
        return f"host name not resolved: {_one_line(inner.strerror or inner)}"
    if isinstance(inner, OSError) and inner.strerror:
        return _one_line(inner.strerror.lower())
    return _one_line(f"{type(inner).__name__}: {inner}")


def http_health(url: str, timeout_s: float = TIMEOUT_S, expect: tuple[str, ...] = ()) -> str | None:
    """None when GET url answers 200 (and, given `expect`, its body is one of them), else why not."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout_s) as r:
            body = r.read(200).decode(errors="replace").strip()
            if r.status != 200:
                return f"HTTP {r.status}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return _reason(e, timeout_s)
    if expect and body.strip('"').lower() not in expect:
        return f"it answered {_one_line(body, 60)!r}, not a health check of this server"
    return None


def _local_path(uri: str) -> str | None:
    """The local path of a store URI (plain path or file://), else None (a remote fsspec URI)."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and os.name == "nt"):
        return parsed.path if parsed.scheme == "file" else uri
    return None


def check_store(store: str, where: str) -> str:
    """Write, read back and delete a small probe under the store root. A local path must already exist here: a
    path missing on this node means the store is not shared with it."""
    hint = ("the store must be a path every node mounts (NFS) or an object store URI every node can reach "
            "(R1FLOW_STORE=s3://bucket/prefix)")
    payload = f"r1flow reach probe from {where}".encode()
    local = _local_path(store)
    if local is not None:
        root = Path(local).expanduser()
        if not root.is_dir():
            raise ConfigError(f"{where}: the artifact store {store} does not exist on this node: {hint}")
        probe = root / f".reach-{socket.gethostname()}-{uuid.uuid4().hex[:12]}"
        try:
            probe.write_bytes(payload)
            ok = probe.read_bytes() == payload
        except OSError as e:
            raise ConfigError(f"{where}: cannot write to the artifact store {store} "
                              f"({_one_line(e.strerror or e).lower()}): {hint}") from None
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
        if not ok:
            raise ConfigError(f"{where}: the artifact store {store} did not read back what this node wrote: {hint}")
        return f"store {store}: writable"

    try:
        fs, base = fsspec.core.url_to_fs(store, use_listings_cache=False)
        probe = f"{base.rstrip('/')}/.reach-{socket.gethostname()}-{uuid.uuid4().hex[:12]}"
        fs.pipe_file(probe, payload)
        try:
            back = fs.cat_file(probe)
        finally:
            with contextlib.suppress(Exception):
                fs.rm_file(probe)
    except Exception as e:  # credentials, endpoint, bucket, network: whatever the backend raises
        why = _reason(e, TIMEOUT_S) if isinstance(e, OSError) else _one_line(f"{type(e).__name__}: {e}")
        raise ConfigError(f"{where}: cannot reach the artifact store {store} ({why}): {hint}") from None
    if back != payload:
        raise ConfigError(f"{where}: the artifact store {store} did not read back what this node wrote: {hint}")
    return f"store {store}: writable"


def check_prefect(url: str, where: str, timeout_s: float = TIMEOUT_S) -> str:
    health = url.rstrip("/") + "/health"
    why = http_health(health, timeout_s, expect=("true",))
    if why:
        raise ConfigError(f"{where}: cannot reach the Prefect API {url} ({why}): start it with `r1flow up --host "
                          "ADDRESS` on a machine every node can reach, or set PREFECT_API_URL to such an address")
    return f"Prefect API {url}: healthy"


def check_mlflow(uri: str, where: str, timeout_s: float = TIMEOUT_S) -> str:
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme in ("http", "https"):
        why = http_health(uri.rstrip("/") + "/health", timeout_s, expect=("ok",))
        if why:
            raise ConfigError(f"{where}: cannot reach the MLflow server {uri} ({why}): start it with `r1flow up "
                              "--host ADDRESS` or set MLFLOW_TRACKING_URI to an address every node can reach")
        return f"MLflow server {uri}: healthy"
    if parsed.scheme in ("sqlite", "file", ""):
        # sqlite:///rel/path or sqlite:////abs/path (the database file); file:///path or a path (a folder of runs)
        path = uri.removeprefix("sqlite:///") if parsed.scheme == "sqlite" else (parsed.path or uri)
        folder = Path(path).expanduser().parent
        if not folder.is_dir():
            raise ConfigError(f"{where}: the MLflow store {uri} is not on this node ({folder} does not exist): "
                              "a sqlite file is one machine's; start a server with `r1flow up --host ADDRESS` and "
                              "set MLFLOW_TRACKING_URI to its address")
        return f"MLflow store {uri}: folder present"
    return f"MLflow {uri}: not checked (scheme {parsed.scheme!r})"


def check_reachable(settings: Any, prefect_api_url: str | None, where: str, *,
                    timeout_s: float = TIMEOUT_S) -> list[str]:
    """Check, from this node, the store (probe write/read/delete; a local path must exist), the Prefect API when a
    URL is given (GET <url>/health) and MLflow (GET <uri>/health for http(s); a sqlite file's folder must exist).
    `settings`: a flows.servers.settings.Settings or its to_dict(). Raises ConfigError (one line naming `where`) at the
    first failure; returns one line per thing checked."""
    d = settings if isinstance(settings, dict) else settings.to_dict()
    done = [check_store(str(d["store"]), where)]
    if prefect_api_url:
        done.append(check_prefect(prefect_api_url, where, timeout_s))
    if d.get("tracking_uri"):
        done.append(check_mlflow(str(d["tracking_uri"]), where, timeout_s))
    return done
