"""The step-critical processes' collector settings: start-up objects frozen, full collections
rarer, young cycles still freed by a young collection."""

from __future__ import annotations

import gc
import weakref

from ledgerserve.shared.gc_tuning import GEN2_THRESHOLD, settle_after_start


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_settling_freezes_start_up_and_keeps_collecting_young_cycles() -> None:
    thresholds = gc.get_threshold()
    try:
        settle_after_start()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (thresholds[0], thresholds[1], GEN2_THRESHOLD)
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made after start-up
        gone = weakref.ref(a)
        del a, b
        gc.collect(0)
        assert gone() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
