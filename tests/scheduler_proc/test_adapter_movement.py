"""Overlapped adapter loading in the core: a request runs only once its slot is ready on
every rank, the prefetch pass serves the head of the waiting queue first and never takes a
slot that is loading, pinned, read by a step in flight or needed earlier in the queue, and
the CPU tier is staged at registration and from the queue within max_cpu_loras."""

from ledgerserve.scheduler_proc.core import Core
from ledgerserve.shared import events as ev
from ledgerserve.shared.sampling import SamplingParams
from tests.scheduler_proc.driver import Driver
from tests.scheduler_proc.test_log_writes import make_shell


def overlap_driver(**kwargs) -> Driver:
    return Driver(enable_lora=True, lora_overlap_loading=True, **kwargs)


def _moves(decisions) -> list[tuple]:
    """Adapter movement decisions, compactly: (kind, slot or -1, version)."""
    out = []
    for x in decisions:
        if isinstance(x, ev.AdapterSlotAssigned):
            out.append(("assign", x.slot, x.version_id))
        elif isinstance(x, ev.AdapterEvicted):
            out.append(("evict", x.slot, x.version_id))
        elif isinstance(x, ev.AdapterPrefetched):
            out.append(("stage", -1, x.version_id))
        elif isinstance(x, ev.AdapterCpuEvicted):
            out.append(("unstage", -1, x.version_id))
    return out


def _slot_states(d: Driver) -> list[tuple[str, int]]:
    return [(s["state"], s["version_id"]) for s in d.core.snapshot()["adapters"]["slots"]]


def _use(d: Driver, req_id: str, lora: str | None) -> None:
    d.arrive(req_id, 3, lora=lora, max_tokens=1)
    d.run()


def test_a_request_waits_for_its_slot_while_others_run():
    d = overlap_driver(max_loras=2)
    d.load("a", content_digest=0xA1)
    decisions = d.arrive("a1", 3, lora="a", max_tokens=2)
    assert decisions == [ev.AdapterSlotAssigned(0, 1, "/adapters/a", 0xA1)] and d.plans == []
    assert _slot_states(d)[0] == ("LOADING", 1) and d.engine_stats.num_loading_slots == 1
    d.arrive("z", 3, max_tokens=3)  # a base request does not wait for a's load
    assert sorted(Driver.scheduled_tokens(d.plans[-1])) == ["z"]
    d.complete()
    assert sorted(Driver.scheduled_tokens(d.plans[-1])) == ["z"]  # a1 still waits: no completion yet
    assert d.finish_loads() == []  # ready, but the next plan waits for the step in flight
    assert _slot_states(d)[0] == ("LOADED", 1)
    d.complete()
    assert Driver.scheduled_tokens(d.plans[-1]) == {"a1": 3, "z": 1} and d.plans[-1].new_reqs[0].lora_slot == 0
    d.run()
    assert d.finish_reasons == {"a1": "length", "z": "length"} and d.engine_stats.num_pinned_slots == 0
    assert d.engine_stats.num_lora_wait_steps == 2  # steps 1 and 2 left a1 waiting on its load
    assert _moves(d.decisions) == [("stage", -1, 1), ("assign", 0, 1)]  # the plans never assigned a slot


def test_every_read_of_a_version_carries_its_sha256():
    """The HTTP process's SHA-256 of the files goes into the version's registration and every
    command that has a worker read them (staging into the CPU tier, a slot load)."""
    sha = "5a" * 32
    d = overlap_driver(max_loras=2)
    d.load("a", content_sha256=sha)
    d.arrive("a1", 3, lora="a", max_tokens=1)
    reads = [
        x for x in d.decisions if isinstance(x, ev.AdapterRegistered | ev.AdapterPrefetched | ev.AdapterSlotAssigned)
    ]
    assert [type(x).__name__ for x in reads] == ["AdapterRegistered", "AdapterPrefetched", "AdapterSlotAssigned"]
    assert all(x.content_sha256 == sha and x.content_digest == 0 for x in reads)


def test_an_idle_engine_waits_for_a_load_instead_of_failing():
    d = overlap_driver()
    d.load("a")
    d.arrive("a1", 3, lora="a", max_tokens=1)
    assert d.num_in_flight == 0 and not d.of_type(ev.EngineFailed)
    (plan,) = [x for x in d.finish_loads() if isinstance(x, ev.StepPlan)]
    assert Driver.scheduled_tokens(plan) == {"a1": 3}
    d.run()
    assert d.engine_stats.num_lora_wait_steps == 0  # no step was planned while it waited


