"""The HTTP sockets, bound by the launcher before anything slow (the demo build, the model load)
and handed to the HTTP process, which serves on them: a port where a server already listens stops
the start at once, naming the address, instead of after the model has loaded.

Bound as asyncio binds them for uvicorn (every address `host` resolves to, SO_REUSEADDR so a port
in TIME_WAIT is reusable, IPv6 sockets v6-only beside their IPv4 twins), but not yet listening, as
vLLM binds early: the HTTP process listens once it serves, so a client that comes during the start
is refused at once rather than kept waiting.
"""

from __future__ import annotations

import errno
import socket

WHY = {
    errno.EADDRINUSE: "the address is already in use (another server runs there? stop it or choose another --port)",
    errno.EADDRNOTAVAIL: "no local interface has this address (choose another --host)",
    errno.EACCES: "permission denied (ports below 1024 need privileges; choose another --port)",
}


class ListenError(ValueError):
    """The HTTP address cannot be bound; the message names it and says why."""


def shown_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_http_sockets(host: str, port: int) -> list[socket.socket]:
    """One bound TCP socket per address `host` resolves to (all interfaces for "" or 0.0.0.0 as
    given); port 0 takes one free port for all of them. ListenError names the address."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        where = shown_address(host, port)
        raise ListenError(f"cannot listen on {where}: --host does not resolve ({e.strerror})") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):  # getaddrinfo's order, each address once
            bound_port = sockets[0].getsockname()[1] if sockets else port
            sockets.append(_bind(family, kind, proto, (addr[0], bound_port, *addr[2:]), len(infos) > 1))
    except OSError as e:
        for sock in sockets:
            sock.close()
        why = WHY.get(e.errno or 0, e.strerror or str(e))
        raise ListenError(f"cannot listen on {shown_address(host, port)}: {why}") from None
    return sockets


def _bind(family: int, kind: int, proto: int, addr: tuple, v6_only: bool) -> socket.socket:
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and v6_only:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock
