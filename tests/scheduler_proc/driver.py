"""The scheduler tests' driver: ledgerserve/sim/driver.py's Driver (the real core against a fake
worker group that checks every plan and adapter command), plus the queries the tests ask of it.

    d = Driver(num_kv_blocks=8)
    d.arrive("a", 5, max_tokens=3)
    d.script("a", [11, 12, 2])       # tokens rank 0 samples for "a", in order
    d.run()                          # complete steps until nothing is left
    assert d.outputs["a"] == [11, 12, 2] and d.finish_reasons["a"] == "stop"
"""

from __future__ import annotations

from typing import Any

from ledgerserve.scheduler_proc.core.block_manager import BlockManager
from ledgerserve.scheduler_proc.views.engine_stats import engine_stats
from ledgerserve.shared import events as ev
from ledgerserve.sim import driver
from ledgerserve.sim.group import EOS, FILLER
from ledgerserve.sim.rank import FakeWorker

__all__ = ["EOS", "FILLER", "Driver", "FakeWorker"]


class Driver(driver.Driver):
    @property
    def engine_stats(self) -> ev.EngineStats:
        """The core's gauges now, as the shell publishes them."""
        return engine_stats(self.core)

    @property
    def blocks(self) -> BlockManager:
        """The core's block manager (once every rank is ready)."""
        return self.core.scheduler.block_manager

    def check_idle(self) -> None:
        """Nothing live: every block is free or cached, and no cached block is locked."""
        counts = self.blocks.block_accounting()
        if self.core.has_unfinished() or counts.num_locked or counts.num_private:
            raise AssertionError(f"not idle: {counts}")
        if counts.num_free + counts.num_cached != counts.num_total:
            raise AssertionError(f"blocks leaked: {counts}")

    def of_type(self, kind: type) -> list[Any]:
        return [d for d in self.decisions if isinstance(d, kind)]

    def plan_versions(self, plan: ev.StepPlan) -> list[int]:
        """The distinct adapter versions a plan uses (base excluded)."""
        req_ids = [r.req_id for r in plan.new_reqs] + [r.req_id for r in plan.cached_reqs]
        return sorted({self.worker.req_versions.get(req_id, 0) for req_id in req_ids} - {0})

    @staticmethod
    def scheduled_tokens(plan: ev.StepPlan) -> dict[str, int]:
        out = {r.req_id: r.num_scheduled_tokens for r in plan.new_reqs}
        out.update({r.req_id: r.num_scheduled_tokens for r in plan.cached_reqs})
        return out
