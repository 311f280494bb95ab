"""Serving the UI: uvicorn on a socket we bind (so port 0 works and a port
in use is one clear error), until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

import uvicorn

from everystep.ui.core import Console, Credentials
from everystep.ui.web import create_app

log = logging.getLogger("everystep")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; OSError (in use, no such address) for the caller to report."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    infos = socket.getaddrinfo(host, port, family if ":" in host else socket.AF_UNSPEC, socket.SOCK_STREAM)
    family, _, _, _, address = infos[0]
    # The protocol named, not 0: asyncio turns Nagle's algorithm off
    # (TCP_NODELAY) only on connections of a socket whose protocol is TCP;
    # with it on, a stream's events waited up to 40 ms for the client's
    # delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def serve(sock: socket.socket, database_url: str, credentials: Credentials,
          on_ready: Callable[[int], None] | None = None) -> None:
    """Serve the UI on `sock` until stopped by SIGTERM or SIGINT."""
    console = Console(database_url, credentials)
    # proxy_headers off: the peer address is the socket's, never what an
    # X-Forwarded-For says, so only a trusted proxy's own connection may name
    # the user (ui.trusted_proxies).
    config = uvicorn.Config(create_app(console), log_config=None, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2, proxy_headers=False)
    server = uvicorn.Server(config)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    log.info("ui: serving on http://%s:%d/", shown, port)
    if on_ready is not None:
        on_ready(port)
    try:
        server.run(sockets=[sock])
    finally:
        console.close()
