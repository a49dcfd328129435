"""One fake worker rank: what a real one keeps (each request's known tokens and block table, the
KV each block holds), and the checks every plan must pass against it.

It samples only for requests whose scheduled tokens reach the end of their known tokens. With
async scheduling a plan may schedule one token past the known ones for a request that sampled in
the step before (the placeholder), and the rank feeds it the token it sampled there, as a real one
does on the device; every sampled token the scheduler later sends back must be the one sampled.

Prefix cache: for every block it writes, the rank records the namespace and the whole token prefix
whose KV the block ends (`kv`). A plan's already-computed blocks must hold exactly that request's
own prefix in its own namespace, so stale KV (an evicted or reloaded version) or foreign KV (another
namespace) fails the check. A request's namespace is the adapter version it asked for
(`req_versions`, which the caller fills as requests arrive; 0: the base model).
"""

from __future__ import annotations

from ledgerserve.shared import events as ev
from ledgerserve.sim.slots import FakeSlots


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
