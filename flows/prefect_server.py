"""`prefect server start` behind a Host-header check: `python -m flows.prefect_server server start ...`.

A web page on another site can reach a server on 127.0.0.1 through DNS rebinding: its own name, re-pointed at
127.0.0.1, makes the browser send requests with `Host: <that name>`. MLflow 3 refuses such requests (403);
Prefect 3.8 has no allowed-hosts setting (its auth string would need a password in every client and browser),
so `r1flow up` runs Prefect's own CLI with its app wrapped in this check. Accepted: IP literals (a rebinding page
cannot make the browser send one), `localhost`, and the names in R1FLOW_PREFECT_ALLOWED_HOSTS (comma-separated:
the address `r1flow up` advertises).
"""

from __future__ import annotations

import ipaddress
import os
import sys

ALLOWED_HOSTS_ENV = "R1FLOW_PREFECT_ALLOWED_HOSTS"


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