def test_prefetch_serves_the_head_of_the_queue_first():
    d = overlap_driver(max_loras=2, ready=False)
    for name in "abcd":
        d.load(name)
    for req_id, lora in (("c1", "c"), ("z", None), ("a1", "a"), ("c2", "c"), ("b1", "b"), ("d1", "d")):
        d.arrive(req_id, 3, lora=lora, max_tokens=1)
    assert _moves(d.ready()) == [("assign", 0, 3), ("assign", 1, 1)]  # c, then a; b and d find no slot
    d.finish_loads(slot=1)  # a is ready first: a1 overtakes c1 and c2, whose slot still loads
    d.complete()
    assert sorted(Driver.scheduled_tokens(d.plans[-1])) == ["a1"]
    d.run()
    order = [x.version_id for x in d.of_type(ev.AdapterSlotAssigned)]
    assert order == [3, 1, 2, 4] and len(d.finish_reasons) == 6


def test_prefetch_takes_no_pinned_or_loading_slot():
    d = overlap_driver(max_loras=1)
    d.load("a")
    d.load("b")
    d.arrive("a1", 3, lora="a", max_tokens=4)
    d.finish_loads()
    d.arrive("b1", 3, lora="b", max_tokens=1)
    while "a1" not in d.finish_reasons:
        assert _slot_states(d) == [("PINNED", 1)] and not d.of_type(ev.AdapterEvicted)
        d.complete()
    assert _moves(d.decisions)[-2:] == [("evict", 0, 1), ("assign", 0, 2)]  # a's slot, once idle
    d.arrive("a2", 3, lora="a", max_tokens=1)  # needs a slot; the only one is loading b
    assert _slot_states(d) == [("LOADING", 2)] and _moves(d.decisions)[-1] == ("assign", 0, 2)
    d.run()
    assert d.finish_reasons == {"a1": "length", "b1": "length", "a2": "length"}


def test_prefetch_keeps_what_an_earlier_request_needs():
    d = overlap_driver(max_loras=2)
    for name in "abc":
        d.load(name)
    _use(d, "a1", "a")  # slot 0 = a, last used at step 1
    _use(d, "b1", "b")  # slot 1 = b, last used at step 2: a is the LRU slot
    d.arrive("z", 3, max_tokens=4)  # keeps a step in flight
    d.arrive("a2", 3, lora="a", max_tokens=1)
    decisions = d.arrive("c1", 3, lora="c", max_tokens=1)
    assert _moves(decisions) == [("evict", 1, 2), ("assign", 1, 3)]  # not a, which a2 ahead of c1 needs
    d.run()
    assert len(d.finish_reasons) == 5


def test_prefetch_prefers_a_victim_no_waiting_request_needs():
    d = overlap_driver(max_loras=2, max_num_seqs=3)
    for name in "abc":
        d.load(name)
    d.arrive("z", 3, max_tokens=8)  # a step in flight, so a1 and b1 start together
    d.arrive("a1", 3, lora="a", max_tokens=3)
    d.arrive("b1", 3, lora="b", max_tokens=3)
    d.finish_loads()
    d.arrive("c1", 3, lora="c", max_tokens=1)  # a and b are needed ahead of it
    d.arrive("a3", 3, lora="a", max_tokens=1)  # max_num_seqs: waits too
    assert _moves(d.complete() + d.complete() + d.complete()) == []
    decisions = d.complete()  # a1 and b1 end together: equal LRU steps, a has the lower index
    assert _moves(decisions) == [("evict", 1, 2), ("assign", 1, 3)]  # b: no waiting request needs it; a3 needs a
    assert "a3" in Driver.scheduled_tokens(d.plans[-1])  # and runs on a's slot at once
    d.run()
    assert len(d.finish_reasons) == 5


def test_a_slot_read_by_the_step_in_flight_is_not_taken():
    d = overlap_driver(max_loras=1)
    d.load("a")
    d.load("b")
    d.arrive("a1", 3, lora="a", max_tokens=8)
    d.finish_loads()
    d.arrive("b1", 3, lora="b", max_tokens=1)
    assert _slot_states(d) == [("PINNED", 1)]
    assert _moves(d.abort("a1")) == []  # a's slot is idle, but the step in flight reads it
    assert _moves(d.complete()) == [("evict", 0, 1), ("assign", 0, 2)]
    d.run()
    assert d.finish_reasons["b1"] == "length"


