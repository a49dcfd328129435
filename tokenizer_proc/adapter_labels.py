"""How many adapters get series of their own on /metrics: a server may register thousands of
adapters, and a series per adapter per family would make every scrape megabytes long.

Per-adapter series exist for at most `series_bound(--max-cpu-loras)` adapters: MIN_SERIES, or
as many as the CPU tier holds at once if that is more. The rows' families (`ledgerserve_lora_location`,
`_pinned`, `_requests_*`, token counters) show the most active adapters at each scrape (running
requests first, then waiting, pinned, in a GPU slot, in the CPU tier; by name among equals),
and the counter families fed by events (prompt tokens per namespace, slot loads) keep the
adapters that most recently had such an event, removing the series of the one used least
recently. An adapter that returns gets its series back (a counter fed by events restarts from 0).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ledgerserve.shared.events import AdapterRow

TIER_RANK = {"gpu": 2, "cpu": 1}
MIN_SERIES = 64  # adapters with series of their own, whatever the CPU tier holds


def series_bound(max_cpu_loras: int) -> int:
    """The most adapters with series of their own in one /metrics family."""
    return max(MIN_SERIES, max_cpu_loras)


class RecentAdapters:
    """Up to `capacity` adapter names, the most recently touched last."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._names: OrderedDict[str, None] = OrderedDict()

    def touch(self, name: str) -> str | None:
        """Mark `name` used now; the name that had to leave to make room, if any."""
        self._names[name] = None
        self._names.move_to_end(name)
        if len(self._names) > self.capacity:
            return self._names.popitem(last=False)[0]
        return None

    def discard(self, name: str) -> None:
        self._names.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def names(self) -> set[str]:
        return set(self._names)


def most_active(rows: Sequence[AdapterRow], limit: int) -> list[AdapterRow]:
    """The `limit` most active rows (module docstring), in name order."""
    ranked = sorted(
        rows, key=lambda r: (-r.num_running, -r.num_waiting, not r.pinned, -TIER_RANK.get(r.tier, 0), r.name)
    )
    return sorted(ranked[:limit], key=lambda r: r.name)
