"""Property tests of the prefix cache on the core alone: random interleavings of
arrivals sharing prefixes across and within namespaces (base, two adapters, their
reloads), steps, finishes, aborts, unloads and in-place reloads. After every event the
block accounting is exact and no request is served blocks of another namespace or of
other tokens; at the end, idle means free + cached == total with nothing locked."""

from hypothesis import given, settings
from hypothesis import strategies as st

from ledgerserve.shared import events as ev
from tests.scheduler_proc.driver import EOS, Driver
from tests.scheduler_proc.prefix_checks import PrefixChecker

PREFIXES = (
    list(range(100, 112)),
    list(range(100, 106)) + [50, 51, 52, 53, 54, 55],  # shares 1.5 blocks with the first
    list(range(200, 212)),
)
LORAS = (None, "a", "b")

arrive = st.tuples(
    st.just("arrive"),
    st.sampled_from(LORAS),
    st.integers(0, 2),
    st.integers(1, 12),
    st.integers(0, 5),
    st.integers(1, 6),
)
other = st.tuples(
    st.sampled_from(("step", "step", "finish", "abort", "unload", "reload")),
    st.integers(0, 50),
    st.sampled_from(("a", "b")),
)
ops = st.lists(st.one_of(arrive, other), min_size=1, max_size=40)


def _driver(num_kv_blocks: int) -> Driver:
    return Driver(
        num_kv_blocks,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        block_size=4,
        max_model_len=40,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
    )


def _apply(d: Driver, op: tuple, req_ids: list[str]) -> None:
    kind = op[0]
    if kind == "arrive":
        _, lora, prefix, cut, extra, max_tokens = op
        req_id = f"r{len(req_ids)}"
        req_ids.append(req_id)
        prompt = PREFIXES[prefix][:cut] + [300 + len(req_ids)] * extra
        d.arrive(req_id, prompt or [1], lora=lora, max_tokens=max_tokens)
    elif kind == "step" and d.in_flight is not None:
        d.complete()
    elif kind == "finish" and req_ids:
        d.script(req_ids[op[1] % len(req_ids)], [EOS])  # its next sample ends it
    elif kind == "abort" and req_ids:
        d.abort(req_ids[op[1] % len(req_ids)])
    elif kind == "unload":
        d.unload(op[2])
    elif kind == "reload":
        d.load(op[2], inplace=True)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_kv_blocks=st.integers(8, 20))
def test_prefix_cache_under_random_interleavings(ops, num_kv_blocks):
    d = _driver(num_kv_blocks)
    d.load("a")
    d.load("b")
    checker = PrefixChecker(d)
    req_ids: list[str] = []
    for op in ops:
        _apply(d, op, req_ids)  # the driver checks integrity after every event
        checker.check()
    while d.in_flight is not None:
        d.complete()
        checker.check()
    d.check_idle()
    live = [0] + sorted(d.registry.values())
    assert all(ns in live for ns, _ in d.blocks.namespace_block_counts())  # unloaded versions hold nothing


def test_random_interleavings_do_reuse_across_requests():
    """The property test is not vacuous: a fixed interleaving reuses blocks in all three
    namespaces and evicts a namespace."""
    d = _driver(16)
    d.load("a")
    d.load("b")
    checker = PrefixChecker(d)
    req_ids: list[str] = []
    for lora in LORAS:
        for prefix in (0, 1):
            _apply(d, ("arrive", lora, prefix, 12, 1, 2), req_ids)
            d.run()
            checker.check()
    _apply(d, ("reload", 0, "a"), req_ids)
    d.run()
    checker.check()
    reused = [r for p in d.plans for r in p.new_reqs if r.num_computed_tokens > 0]
    assert {d.worker.namespace(r.req_id) for r in reused} == {0, 1, 2}
    assert checker.num_reused_blocks >= 3
    assert d.of_type(ev.NamespaceEvicted)[-1].namespace == 1
    d.check_idle()
