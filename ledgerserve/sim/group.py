"""A fake worker group: every rank's state and checks (rank.py, slots.py), scripted sampling, and
the events the ranks report. Two ways to drive it:

- a `Runner` for the in-process engine (ledgerserve/engine.py): `Engine(config, FakeGroup.from_engine(
  config, num_kv_blocks=...))` runs the real core against it, one rank, no model;
- `Driver` (driver.py), which feeds the core one input at a time and hands every decision to
  `observe`, in stream order, so a test or script controls when steps and loads end.

A caller that sends adapter requests fills `worker.req_versions[req_id]` with the version each asked
for (0: the base model); every plan's `lora_slot` must then hold that version on every rank.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ledgerserve.scheduler_proc.core import CoreConfig
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.sim.rank import FakeWorker
from ledgerserve.sim.reports import fake_reports
from ledgerserve.sim.slots import FakeSlots, LoadPolicy, PendingLoad

EOS = 2
FILLER = 7  # sampled when a request has no scripted tokens left
DIGEST = 0x5EED  # every rank's step digest: the ranks always agree


class FakeGroup:
    def __init__(
        self,
        config: CoreConfig,
        num_kv_blocks: int,
        eos_token_ids: tuple[int, ...] = (EOS,),
        load_policy: LoadPolicy | None = None,
    ) -> None:
        self.num_ranks = config.tensor_parallel_size
        self.overlap = config.lora_overlap_loading
        self.num_kv_blocks = num_kv_blocks
        self.eos_token_ids = list(eos_token_ids)
        self.load_policy = load_policy
        self.worker = FakeWorker(config.block_size, FakeSlots(self.num_ranks, config.max_cpu_loras, self.overlap))
        self.scripts: dict[str, deque[int]] = {}
        self.evicted_users: set[str] = set()  # Runner: requests on a slot evicted before their end reached us

    @classmethod
    def from_engine(cls, config: EngineConfig, num_kv_blocks: int, **kwargs: Any) -> FakeGroup:
        """The group an engine of these settings runs with: the core's view of them, as replay derives it."""
        return cls(CoreConfig.from_engine(config), num_kv_blocks, **kwargs)

    @property
    def slots(self) -> FakeSlots:
        return self.worker.slots

    def ready_events(self) -> list[ev.WorkerReady]:
        return [ev.WorkerReady(r, self.num_kv_blocks, 1000, self.eos_token_ids, "cpu", "float32") for r in self.ranks]

    @property
    def ranks(self) -> range:
        return range(self.num_ranks)

    def script(self, req_id: str, token_ids: list[int]) -> None:
        """Tokens rank 0 samples for `req_id`, in order (then FILLER)."""
        self.scripts.setdefault(req_id, deque()).extend(token_ids)

    def observe(self, decision: Any) -> None:
        """A decision of the core, in stream order: plans are checked against the slots when sent."""
        if isinstance(decision, ev.StepPlan):
            self.worker.check_slots(decision)
        elif isinstance(decision, (ev.RequestFinished, ev.RequestPreempted)):
            self.slots.end(decision.req_id)
        self.slots.apply(decision)

    def run_step(self, plan: ev.StepPlan, failed: dict[str, str] | None = None) -> ev.StepCompleted:
        """Apply `plan` on the ranks and sample: rank 0's StepCompleted (`failed`: req id -> message)."""
        samplers = self.worker.apply(plan)
        failed = failed or {}
        sampled = [ev.SampledToken(req_id, self._next_token(req_id)) for req_id in samplers if req_id not in failed]
        self.worker.record_samples(sampled)
        failed_reqs = [ev.FailedReq(req_id, message) for req_id, message in failed.items()]
        reports = [r for r in fake_reports(plan, self.worker.prompt_asks) if r.req_id not in failed]
        return ev.StepCompleted(plan.step, 0, sampled, failed_reqs, reports)

    def digests(self, plan: ev.StepPlan) -> list[ev.RankDigest]:
        return [ev.RankDigest(plan.step, rank, DIGEST) for rank in self.ranks]

    def _next_token(self, req_id: str) -> int:
        script = self.scripts.get(req_id)
        return script.popleft() if script else FILLER

    # ---------------------------------------------------------------- Runner (ledgerserve/engine.py)

    def ready(self) -> ev.WorkerReady:
        return self.ready_events()[0]

    def execute(self, plan: ev.StepPlan) -> tuple[ev.StepCompleted, ev.RankDigest]:
        """One step. A worker never sees RequestFinished: the plan's finished and preempted ids end
        its requests, and must end every request on a slot evicted since the plan before."""
        ended = [*plan.finished_req_ids, *plan.preempted_req_ids]
        if not self.evicted_users <= set(ended):
            raise AssertionError(f"slot evicted while {sorted(self.evicted_users - set(ended))} still ran on it")
        self.evicted_users.clear()
        for req_id in ended:
            self.slots.end(req_id)
        self.observe(plan)
        return self.run_step(plan), self.digests(plan)[0]

    # ---------------------------------------------------------------- AdapterPort (ledgerserve/engine.py)

    @property
    def adapters(self) -> FakeGroup:
        """The group carries out its adapter commands itself."""
        return self

    def command(self, cmd: ev.Event, arrival_s: float) -> list[ev.Event]:
        """Apply one adapter command; without overlapped loading a slot load ends at once."""
        if isinstance(cmd, ev.AdapterEvicted):
            users = sorted(r for r, slot in self.slots.req_slot.items() if slot == cmd.slot)
            self.evicted_users.update(users)  # finished or preempted, or the next plan says otherwise
            for req_id in users:
                self.slots.end(req_id)
        self.observe(cmd)
        if isinstance(cmd, ev.AdapterSlotAssigned) and not self.overlap:
            return [ev.AdapterLoadCompleted(r, cmd.slot, cmd.version_id, "disk", 1.0, 1000) for r in self.ranks]
        return []

    def poll(self) -> list[ev.Event]:
        """Loads that ended: those the load policy picks, or without one every pending load."""
        if self.load_policy is None:
            return [self.slots.finish(load, None) for load in list(self.slots.pending)]
        return [self.slots.finish(load, self.load_policy.failure(load)) for load in self.picked_loads()]

    def busy(self) -> bool:
        return bool(self.slots.pending)

    def picked_loads(self) -> list[PendingLoad]:
        """The pending loads the load policy ends now, in the order it ends them."""
        assert self.load_policy is not None
        return self.load_policy.pick(list(self.slots.pending))
