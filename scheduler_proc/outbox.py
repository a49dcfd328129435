"""What the scheduler sends the HTTP process, held until it is durable: each frame waits, in order,
until the event log has synced the records it follows (group commit, shared/eventlog/group_commit.py),
so no client ever sees a token whose record a crash could still take back. The workers' frames are not
held: a step they run whose records are lost reaches no client. The frames one sync releases go
together, as one multipart message: the HTTP process takes a step's outputs in one wake-up."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class HeldFrames:
    def __init__(self, send: Callable[[list[bytes]], None]) -> None:
        self._send = send  # frames, in order, as one message
        self._held: deque[tuple[int, bytes]] = deque()  # (the last seq written before it, frame), in send order

    def __len__(self) -> int:
        return len(self._held)

    def put(self, seq: int, frame: bytes) -> None:
        """`frame` may go once the records up to `seq` are durable, after every frame put before it."""
        self._held.append((seq, frame))

    def release(self, durable_seq: int) -> int:
        """Send the frames whose records are durable, in order; how many went."""
        frames = []
        while self._held and self._held[0][0] <= durable_seq:
            frames.append(self._held.popleft()[1])
        if frames:
            self._send(frames)
        return len(frames)
