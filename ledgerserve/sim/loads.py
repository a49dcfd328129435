"""The driver's side of asynchronous adapter loads: which are pending, and delivering their ends to
the core one at a time, when the caller (or the load policy) says."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ledgerserve.sim.slots import LoadPolicy, PendingLoad


class AdapterLoads:
    """The Driver's side of asynchronous loads: which are pending, and delivering their ends
    to the core. Expects `group` (group.py), `load_policy`, `send` and `_pending_plans`."""

    group: Any
    load_policy: LoadPolicy | None
    _pending_plans: Any
    send: Callable[[Any], list[Any]]

    @property
    def pending_loads(self) -> list[PendingLoad]:
        """Loads some rank started and has not finished, oldest first."""
        return list(self.group.slots.pending)

    def finish_loads(
        self, slot: int | None = None, rank: int | None = None, version_id: int | None = None
    ) -> list[Any]:
        """Deliver the matching pending loads' completions, oldest first."""
        out: list[Any] = []
        for load in self.pending_loads:
            if slot in (None, load.slot) and rank in (None, load.rank) and version_id in (None, load.version_id):
                out += self._deliver(load, None)
        return out

    def fail_load(self, slot: int, rank: int, message: str) -> list[Any]:
        """Rank `rank`'s pending load of `slot` fails."""
        (load,) = [x for x in self.pending_loads if (x.slot, x.rank) == (slot, rank)]
        return self._deliver(load, message)

    def deliver_one(self) -> list[Any]:
        """The load policy picks one pending load and ends it."""
        if self.load_policy is None or not self.pending_loads:
            raise AssertionError("no load policy, or no load pending")
        load = self.load_policy.rng.choice(self.pending_loads)
        return self._deliver(load, self.load_policy.failure(load))

    def _deliver(self, load: PendingLoad, failure: str | None) -> list[Any]:
        return self.send(self.group.slots.finish(load, failure))

    def _check_not_read_in_flight(self, slot: int) -> None:
        """A load runs beside the steps: it must not overwrite a slot a step in flight reads."""
        for plan in self._pending_plans:
            if any(req.lora_slot == slot for req in list(plan.new_reqs) + list(plan.cached_reqs)):
                raise AssertionError(f"slot {slot} assigned while step {plan.step}, in flight, reads it")
