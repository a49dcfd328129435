"""Which launched step last reads each slot, so that a write into a slot waits for that step
only, not for every step in flight.

After launching a step whose tokens use adapter slots, the runner records one event on the
compute stream and notes it for each of those slots (`read`). A copy into slot k, or the
clearing of its tables, then waits for k's last-read event if that step may still run
(`pending`). The scheduler never assigns a slot that a step in flight uses (its prefetch pass
keeps an in-flight guard), so the wait is a safety net that in practice rarely waits.

A step reads more than the slots its tokens use: the stacked decode GEMM
(worker_proc/models/layers.py `_stacked_gemm`) multiplies by A of every slot below the step's
`num_slots`. A write into another slot's rows while that GEMM runs cannot change the step's
output: each output column of the GEMM is the product with one row of the stacked weight
only, and the columns of a slot no token of the step uses are never read by the expand that
follows (tests/worker_proc/test_slot_copy_gpu.py runs such copies beside such steps).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Fence(Protocol):
    def query(self) -> bool: ...


class SlotFences:
    def __init__(self) -> None:
        self.last_read: dict[int, Fence] = {}  # slot -> the event after the last launched step that reads it

    def read(self, slots: Iterable[int], event: Fence) -> None:
        """A step that reads `slots` was launched; `event` completes after it."""
        for slot in slots:
            self.last_read[slot] = event

    def pending(self, slot: int) -> Fence | None:
        """What a write into `slot` must wait for: its last reader's event, unless that completed."""
        event = self.last_read.get(slot)
        if event is not None and event.query():
            del self.last_read[slot]
            return None
        return event
