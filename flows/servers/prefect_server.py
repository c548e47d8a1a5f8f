"""`prefect server start` behind a Host-header check: `python -m flows.servers.prefect_server server start ...`.

A web page on another site can reach a server on 127.0.0.1 through DNS rebinding: its own name, re-pointed at
127.0.0.1, makes the browser send requests with `Host: <that name>`. MLflow 3 refuses such requests (403);
Prefect 3.8 has no allowed-hosts setting (its auth string would need a password in every client and browser),
so `r1flow up` runs Prefect's own CLI with its app wrapped in this check. Accepted: IP literals (a rebinding page
cannot make the browser send one), `localhost`, and the names in R1FLOW_PREFECT_ALLOWED_HOSTS (comma-separated:
the address `r1flow up` advertises).

A page on any site can also send requests to 127.0.0.1 with a correct Host (no rebinding needed) and, where
Prefect answers `access-control-allow-origin: *` (its default), read the answers; a JSON POST with no preflight (a
plain form, curl-like) would even be executed. So the guard also refuses (403, or a refused handshake) a request
whose Origin header is neither the server's own (the same host and port as its Host header) nor one of Prefect's
PREFECT_SERVER_CORS_ALLOWED_ORIGINS, which r1flow sets to the origins its UI is opened at (`own_origins`:
127.0.0.1, localhost, [::1] and the allowed names, on the server's port; a `*` there is ignored). A request without
an Origin (Prefect's clients, curl) is not a browser page's and passes.

The temporary server a command starts when no server is configured (flows/servers/settings.py,
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
CORS_ORIGINS_ENV = "PREFECT_SERVER_CORS_ALLOWED_ORIGINS"  # Prefect's setting; r1flow's servers get `own_origins`
ROOT = Path(__file__).resolve().parents[2]  # the repository
GUARDED_FACTORY = "flows.servers.prefect_server:create_guarded_app"


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


def own_origins(port: int, names: frozenset[str] | set[str]) -> list[str]:
    """The origins r1flow's own UI is opened at: http on `port` of the loopback names and of `names`."""
    hosts = dict.fromkeys(["127.0.0.1", "localhost", "[::1]", *sorted(names)])
    return [f"http://{f'[{h}]' if ':' in h and not h.startswith('[') else h}:{port}" for h in hosts]


def origin_allowed(origin: str, host_header: str, origins: frozenset[str]) -> bool:
    """Is a request's Origin header the server's own page: the origin of its (already accepted) Host header, or one
    of `origins`? `null` (a sandboxed frame, a file) and every other site are not."""
    origin = origin.strip().lower().rstrip("/")
    scheme, sep, rest = origin.partition("://")
    if not sep or scheme not in ("http", "https"):
        return False
    return origin in origins or rest == host_header.strip().lower()


class HostGuard:
    """ASGI middleware: 403 for an HTTP request, a refused handshake for a websocket, whose Host is not allowed or
    that a page of a foreign origin sends."""

    def __init__(self, app, names: frozenset[str], origins: frozenset[str] = frozenset()):
        self.app, self.names = app, names
        self.origins = frozenset(o.strip().lower().rstrip("/") for o in origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            headers = dict(scope.get("headers") or [])
            header = headers.get(b"host", b"").decode("latin-1")
            origin = headers.get(b"origin")
            if not host_allowed(header, self.names):
                body = b"Invalid Host header - possible DNS rebinding attack detected"
            elif origin is not None and not origin_allowed(origin.decode("latin-1"), header, self.origins):
                body = b"Origin not allowed: only the Prefect UI served here may call this API from a browser"
            else:
                body = None
            if body is not None:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                await send({"type": "http.response.start", "status": 403,
                            "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def allowed_names() -> frozenset[str]:
    return frozenset(n.strip().lower() for n in os.environ.get(ALLOWED_HOSTS_ENV, "").split(",") if n.strip())


def allowed_origins() -> frozenset[str]:
    """Prefect's PREFECT_SERVER_CORS_ALLOWED_ORIGINS as this server process sees it, without `*`."""
    # lazy: start-up (Prefect; every r1flow command loads this module)
    from prefect.settings import PREFECT_SERVER_CORS_ALLOWED_ORIGINS

    return frozenset(o.strip() for o in PREFECT_SERVER_CORS_ALLOWED_ORIGINS.value().split(",") if o.strip() not in ("", "*"))


def _guard(api) -> None:
    api.add_middleware(HostGuard, names=allowed_names(), origins=allowed_origins())


def create_guarded_app():
    """The uvicorn factory of the temporary server: Prefect's app (as `create_app()` makes it from the environment
    its `SubprocessASGIServer` sets: ephemeral, no UI) behind HostGuard."""
    # lazy: start-up (Prefect; every r1flow command loads this module)
    import prefect.server.api.server as server

    api = server.create_app()
    _guard(api)
    return api


@functools.cache
def _guarded_server_class():
    # lazy: start-up (Prefect; every r1flow command loads this module)
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import get_current_settings

    class GuardedSubprocessServer(SubprocessASGIServer):
        """SubprocessASGIServer whose uvicorn serves `create_guarded_app`; otherwise Prefect's command (prefect 3.x's
        `_run_uvicorn_command`, the factory and the app dir being the only differences)."""

        def _run_uvicorn_command(self) -> subprocess.Popen:
            server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
            # not Prefect's default `*`: only r1flow's own pages (it has no UI; HostGuard refuses every other origin)
            cors = {CORS_ORIGINS_ENV: ",".join(own_origins(self.port, allowed_names()))}
            # --app-dir: r1flow's root, first on the path, so `flows` imports without an installation (Prefect's is
            # its own package's parent, on the path anyway)
            return subprocess.Popen(
                args=[sys.executable, "-m", "uvicorn", "--app-dir", str(ROOT), "--factory", GUARDED_FACTORY,
                      "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
                env={**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True),
                     **cors},
            )

    return GuardedSubprocessServer


def temporary_server():
    """The process's temporary Prefect server, guarded: the instance Prefect's own clients use when no API URL is
    set. One Prefect made without the guard and not running yet is replaced. One already running is returned as
    it is: only in a process that used Prefect before an r1flow command (a test session, a notebook); an r1flow
    command's own process starts the guarded one first (flows/servers/settings.py, `start_temporary_prefect`)."""
    # lazy: start-up (Prefect; every r1flow command loads this module)
    from prefect.server.api.server import SubprocessASGIServer

    cls = _guarded_server_class()
    current = SubprocessASGIServer._instances.get(None)
    if current is not None and not isinstance(current, cls):
        if current.running:
            return current
        del SubprocessASGIServer._instances[None]
    return cls()


def main() -> None:
    # lazy: start-up (Prefect; every r1flow command loads this module)
    import prefect.server.api.server as server
    from prefect.cli import app

    create_app = server.create_app

    def guarded_app(*args, **kwargs):
        api = create_app(*args, **kwargs)
        _guard(api)
        return api

    server.create_app = guarded_app  # `prefect server start` imports it from the module when it runs
    sys.argv[0] = "prefect"
    sys.exit(app())


if __name__ == "__main__":
    main()
