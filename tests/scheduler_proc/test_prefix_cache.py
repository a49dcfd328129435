"""Prefix cache unit tests: reuse within a namespace, none across base / adapter /
reloaded version, LRU eviction order with its block-id tie-break, locked blocks never
evicted, NamespaceEvicted counts, insertion during decode, determinism."""

import os
import subprocess
import sys

import pytest
import xxhash

from ledgerserve.scheduler_proc.core.block_manager import BlockAccountingError, BlockManager
from ledgerserve.scheduler_proc.core.request import Request
from ledgerserve.shared import codec
from ledgerserve.shared import events as ev
from ledgerserve.shared.sampling import SamplingParams
from tests.scheduler_proc.driver import Driver
from tests.scheduler_proc.prefix_checks import PrefixChecker, expected_hashes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPT = list(range(100, 110))  # 10 tokens: two full blocks of 4, then 2


def _new_reqs(d: Driver, req_id: str) -> list[ev.NewReq]:
    return [r for p in d.plans for r in p.new_reqs if r.req_id == req_id]


def _run_one(d: Driver, req_id: str, prompt: list[int], lora: str | None = None, max_tokens: int = 1) -> ev.NewReq:
    d.arrive(req_id, prompt, lora=lora, max_tokens=max_tokens)
    d.run()
    return _new_reqs(d, req_id)[0]


def test_reuse_within_a_namespace():
    d = Driver(num_kv_blocks=16)
    first = _run_one(d, "a", PROMPT)
    (cached,) = d.of_type(ev.PrefixCached)
    assert cached.req_id == "a" and cached.namespace == 0 and cached.block_ids == first.block_ids[:2]
    assert cached.block_hashes == expected_hashes(0, PROMPT, 4)
    second = _run_one(d, "b", PROMPT, max_tokens=3)
    assert first.num_computed_tokens == 0
    assert second.num_computed_tokens == 8 and second.num_scheduled_tokens == 2
    assert second.block_ids[:2] == first.block_ids[:2]
    emitted = [e for e in d.emitted if e.req_id == "b"]
    assert len(emitted) == 3 and all(e.num_cached_tokens == 8 for e in emitted)
    assert d.engine_stats.num_cached_blocks == 3 and d.blocks.namespace_block_counts() == [(0, 3)]
    d.check_idle()


def test_at_least_one_token_is_computed():
    d = Driver(num_kv_blocks=16)
    _run_one(d, "a", PROMPT[:8])
    again = _run_one(d, "b", PROMPT[:8])  # the whole prompt is cached: keep the last block's token
    assert again.num_computed_tokens == 4 and again.num_scheduled_tokens == 4


def test_no_reuse_across_base_adapter_and_reloaded_version():
    d = Driver(num_kv_blocks=32, enable_lora=True)
    d.load("x")
    assert _run_one(d, "base", PROMPT).num_computed_tokens == 0
    assert _run_one(d, "x1", PROMPT, lora="x").num_computed_tokens == 0  # base KV is not x's
    assert _run_one(d, "x2", PROMPT, lora="x").num_computed_tokens == 8  # x's own KV is
    d.load("x", inplace=True)
    assert d.of_type(ev.NamespaceEvicted) == [ev.NamespaceEvicted(1, 2, 0)]
    assert _run_one(d, "x3", PROMPT, lora="x").num_computed_tokens == 0  # the new version starts empty
    assert _run_one(d, "base2", PROMPT).num_computed_tokens == 8
    assert d.blocks.namespace_block_counts() == [(0, 2), (2, 2)]
    d.check_idle()


# ---------------------------------------------------------------------- block manager level


def _req(req_id: str, tokens: list[int], namespace: int = 0) -> Request:
    return Request(req_id, tokens, SamplingParams(), 0, version_id=namespace)


