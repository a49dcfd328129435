"""Drive the real core with events, one at a time, against a fake worker group (group.py): what
the scheduler tests, the compatibility-log recorder and the adapter-policy simulator run.

    d = Driver(num_kv_blocks=8)
    d.arrive("a", 5, max_tokens=3)
    d.script("a", [11, 12, 2])       # tokens rank 0 samples for "a", in order
    d.run()                          # complete steps until nothing is left
    assert d.outputs["a"] == [11, 12, 2] and d.finish_reasons["a"] == "stop"

Every decision reaches the group in stream order, which checks each plan against what the ranks
hold (rank.py) and the slot tables (slots.py). With `max_steps_in_flight=2` (async scheduling) a
plan may arrive while the one before is in flight. The driver also checks what only the core's
decisions show: no more plans in flight than allowed, a user-pinned version, once registered, is
never evicted while it stays registered (unless a rank failed to load it), and with overlapped
loading no slot is assigned while a step in flight reads it.

With `lora_overlap_loading=True` adapter loads are asynchronous: each rank's load ends when
the caller delivers it (`finish_loads`, `fail_load`) or, given a `load_policy`, at random
after steps; `run()` delivers what is pending when no step is in flight (and, without a
policy, before each step). With `digests=True` every rank reports each completed step's
digest (tensor_parallel_size > 1). For a request asking for prompt logprobs, rank 0's
StepCompleted reports those of the prompt positions each step computes (reports.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import fields
from typing import Any

from ledgerserve.scheduler_proc.core import Core, CoreConfig
from ledgerserve.scheduler_proc.core.policy import Policy
from ledgerserve.scheduler_proc.views.registry_changes import registry_changes
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.sim.group import EOS, FakeGroup
from ledgerserve.sim.loads import AdapterLoads
from ledgerserve.sim.rank import FakeWorker
from ledgerserve.sim.slots import LoadPolicy


class Driver(AdapterLoads):
    """The core and a fake worker group (group.py), one input at a time; see the module's docstring."""

    def __init__(
        self,
        num_kv_blocks: int = 64,
        *,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        block_size: int = 4,
        max_model_len: int = 256,
        tensor_parallel_size: int = 1,
        eos_token_ids: tuple[int, ...] = (EOS,),
        ready: bool = True,
        log: Any = None,
        enable_lora: bool = False,
        max_loras: int = 8,
        max_cpu_loras: int = 32,
        lora_max_wait_steps: int = 16,
        max_steps_in_flight: int = 1,
        lora_overlap_loading: bool = False,
        policy: Policy | None = None,  # None: Policy.current(); Policy.for_schema(n): an older schema's engine
        load_policy: LoadPolicy | None = None,
        digests: bool = False,
        max_on_demand_loras: int = 64,
    ) -> None:
        self.config = CoreConfig(
            max_num_seqs,
            max_num_batched_tokens,
            block_size,
            max_model_len,
            tensor_parallel_size,
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            enable_lora=enable_lora,
            lora_max_wait_steps=lora_max_wait_steps,
            max_steps_in_flight=max_steps_in_flight,
            lora_overlap_loading=lora_overlap_loading,
            policy=policy if policy is not None else Policy.current(),
            max_on_demand_loras=max_on_demand_loras,
        )
        self.core = Core(self.config)
        self.group = FakeGroup(self.config, num_kv_blocks, eos_token_ids, load_policy)
        self.load_policy = load_policy
        self.digests = digests
        self._start_records()
        self._num_ops = 0
        self.log = log  # an EventLogWriter: inputs then decisions, as the shell logs them
        if ready:
            self.ready()

    def _start_records(self) -> None:
        """What the driver keeps of the run, from the core's inputs and decisions."""
        self.inputs: list[Any] = []
        self.decisions: list[Any] = []
        self.plans: list[ev.StepPlan] = []
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.emitted: list[ev.TokensEmitted] = []
        self._pending_plans: deque[ev.StepPlan] = deque()  # sent, not completed; oldest first
        self.registry: dict[str, int] = {}  # name -> version, from the core's decisions
        self.replies: dict[str, ev.AdapterOpReplied] = {}
        self.registry_changes: list[ev.AdapterRegistryChanged] = []  # as the shell sends them to the HTTP process
        self.pinned: list[int] = []  # registered user-pinned versions

    # ---------------------------------------------------------------- inputs

    def send(self, event: Any) -> list[Any]:
        self.inputs.append(event)
        if isinstance(event, ev.AdapterLoadFailed) and event.version_id in self.pinned:
            self.pinned.remove(event.version_id)  # a version that cannot load loses its slot and registration
        if self.log is not None:
            self.log.append(event)
        decisions = self.core.apply(event)
        self.decisions += decisions
        if self.log is not None:
            for decision in decisions:
                self.log.append(decision)
        change = registry_changes(self.core.adapters, decisions)
        if change is not None:
            self.registry_changes.append(change)
        for decision in decisions:
            self._observe(decision)
        self.core.check_integrity()
        return decisions

    def ready(self, rank: int | None = None) -> list[Any]:
        out: list[Any] = []
        for ready in self.group.ready_events():
            if rank in (None, ready.rank):
                out += self.send(ready)
        return out

    def arrive(self, req_id: str, prompt: int | list[int], lora: str | None = None, **sampling: Any) -> list[Any]:
        tokens = list(range(100, 100 + prompt)) if isinstance(prompt, int) else list(prompt)
        if lora in self.registry:
            self.worker.req_versions[req_id] = self.registry[lora]
        return self.send(ev.RequestArrived(req_id, tokens, SamplingParams(**sampling), lora_name=lora))

    def load(
        self,
        name: str,
        path: str | None = None,
        inplace: bool = False,
        content_digest: int = 0,
        on_demand: bool = False,
        pinned: bool = False,
        content_sha256: str = "",
    ) -> ev.AdapterOpReplied:
        self._num_ops += 1
        op_id = f"op-{self._num_ops}"
        self.send(
            ev.AdapterLoadRequested(
                op_id,
                name,
                path or f"/adapters/{name}",
                8,
                1000,
                inplace,
                content_digest,
                on_demand,
                pinned,
                content_sha256,
            )
        )
        reply = self.replies[op_id]
        if pinned and reply.code == 200:
            self.pinned.append(reply.version_id)
        return reply

    def unload(self, name: str) -> ev.AdapterOpReplied:
        self._num_ops += 1
        op_id = f"op-{self._num_ops}"
        self.send(ev.AdapterUnloadRequested(op_id, name))
        return self.replies[op_id]

    def abort(self, req_id: str, reason: str = "abort") -> list[Any]:
        return self.send(ev.RequestAborted(req_id, reason))

    def script(self, req_id: str, token_ids: list[int]) -> None:
        self.group.script(req_id, token_ids)

    # ---------------------------------------------------------------- fake worker side

    @property
    def worker(self) -> FakeWorker:
        """Rank 0's state, as the group keeps it."""
        return self.group.worker

    @property
    def in_flight(self) -> ev.StepPlan | None:
        """The oldest plan in flight."""
        return self._pending_plans[0] if self._pending_plans else None

    @property
    def num_in_flight(self) -> int:
        return len(self._pending_plans)

    def complete(self, failed: dict[str, str] | None = None) -> list[Any]:
        """Run the oldest plan in flight on the fake worker and report rank 0's StepCompleted."""
        if not self._pending_plans:
            raise AssertionError("no step in flight")
        plan = self._pending_plans.popleft()
        out = self.send(self.group.run_step(plan, failed))
        for digest in self.group.digests(plan) if self.digests else []:
            out += self.send(digest)
        if self.load_policy is not None:
            for load in self.load_policy.pick(self.pending_loads):
                out += self._deliver(load, self.load_policy.failure(load))
        return out

    def run(self, max_steps: int = 10_000) -> None:
        """Complete steps, and deliver pending loads, until nothing is left to do."""
        for _ in range(max_steps):
            if self.pending_loads and (not self._pending_plans or self.load_policy is None):
                self.finish_loads() if self.load_policy is None else self.deliver_one()
            elif self._pending_plans:
                self.complete()
            else:
                return
        raise AssertionError(f"still running after {max_steps} steps")

    def _observe(self, decision: Any) -> None:
        if isinstance(decision, ev.StepPlan):
            if len(self._pending_plans) >= self.config.max_steps_in_flight:
                raise AssertionError(f"step {decision.step} planned with {len(self._pending_plans)} in flight")
            self._pending_plans.append(decision)
            self.plans.append(decision)
        elif isinstance(decision, ev.TokensEmitted):
            self.emitted.append(decision)
            self.outputs.setdefault(decision.req_id, []).extend(decision.new_token_ids)
            if decision.finish_reason is not None:
                self.finish_reasons[decision.req_id] = decision.finish_reason
        elif isinstance(decision, ev.AdapterOpReplied):
            self.replies[decision.op_id] = decision
        elif isinstance(decision, ev.AdapterRegistered):
            self.registry[decision.name] = decision.version_id
            self._unpin(decision.replaced_version_id)
        elif isinstance(decision, ev.AdapterUnloaded):
            self._unpin(decision.version_id)
            if self.registry.get(decision.name) == decision.version_id:
                del self.registry[decision.name]
        elif isinstance(decision, ev.AdapterEvicted) and decision.version_id in self.pinned:
            raise AssertionError(
                f"pinned version {decision.version_id} evicted from slot {decision.slot} while registered"
            )
        elif isinstance(decision, ev.AdapterSlotAssigned) and self.config.lora_overlap_loading:
            self._check_not_read_in_flight(decision.slot)
        self.group.observe(decision)

    def _unpin(self, version_id: int) -> None:
        if version_id in self.pinned:
            self.pinned.remove(version_id)

    @classmethod
    def from_engine(cls, engine: EngineConfig, num_kv_blocks: int, **kwargs: Any) -> Driver:
        """A driver whose core runs as an engine of these settings would (CoreConfig.from_engine), so a
        log it records replays to the same decisions."""
        core = CoreConfig.from_engine(engine)
        return cls(num_kv_blocks, **{f.name: getattr(core, f.name) for f in fields(core)}, **kwargs)
