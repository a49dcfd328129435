"""Independent checks of the prefix cache, read off the decisions and the fake worker:
the block hash recomputed here from its definition (not imported from the core), every
PrefixCached hash matches the request's own tokens in its own namespace, and every
NewReq that starts with computed tokens reuses blocks last cached under its namespace
for exactly its tokens."""

from __future__ import annotations

import msgspec
import xxhash

from ledgerserve.shared import events as ev
from tests.scheduler_proc.driver import Driver

_enc = msgspec.msgpack.Encoder()


def expected_hashes(namespace: int, token_ids: list[int], block_size: int) -> list[int]:
    prev = xxhash.xxh64_intdigest(_enc.encode(["ledgerserve-prefix", namespace]))
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = xxhash.xxh64_intdigest(_enc.encode([prev, token_ids[start : start + block_size]]))
        out.append(prev)
    return out


class PrefixChecker:
    def __init__(self, d: Driver) -> None:
        self.d = d
        self.cached: dict[int, tuple[int, int]] = {}  # block -> (namespace, hash), latest PrefixCached
        self.num_seen = 0
        self.num_reused_blocks = 0

    def check(self) -> None:
        """Check every decision since the last call."""
        d, bs = self.d, self.d.config.block_size
        for decision in d.decisions[self.num_seen :]:
            if isinstance(decision, ev.PrefixCached):
                self._check_cached(decision, bs)
            elif isinstance(decision, ev.StepPlan):
                for new in decision.new_reqs:
                    self._check_reuse(new, bs)
        self.num_seen = len(d.decisions)
        counts = d.blocks.block_accounting()
        if counts.num_free + counts.num_cached + counts.num_private != counts.num_total:
            raise AssertionError(f"block accounting off: {counts}")
        if (
            counts.num_cached != sum(n for _, n in d.blocks.namespace_block_counts())
            or counts.num_cached != d.engine_stats.num_cached_blocks
        ):
            raise AssertionError(f"namespace counts disagree with {counts}")

    def _check_cached(self, decision: ev.PrefixCached, bs: int) -> None:
        worker = self.d.worker
        if decision.namespace != worker.namespace(decision.req_id):
            raise AssertionError(f"{decision} cached under the wrong namespace")
        table = worker.block_ids[decision.req_id]
        hashes = expected_hashes(decision.namespace, worker.token_ids[decision.req_id], bs)
        for block_id, block_hash in zip(decision.block_ids, decision.block_hashes):
            if hashes[table.index(block_id)] != block_hash:
                raise AssertionError(f"{decision}: block {block_id} hash is not its tokens' hash")
            self.cached[block_id] = (decision.namespace, block_hash)

    def _check_reuse(self, new: ev.NewReq, bs: int) -> None:
        if new.num_computed_tokens == 0:
            return
        namespace = self.d.worker.namespace(new.req_id)
        hashes = expected_hashes(namespace, new.token_ids, bs)
        if new.num_computed_tokens % bs or new.num_computed_tokens >= len(new.token_ids):
            raise AssertionError(f"{new.req_id!r}: cached {new.num_computed_tokens} of {len(new.token_ids)} tokens")
        for k in range(new.num_computed_tokens // bs):
            if self.cached.get(new.block_ids[k]) != (namespace, hashes[k]):
                raise AssertionError(
                    f"{new.req_id!r} reuses block {new.block_ids[k]} cached as {self.cached.get(new.block_ids[k])}"
                )
            self.num_reused_blocks += 1