def test_cpu_tier_staging_at_registration_and_from_the_queue():
    d = overlap_driver(max_loras=1, max_cpu_loras=2)
    for name in "abc":
        d.load(name)
    assert _moves(d.decisions) == [("stage", -1, 1), ("stage", -1, 2)]  # c: the tier is full, nothing evicted
    assert d.engine_stats.num_cpu_tier_versions == 2 and d.engine_stats.cpu_tier_bytes == 2000
    decisions = d.arrive("c1", 3, lora="c", max_tokens=1)
    assert _moves(decisions) == [("unstage", -1, 1), ("assign", 0, 3)]  # the LRU unneeded entry makes room
    decisions = d.arrive("a1", 3, lora="a", max_tokens=1)  # no slot for a (c loads): staged instead
    assert _moves(decisions) == [("unstage", -1, 2), ("stage", -1, 1)]
    decisions = d.arrive("b1", 3, lora="b", max_tokens=1)  # c in a slot, a needed: b cannot be staged
    assert _moves(decisions) == []
    d.run()
    assert len(d.finish_reasons) == 3 and d.engine_stats.num_cpu_tier_versions <= 2


def test_staging_reports_are_views_only():
    d = overlap_driver(tensor_parallel_size=2, digests=True)
    d.load("a")
    assert [(x.rank, x.slot) for x in d.pending_loads] == [(0, -1), (1, -1)]
    before = d.core.state_rows()
    d.finish_loads(rank=0)
    assert d.core.state_rows() == before  # which ranks staged a version is no state a decision reads
    assert d.core.snapshot()["adapters"]["cpu_staged_on_every_rank"] == []
    d.arrive("a1", 3, lora="a", max_tokens=1)  # the slot load need not wait for the staging
    d.finish_loads(slot=0)
    assert d.num_in_flight == 1 and d.core.snapshot()["adapters"]["cpu_staged_on_every_rank"] == [1]
    d.run()


def test_stale_and_repeated_completions_change_nothing():
    d = overlap_driver(tensor_parallel_size=2, digests=True)
    d.load("a")
    d.load("b")
    d.arrive("a1", 3, lora="a", max_tokens=1)
    before = d.core.state_rows()
    for stale in (
        ev.AdapterLoadCompleted(0, 0, 2),
        ev.AdapterLoadCompleted(0, 5, 1),
        ev.AdapterLoadCompleted(7, 0, 1),
        ev.AdapterLoadCompleted(0, 1, 1),
    ):
        assert d.send(stale) == []  # wrong version, no such slot, no such rank, a free slot
    assert d.core.state_rows() == before
    d.finish_loads(slot=0, rank=0)
    assert d.core.state_rows() == before  # one rank's part: the slot still loads, nothing to decide on
    assert d.send(ev.AdapterLoadCompleted(0, 0, 1)) == [] and _slot_states(d)[0] == ("LOADING", 1)  # rank 0 twice
    assert d.core.snapshot()["adapters"]["loads_in_flight"] == [{"slot": 0, "version_id": 1, "ready_ranks": [0]}]
    assert isinstance(d.finish_loads(slot=0, rank=1)[0], ev.StepPlan)
    d.run()
    assert d.finish_reasons == {"a1": "length"}


def test_reference_path_assigns_ready_slots_and_ignores_completions():
    d = Driver(enable_lora=True)
    d.load("a")
    d.arrive("a1", 3, lora="a", max_tokens=2)
    assert _moves(d.decisions) == [("assign", 0, 1)] and _slot_states(d)[0] == ("PINNED", 1)
    assert d.send(ev.AdapterLoadCompleted(0, 0, 1)) == [] and d.engine_stats.num_loading_slots == 0
    d.run()
    assert d.engine_stats.num_lora_wait_steps == 0 and d.engine_stats.num_cpu_tier_versions == 1


def test_shell_stats_carry_the_movement_gauges(tmp_path):
    config = overlap_driver(
        max_num_seqs=4, max_num_batched_tokens=16, max_model_len=32, max_loras=2, max_cpu_loras=2
    ).config
    shell = make_shell(tmp_path, core=Core(config))
    shell.handle(ev.WorkerReady(0, 16, 1000, [2], "cpu", "float32"))
    shell.handle(ev.AdapterLoadRequested("op-1", "a", "/adapters/a", 8, 1000))
    shell.handle(ev.AdapterLoadRequested("op-2", "b", "/adapters/b", 8, 3000))
    shell.handle(ev.RequestArrived("a1", [5, 6, 7], SamplingParams(max_tokens=2), lora_name="a"))
    shell.handle(ev.RequestArrived("z", [5, 6, 7], SamplingParams(max_tokens=2)))
    stats = [x for x in shell.to_tokenizer.sent if isinstance(x, ev.EngineStats)][-1]
    assert (stats.num_loading_slots, stats.num_cpu_tier_versions, stats.cpu_tier_bytes, stats.num_lora_wait_steps) == (
        1,
        2,
        4000,
        1,
    )
    sent = [type(x).__name__ for x in shell.to_workers[0].sent]
    assert sent == ["AdapterPrefetched", "AdapterPrefetched", "AdapterSlotAssigned", "StepPlan"]
