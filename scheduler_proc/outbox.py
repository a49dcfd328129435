"""What the scheduler sends the HTTP process, held until it is durable: each frame waits, in order,
until the event log has synced the records it follows (group commit, shared/eventlog/group_commit.py),
so no client ever sees a token whose record a crash could still take back. The workers' frames are not
held: a step they run whose records are lost reaches no client."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class HeldFrames:
    def __init__(self, send: Callable[[bytes], None]) -> None:
        self._send = send
        self._held: deque[tuple[int, bytes]] = deque()  # (the last seq written before it, frame), in send order

    def __len__(self) -> int:
        return len(self._held)

    def put(self, seq: int, frame: bytes) -> None:
        """`frame` may go once the records up to `seq` are durable, after every frame put before it."""
        self._held.append((seq, frame))

    def release(self, durable_seq: int) -> int:
        """Send the frames whose records are durable, in order; how many went."""
        num_sent = 0
        while self._held and self._held[0][0] <= durable_seq:
            self._send(self._held.popleft()[1])
            num_sent += 1
        return num_sent