def _compute(bm: BlockManager, req: Request, step: int) -> list[int]:
    """Admit `req`, compute all its tokens, cache its full blocks; it stays locked."""
    bm.admit(req, bm.match_prefix(req.namespace, req.token_ids), step)
    bm.grow(req.namespace, req.req_id, req.block_ids, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    return bm.cache_computed(req, step)[0]


def test_lru_eviction_by_step_then_block_id():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b, c = _req("a", [1, 2]), _req("b", [3, 4]), _req("c", [5, 6])
    assert _compute(bm, a, 1) == [0] and _compute(bm, b, 1) == [1] and _compute(bm, c, 1) == [2]
    bm.release(0, "c", c.block_ids, step=2)
    bm.release(0, "b", b.block_ids, step=3)
    bm.release(0, "a", a.block_ids, step=3)  # a and b tie at step 3: block 0 goes before 1
    d = _req("d", [9] * 8)
    bm.admit(d, bm.match_prefix(0, d.token_ids), 4)
    order = []
    for num_tokens in (2, 4, 6, 8):  # one block each: the free one, then c (step 2), a, b
        order += bm.grow(0, "d", d.block_ids, num_tokens)
    assert order == [3, 2, 0, 1]
    assert bm.num_cached_blocks == 0
    bm.check_integrity([("d", d.block_ids)])


def test_evicting_a_leaf_exposes_its_parent_and_lru_prefers_the_older_chain():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = _req("a", [1, 2, 3, 4, 5])  # two full blocks: 0 then its child 1
    assert _compute(bm, a, 1) == [0, 1]
    bm.release(0, "a", a.block_ids, step=5)
    b = _req("b", [7, 8, 9])
    _compute(bm, b, 2)
    bm.release(0, "b", b.block_ids, step=6)  # b's block 3 is newer than a's chain
    d = _req("d", [9] * 7)
    bm.admit(d, bm.match_prefix(0, d.token_ids), 7)
    assert bm.grow(0, "d", d.block_ids, 7) == [2, 1, 0, 3]  # the free one, then a's leaf 1, its parent 0, b's newer 3


def test_locked_blocks_are_never_evicted():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = _req("a", [1, 2, 3, 4])
    assert _compute(bm, a, 1) == [0, 1]  # cached and locked by a, which is still running
    d = _req("d", [9] * 6)
    bm.admit(d, bm.match_prefix(0, d.token_ids), 2)
    assert not bm.can_grow(d.block_ids, 6)
    with pytest.raises(BlockAccountingError):
        bm.grow(0, "d", d.block_ids, 6)
    assert bm.grow(0, "d", d.block_ids, 4) == [2, 3]
    assert sorted(bm.cache.nodes) == [0, 1]
    counts = bm.block_accounting()
    assert (counts.num_free, counts.num_cached, counts.num_locked, counts.num_private) == (0, 2, 2, 2)


def test_lru_heap_stays_bounded_under_repeated_hits():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = _req("a", [1, 2, 3])
    _compute(bm, a, 1)
    bm.release(0, "a", a.block_ids, step=1)
    for step in range(2, 500):  # each hit locks and unlocks block 0: one heap entry per unlock
        hit = _req(f"h{step}", [1, 2, 3])
        bm.admit(hit, bm.match_prefix(0, hit.token_ids), step)
        bm.release(0, hit.req_id, hit.block_ids, step)
    assert len(bm.cache._lru) <= 4 * 16 and bm.cache.evict_lru() == 0


def test_preemption_only_when_neither_free_nor_evictable_blocks():
    d = Driver(num_kv_blocks=6, block_size=4, max_num_batched_tokens=64)
    _run_one(d, "old", list(range(500, 509)))  # leaves 2 cached unlocked blocks
    d.arrive("a", list(range(200, 207)), max_tokens=5)
    d.arrive("b", list(range(300, 307)), max_tokens=5)
    d.run()
    assert d.of_type(ev.RequestPreempted) == []  # old's blocks were evicted instead
    assert d.blocks.namespace_block_counts() == [(0, 4)]
    d.check_idle()


# ---------------------------------------------------------------------- core level


def test_namespace_evicted_without_locked_blocks():
    d = Driver(num_kv_blocks=16, enable_lora=True)
    d.load("x")
    _run_one(d, "x1", PROMPT, lora="x")
    assert d.blocks.namespace_block_counts() == [(1, 2)]
    d.unload("x")
    assert d.of_type(ev.NamespaceEvicted) == [ev.NamespaceEvicted(1, 2, 0)]
    assert d.engine_stats.num_cached_blocks == 0 and d.engine_stats.num_free_blocks == 16
    d.check_idle()


def test_namespace_evicted_with_locked_blocks_frees_them_at_finish():
    d = Driver(num_kv_blocks=16, enable_lora=True)
    d.load("x")
    _run_one(d, "x1", list(range(400, 405)), lora="x")  # 1 cached block, unlocked
    d.arrive("x2", PROMPT, lora="x", max_tokens=4)
    d.complete()  # x2's prompt computed: 2 more cached blocks, locked by x2
    d.unload("x")
    assert d.of_type(ev.NamespaceEvicted) == [ev.NamespaceEvicted(1, 1, 2)]
    assert d.blocks.namespace_block_counts() == [(1, 2)] and d.blocks.block_accounting().num_locked == 2
    d.run()
    assert d.blocks.namespace_block_counts() == [] and d.engine_stats.num_free_blocks == 16
    assert [x for x in d.of_type(ev.PrefixCached) if x.req_id == "x2"][-1].namespace == 1
    assert len([x for x in d.of_type(ev.PrefixCached) if x.req_id == "x2"]) == 1  # nothing inserted after the unload
    d.check_idle()


def test_blocks_inserted_during_decode_serve_a_follow_up():
    d = Driver(num_kv_blocks=16)
    checker = PrefixChecker(d)
    outputs = [11, 12, 13, 14, 15, 16, 17]
    d.script("a", outputs)
    _run_one(d, "a", list(range(100, 105)), max_tokens=7)  # computes 5 + 6 = 11 tokens
    checker.check()
    inserted = [x.block_ids for x in d.of_type(ev.PrefixCached) if x.req_id == "a"]
    assert len(inserted) == 2  # the prompt's block, then one completed while decoding
    follow = _run_one(d, "b", list(range(100, 105)) + outputs[:3] + [99])
    assert follow.num_computed_tokens == 8 and follow.block_ids[:2] == inserted[0] + inserted[1]
    checker.check()
    assert checker.num_reused_blocks == 2


def test_snapshot_and_digest_include_the_tree():
    d = Driver(num_kv_blocks=16)
    _run_one(d, "a", PROMPT, max_tokens=2)  # a second step is planned after the prompt's blocks are cached
    prefix = d.core.snapshot()["prefix_cache"]
    assert prefix["num_cached_blocks"] == 2 and prefix["namespaces"] == [{"namespace": 0, "num_blocks": 2}]
    digests = [x.digest for x in d.of_type(ev.StateDigest)]
    other = Driver(num_kv_blocks=16)
    _run_one(other, "a", list(range(200, 210)), max_tokens=2)  # same shapes, other tokens: other hashes
    assert digests != [x.digest for x in other.of_type(ev.StateDigest)]


def prefix_fingerprint(seed: int) -> str:
    from tests.scheduler_proc.test_prefix_random import LORAS, _apply, _driver

    d = _driver(10)
    d.load("a")
    d.load("b")
    req_ids: list[str] = []
    kinds = ("step", "step", "finish", "abort", "unload", "reload")
    for i in range(120):
        x = (seed * 7919 + i * 104729) % 1000003
        if x % 3 == 0:
            _apply(
                d,
                ("arrive", LORAS[x % 3 and (x // 3) % 3], (x // 9) % 3, 1 + (x // 27) % 12, (x // 11) % 4, 1 + x % 5),
                req_ids,
            )
        else:
            _apply(d, (kinds[(x // 5) % 6], x // 7, "ab"[(x // 13) % 2]), req_ids)
    d.run()
    assert d.of_type(ev.PrefixCached) and d.of_type(ev.NamespaceEvicted)
    return xxhash.xxh64_hexdigest(b"".join(codec.encode(x) for x in d.decisions))


def test_prefix_decisions_identical_across_pythonhashseed():
    code = "from tests.scheduler_proc.test_prefix_cache import prefix_fingerprint as f; print(f(3), f(17))"
    outputs = []
    for hash_seed in ("0", "777"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=ROOT)
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
        )
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1]
    assert outputs[0].split() == [prefix_fingerprint(3), prefix_fingerprint(17)]
