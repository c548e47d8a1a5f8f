"""`prefect server start` behind a Host-header check: `python -m flows.prefect_server server start ...`.

A web page on another site can reach a server on 127.0.0.1 through DNS rebinding: its own name, re-pointed at
127.0.0.1, makes the browser send requests with `Host: <that name>`. MLflow 3 refuses such requests (403);
Prefect 3.8 has no allowed-hosts setting (its auth string would need a password in every client and browser),
so `r1flow up` runs Prefect's own CLI with its app wrapped in this check. Accepted: IP literals (a rebinding page
cannot make the browser send one), `localhost`, and the names in R1FLOW_PREFECT_ALLOWED_HOSTS (comma-separated:
the address `r1flow up` advertises).

The temporary server a command starts when no server is configured (flows/settings.py,
`start_temporary_prefect`) is Prefect's `SubprocessASGIServer` (uvicorn on 127.0.0.1 with the factory
`prefect.server.api.server:create_app`); `temporary_server` returns it with the factory `create_guarded_app`
instead, the same app behind the same check. Prefect's clients in this process then find it as their own (it is
the instance `SubprocessASGIServer()` returns: Prefect keeps one per port, None for the temporary one).
"""

from __future__ import annotations

import functools
import ipaddress
import os
import subprocess
import sys
from pathlib import Path

ALLOWED_HOSTS_ENV = "R1FLOW_PREFECT_ALLOWED_HOSTS"
ROOT = Path(__file__).resolve().parent.parent
GUARDED_FACTORY = "flows.prefect_server:create_guarded_app"


def host_allowed(header: str, names: frozenset[str]) -> bool:
    """Is this Host header (`name`, `name:port`, `[v6]:port`) an IP literal, localhost or one of `names`?"""
    host = header.strip().lower()
    if host.startswith("["):
        host = host[1:host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    if not host:
        return False
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return host == "localhost" or host in names


class HostGuard:
    """ASGI middleware: 403 for an HTTP request, a refused handshake for a websocket, whose Host is not allowed."""

    def __init__(self, app, names: frozenset[str]):
        self.app, self.names = app, names

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            header = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
            if not host_allowed(header, self.names):
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                body = b"Invalid Host header - possible DNS rebinding attack detected"
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def allowed_names() -> frozenset[str]:
    return frozenset(n.strip().lower() for n in os.environ.get(ALLOWED_HOSTS_ENV, "").split(",") if n.strip())


def create_guarded_app():
    """The uvicorn factory of the temporary server: Prefect's app (as `create_app()` makes it from the environment
    its `SubprocessASGIServer` sets: ephemeral, no UI) behind HostGuard."""
    import prefect.server.api.server as server

    api = server.create_app()
    api.add_middleware(HostGuard, names=allowed_names())
    return api


@functools.cache
def _guarded_server_class():
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class GuardedSubprocessServer(SubprocessASGIServer):
        """SubprocessASGIServer whose uvicorn serves `create_guarded_app`; otherwise Prefect's command (prefect 3.x's
        `_run_uvicorn_command`, the factory and the app dir being the only differences)."""

        def _run_uvicorn_command(self) -> subprocess.Popen:
            server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
            # --app-dir: r1flow's root, first on the path, so `flows` imports without an installation (Prefect's is
            # its own package's parent, on the path anyway)
            return subprocess.Popen(
                args=[sys.executable, "-m", "uvicorn", "--app-dir", str(ROOT), "--factory", GUARDED_FACTORY,
                      "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
                env={**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)},
            )

    return GuardedSubprocessServer


def temporary_server():
    """The process's temporary Prefect server, guarded: the instance Prefect's own clients use when no API URL is
    set. One Prefect made without the guard and not running yet is replaced. One already running is returned as
    it is: only in a process that used Prefect before an r1flow command (a test session, a notebook); an r1flow
    command's own process starts the guarded one first (flows/settings.py, `start_temporary_prefect`)."""
    from prefect.server.api.server import SubprocessASGIServer

    cls = _guarded_server_class()
    current = SubprocessASGIServer._instances.get(None)
    if current is not None and not isinstance(current, cls):
        if current.running:
            return current
        del SubprocessASGIServer._instances[None]
    return cls()


def main() -> None:
    import prefect.server.api.server as server
    from prefect.cli import app

    create_app = server.create_app
    names = allowed_names()

    def guarded_app(*args, **kwargs):
        api = create_app(*args, **kwargs)
        api.add_middleware(HostGuard, names=names)
        return api

    server.create_app = guarded_app  # `prefect server start` imports it from the module when it runs
    sys.argv[0] = "prefect"
    sys.exit(app())


if __name__ == "__main__":
    main()
