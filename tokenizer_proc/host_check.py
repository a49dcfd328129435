"""The Host header of a server bound to a loopback address: a defence against DNS rebinding.

A web page can make a browser resolve its own domain to 127.0.0.1 and then reach a server on
the user's machine with its own name in the Host header (same-origin to the browser). A server
bound to a loopback address is only ever meant to be reached as itself, so a request reaching
it over a loopback socket must name a loopback host (`localhost`, an address in 127.0.0.0/8,
`[::1]`; any port) or one of `--allowed-hosts` (`*`: any); anything else gets a 400 in the
OpenAI error shape before any route runs (the check is on the socket a request arrived on, the
address uvicorn reports as the scope's `server`). A request without a Host header (HTTP/1.0) names no
other site, and passes. Servers bound to other addresses do not check the Host header.
"""

from __future__ import annotations

import ipaddress

from ledgerserve.tokenizer_proc.security import ASGIApp, Receive, Scope, Send, header, send_error

LOOPBACK_NAMES = ("localhost", "localhost.")
MAX_SHOWN_CHARS = 100  # of a refused Host header, in the message


def is_loopback(host: str) -> bool:
    """A loopback address (127.0.0.0/8, ::1), or `localhost`."""
    host = host.strip("[]").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The name of a Host header value without its port: `[::1]:8000` -> `::1`, `a.b:80` -> `a.b`."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    name, _, port = value.rpartition(":")
    return name if name and port.isdigit() else value


class HostCheckMiddleware:
    """400 for a request that reached a loopback socket with a Host header that is neither a
    loopback name nor in `allowed_hosts`."""

    def __init__(self, app: ASGIApp, allowed_hosts: tuple[str, ...] = ()) -> None:
        self.app = app
        self.allow_any = "*" in allowed_hosts
        self.allowed = frozenset(host_name(h) for h in allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.allow_any and _arrived_on_loopback(scope):
            raw = header(scope, b"host")
            if raw is not None and not self._allowed(raw.decode("latin-1")):
                await send_error(send, 400, _refusal(raw.decode("latin-1")))
                return
        await self.app(scope, receive, send)

    def _allowed(self, value: str) -> bool:
        name = host_name(value)
        return is_loopback(name) or name in self.allowed


def _arrived_on_loopback(scope: Scope) -> bool:
    """Whether the request came in on a loopback socket (uvicorn gives the socket's own address)."""
    server = scope.get("server")
    if not server or not isinstance(server[0], str):
        return False
    try:
        return ipaddress.ip_address(server[0]).is_loopback
    except ValueError:
        return False


def _refusal(value: str) -> str:
    shown = value if len(value) <= MAX_SHOWN_CHARS else value[:MAX_SHOWN_CHARS] + "..."
    return (
        f"The Host header `{shown}` is not allowed: this server listens on a loopback address and answers "
        "only requests for localhost, 127.0.0.1 or [::1] (start it with --allowed-hosts to add names)."
    )
