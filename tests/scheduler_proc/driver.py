"""A fake worker group that drives the core with events, so scheduler tests read simply.

    d = Driver(num_kv_blocks=8)
    d.arrive("a", 5, max_tokens=3)
    d.script("a", [11, 12, 2])       # tokens rank 0 samples for "a", in order
    d.run()                          # complete steps until nothing is left
    assert d.outputs["a"] == [11, 12, 2] and d.finish_reasons["a"] == "stop"

The fake worker keeps what a real one would (each request's known tokens and block
table), checks every plan against it, and samples only for requests whose scheduled
tokens reach the end of their known tokens. With `max_steps_in_flight=2` (async
scheduling) a plan may arrive while the one before is in flight; it may schedule one
token past the known ones for a request that sampled in the step before, and the fake
worker feeds it the token it sampled there, as a real one does on the device. Every
sampled token the scheduler later sends back must be the one the worker sampled. It also keeps
the adapter slot table (from
AdapterSlotAssigned / AdapterEvicted) and checks that every request's `lora_slot` holds
that request's version, and that no slot is loaded or evicted while a running request
uses it (fake_adapters.py). A user-pinned version, once registered, is never evicted while it
stays registered (unless a rank failed to load it).

With `lora_overlap_loading=True` adapter loads are asynchronous: each rank's load ends when
the test delivers it (`finish_loads`, `fail_load`) or, given a `load_policy`, at random
after steps; `run()` delivers what is pending when no step is in flight (and, without a
policy, before each step). A plan may only use slots every rank finished loading, and no
slot is assigned while a step in flight reads it. With
`digests=True` every rank reports each completed step's digest (tensor_parallel_size > 1).

For a request asking for prompt logprobs, rank 0's StepCompleted reports those of the prompt
positions each step computes (prompt_reports.py), as a real worker does.

Prefix cache: the fake worker records, for every block it writes, the namespace and the
whole token prefix whose KV the block ends (`kv`). A plan's already-computed blocks
must hold exactly that request's own prefix in its own namespace, so stale KV (an
evicted or reloaded version) or foreign KV (another namespace) fails the check.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ledgerserve.scheduler_proc.core import Core, CoreConfig
from ledgerserve.scheduler_proc.core.block_manager import BlockManager
from ledgerserve.scheduler_proc.core.policy import Policy
from ledgerserve.scheduler_proc.views.engine_stats import engine_stats
from ledgerserve.scheduler_proc.views.registry_changes import registry_changes
from ledgerserve.shared import events as ev
from ledgerserve.shared.sampling import SamplingParams
from tests.scheduler_proc.fake_adapters import AdapterLoads, FakeSlots, LoadPolicy
from tests.scheduler_proc.prompt_reports import fake_reports

EOS = 2
FILLER = 7  # sampled when a request has no scripted tokens left


class FakeWorker:
    def __init__(self, block_size: int, slots: FakeSlots | None = None) -> None:
        self.block_size = block_size
        self.num_tokens: dict[str, int] = {}  # tokens the plans told the worker about
        self.token_ids: dict[str, list[int]] = {}  # those, then any this worker sampled since
        self.last_samplers: list[str] = []  # requests that sampled in the step applied last
        self.block_ids: dict[str, list[int]] = {}
        self.kv: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (namespace, prefix it ends)
        self.slots = slots or FakeSlots(num_ranks=1, max_cpu_loras=0, overlap=False)
        self.req_versions: dict[str, int] = {}  # what the client asked for, resolved at arrival
        self.prompt_asks: dict[str, tuple[int, int]] = {}  # req id -> (num_prompt_tokens, prompt_logprobs k)

    def apply(self, plan: ev.StepPlan) -> list[str]:
        """Apply a plan; returns the ids of requests that sample this step, in plan order."""
        for req_id in plan.finished_req_ids + plan.preempted_req_ids:
            self.num_tokens.pop(req_id, None)
            self.token_ids.pop(req_id, None)
            self.block_ids.pop(req_id, None)
        samplers = []
        for new in plan.new_reqs:
            if new.req_id in self.num_tokens:
                raise AssertionError(f"NewReq for {new.req_id!r}, which the worker already holds")
            self.num_tokens[new.req_id] = len(new.token_ids)
            self.token_ids[new.req_id] = list(new.token_ids)
            if new.sampling.prompt_logprobs is not None:
                self.prompt_asks[new.req_id] = (new.num_prompt_tokens, new.sampling.prompt_logprobs)
            self.block_ids[new.req_id] = list(new.block_ids)
            self.check_cached_kv(new.req_id, new.num_computed_tokens)
            samplers += self._check(new.req_id, new.num_computed_tokens, new.num_scheduled_tokens)
        for cached in plan.cached_reqs:
            if cached.req_id not in self.num_tokens:
                raise AssertionError(f"CachedReq for {cached.req_id!r}, which the worker does not hold")
            self._learn(cached.req_id, cached.new_token_ids)
            self.block_ids[cached.req_id] += cached.new_block_ids
            self.check_cached_kv(cached.req_id, cached.num_computed_tokens)
            samplers += self._check(cached.req_id, cached.num_computed_tokens, cached.num_scheduled_tokens)
        for req in list(plan.new_reqs) + list(plan.cached_reqs):
            self._write_kv(req.req_id, req.num_computed_tokens, req.num_scheduled_tokens)
        return samplers

    def record_samples(self, sampled: list[ev.SampledToken]) -> None:
        """The tokens this worker sampled in the step it applied last."""
        for token in sampled:
            self.token_ids[token.req_id].append(token.token_id)
        self.last_samplers = [token.req_id for token in sampled]

    def _learn(self, req_id: str, new_token_ids: list[int]) -> None:
        """Tokens the scheduler now sends: those this worker sampled must come back unchanged."""
        tokens, start = self.token_ids[req_id], self.num_tokens[req_id]
        for i, token_id in enumerate(new_token_ids, start):
            if i < len(tokens) and tokens[i] != token_id:
                raise AssertionError(f"{req_id!r}: token {i} sent as {token_id}, but the worker sampled {tokens[i]}")
            if i >= len(tokens):
                tokens.append(token_id)
        self.num_tokens[req_id] += len(new_token_ids)

    def namespace(self, req_id: str) -> int:
        return self.req_versions.get(req_id, 0)

    def check_cached_kv(self, req_id: str, num_computed: int) -> None:
        """Every block before `num_computed` holds this request's own prefix, written
        under its own namespace (full blocks; a partial one ends where computing stopped)."""
        tokens = self.token_ids[req_id]
        for k, block_id in enumerate(self.block_ids[req_id][: -(-num_computed // self.block_size)]):
            end = min((k + 1) * self.block_size, num_computed)
            want = (self.namespace(req_id), tuple(tokens[:end]))
            got = self.kv.get(block_id, (-1, ()))
            if got[0] != want[0] or len(got[1]) < end or got[1][:end] != want[1]:
                raise AssertionError(f"{req_id!r}: block {block_id} holds KV of {got}, expected {want}")

    def _write_kv(self, req_id: str, num_computed: int, num_scheduled: int) -> None:
        tokens = self.token_ids[req_id]
        end = num_computed + num_scheduled
        for k in range(num_computed // self.block_size, -(-end // self.block_size)):
            block_end = min((k + 1) * self.block_size, end)
            self.kv[self.block_ids[req_id][k]] = (self.namespace(req_id), tuple(tokens[:block_end]))

    def _check(self, req_id: str, num_computed: int, num_scheduled: int) -> list[str]:
        end = num_computed + num_scheduled
        num_known = self.num_tokens[req_id]
        is_placeholder = (
            end == num_known + 1 == len(self.token_ids[req_id]) and num_scheduled == 1 and req_id in self.last_samplers
        )
        if num_scheduled <= 0 or (end > num_known and not is_placeholder):
            raise AssertionError(f"{req_id!r}: scheduled {num_computed}+{num_scheduled} of {num_known} tokens")
        if len(self.block_ids[req_id]) * self.block_size < end:
            raise AssertionError(f"{req_id!r}: {len(self.block_ids[req_id])} blocks cannot hold {end} tokens")
        return [req_id] if end == len(self.token_ids[req_id]) else []

    def check_slots(self, plan: ev.StepPlan) -> None:
        """Slots are checked in stream order, when the plan is sent (a later eviction
        reaches the worker after the step it follows)."""
        for req in list(plan.new_reqs) + list(plan.cached_reqs):
            self.slots.check_req(req.req_id, req.lora_slot, self.req_versions.get(req.req_id, 0))


class Driver(AdapterLoads):
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
        self.worker = FakeWorker(block_size, FakeSlots(tensor_parallel_size, max_cpu_loras, lora_overlap_loading))
        self.load_policy = load_policy
        self.digests = digests
        self.num_kv_blocks = num_kv_blocks
        self.eos_token_ids = list(eos_token_ids)
        self.inputs: list[Any] = []
        self.decisions: list[Any] = []
        self.plans: list[ev.StepPlan] = []
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.emitted: list[ev.TokensEmitted] = []
        self._scripts: dict[str, deque[int]] = {}
        self._pending_plans: deque[ev.StepPlan] = deque()  # sent, not completed; oldest first
        self.registry: dict[str, int] = {}  # name -> version, from the core's decisions
        self.replies: dict[str, ev.AdapterOpReplied] = {}
        self.registry_changes: list[ev.AdapterRegistryChanged] = []  # as the shell sends them to the HTTP process
        self.pinned: list[int] = []  # registered user-pinned versions
        self._num_ops = 0
        self.log = log  # an EventLogWriter: inputs then decisions, as the shell logs them
        if ready:
            self.ready()

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
        ranks = range(self.config.tensor_parallel_size) if rank is None else [rank]
        out: list[Any] = []
        for r in ranks:
            out += self.send(ev.WorkerReady(r, self.num_kv_blocks, 1000, self.eos_token_ids, "cpu", "float32"))
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
        self._scripts.setdefault(req_id, deque()).extend(token_ids)

    # ---------------------------------------------------------------- fake worker side

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
        samplers = self.worker.apply(plan)
        failed = failed or {}
        sampled = [ev.SampledToken(req_id, self._next_token(req_id)) for req_id in samplers if req_id not in failed]
        self.worker.record_samples(sampled)
        failed_reqs = [ev.FailedReq(req_id, message) for req_id, message in failed.items()]
        reports = [r for r in fake_reports(plan, self.worker.prompt_asks) if r.req_id not in failed]
        out = self.send(ev.StepCompleted(plan.step, 0, sampled, failed_reqs, reports))
        for rank in range(self.config.tensor_parallel_size if self.digests else 0):
            out += self.send(ev.RankDigest(plan.step, rank, 0x5EED))
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

    def _next_token(self, req_id: str) -> int:
        script = self._scripts.get(req_id)
        return script.popleft() if script else FILLER

    def _observe(self, decision: Any) -> None:
        if isinstance(decision, ev.StepPlan):
            if len(self._pending_plans) >= self.config.max_steps_in_flight:
                raise AssertionError(f"step {decision.step} planned with {len(self._pending_plans)} in flight")
            self._pending_plans.append(decision)
            self.plans.append(decision)
            self.worker.check_slots(decision)
        elif isinstance(decision, ev.TokensEmitted):
            self.emitted.append(decision)
            self.outputs.setdefault(decision.req_id, []).extend(decision.new_token_ids)
            if decision.finish_reason is not None:
                self.finish_reasons[decision.req_id] = decision.finish_reason
        elif isinstance(decision, (ev.RequestFinished, ev.RequestPreempted)):
            self.worker.slots.end(decision.req_id)
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
        self.worker.slots.apply(decision)

    def _unpin(self, version_id: int) -> None:
        if version_id in self.pinned:
            self.pinned.remove(version_id)

    # ---------------------------------------------------------------- queries

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
