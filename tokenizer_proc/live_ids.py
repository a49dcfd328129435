"""Request ids the core has not had its last word on (a finish or a rejection), for the engine
client. An id is taken from its RequestArrived's send to that last word, also after its client
left (an abort is on its way): tokens still coming for the old request must never reach a new one
that reuses the id (a client's X-Request-Id)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from ledgerserve.shared.events import Event, RequestArrived, RequestRejected, TokensEmitted


class LiveRequestIds:
    def __init__(self) -> None:
        self._ids: set[str] = set()

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._ids

    async def send(self, send: Callable[[Event], Awaitable[None]], arrived: RequestArrived) -> None:
        """Send `arrived` with `send`; its id is taken unless the send failed (nothing reached the core)."""
        self._ids.add(arrived.req_id)
        try:
            await send(arrived)
        except BaseException:
            self._ids.discard(arrived.req_id)
            raise

    def note(self, event: TokensEmitted | RequestRejected) -> None:
        """A finishing TokensEmitted or a RequestRejected is the core's last word: the id is free."""
        if isinstance(event, RequestRejected) or event.finish_reason is not None:
            self._ids.discard(event.req_id)

    def clear(self) -> None:
        """The engine failed: no word will come."""
        self._ids.clear()
