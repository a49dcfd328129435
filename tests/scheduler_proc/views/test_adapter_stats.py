"""The fold of the event log into per-adapter figures (scheduler_proc.views.adapter_stats): on
hand-built event sequences (a load counts once over the ranks with the slowest duration,
hits and misses, waits in steps and ms, unload and re-registration), and on random
workloads against the core's own state (running and waiting requests, where each adapter is)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledgerserve.scheduler_proc.core.slots import SlotState
from ledgerserve.scheduler_proc.replay import main as replay_main
from ledgerserve.scheduler_proc.views.adapter_stats import AdapterStats, LoadRecord
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import EventLogWriter
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.sim.slots import LoadPolicy
from ledgerserve.sim.workload import run_adapter_workload
from tests.scheduler_proc.driver import Driver


def fold_all(stats: AdapterStats, events: list) -> list[LoadRecord]:
    return [load for event in events for load in stats.fold(event)]


def arrived(req_id: str, lora: str | None, arrival_time_s: float = 0.0, num_tokens: int = 3) -> ev.RequestArrived:
    return ev.RequestArrived(req_id, list(range(num_tokens)), SamplingParams(max_tokens=2), arrival_time_s, lora)


def plan(step: int, *req_ids: str, slot: int = 0) -> ev.StepPlan:
    return ev.StepPlan(step, [ev.NewReq(r, [1, 2, 3], 3, SamplingParams(), [], 0, 3, slot) for r in req_ids])


def test_a_load_counts_once_when_every_rank_is_done_with_the_slowest_duration():
    stats = AdapterStats(num_ranks=2, overlap_loading=True)
    assert fold_all(stats, [ev.AdapterRegistered("a", 1, "/a"), ev.AdapterSlotAssigned(0, 1, "/a")]) == []
    assert stats.fold(ev.AdapterLoadCompleted(1, 0, 1, "cpu", 7.5, 100, 50.0)) == []
    assert stats.tier(1) == "disk"  # one rank of two: not on the GPU, nor staged everywhere
    assert stats.fold(ev.AdapterLoadCompleted(1, 0, 1, "cpu", 99.0, 100, 51.0)) == []  # a rank counts once
    assert stats.fold(ev.AdapterLoadCompleted(0, 0, 1, "disk", 3.0, 100, 49.0)) == [LoadRecord("a", 1, "disk", 7.5)]
    assert stats.tier(1) == "gpu"
    fig = stats.figures["a"]
    assert (fig.num_loads, fig.load_ms_total, fig.load_ms_max) == ({"disk": 1}, 7.5, 7.5)
    assert stats.fold(ev.AdapterLoadCompleted(0, 0, 1, "cpu", 1.0, 100, 52.0)) == []  # stale: nothing loads there
    fold_all(stats, [ev.AdapterEvicted(0, 1)])
    assert stats.tier(1) == "cpu"  # both ranks hold it in their CPU tier
    fold_all(
        stats,
        [
            ev.AdapterSlotAssigned(1, 1, "/a"),
            ev.AdapterLoadCompleted(0, 1, 1, "cpu", 2.0, 10),
            ev.AdapterLoadCompleted(1, 1, 1, "cpu", 4.0, 10),
        ],
    )
    assert (fig.num_loads, fig.load_ms_total, fig.load_ms_max) == ({"disk": 1, "cpu": 1}, 11.5, 7.5)
    fold_all(stats, [ev.AdapterEvicted(1, 1), ev.AdapterCpuEvicted(1)])
    assert stats.tier(1) == "disk"


def test_stagings_and_failed_loads():
    stats = AdapterStats(num_ranks=2, overlap_loading=True)
    fold_all(
        stats,
        [
            ev.AdapterRegistered("a", 1, "/a"),
            ev.AdapterPrefetched(1, "/a"),
            ev.AdapterLoadCompleted(0, -1, 1, "disk", 5.0, 10),
            ev.AdapterLoadCompleted(1, -1, 1, "disk", 6.0, 10),
        ],
    )
    assert stats.figures["a"].num_stagings == 1 and stats.tier(1) == "cpu" and stats.figures["a"].num_loads == {}
    fold_all(
        stats,
        [
            ev.AdapterSlotAssigned(0, 1, "/a"),
            ev.AdapterLoadCompleted(0, 0, 1, "cpu", 1.0, 10),
            ev.AdapterLoadFailed(1, 0, 1, "gone"),
            ev.AdapterEvicted(0, 1),
            ev.AdapterLoadCompleted(1, 0, 1, "cpu", 1.0, 10),
        ],
    )  # a late report of the failed load
    assert stats.figures["a"].num_loads == {} and stats.tier(1) == "cpu"


def test_hits_misses_and_waits_in_steps_and_ms():
    stats = AdapterStats(num_ranks=1, overlap_loading=True, keep_waits=True)
    fold_all(
        stats,
        [
            ev.AdapterRegistered("a", 1, "/a"),
            arrived("r1", "a", 100.0),
            ev.AdapterSlotAssigned(0, 1, "/a"),
            arrived("z", None, 100.1),
            plan(1, "z", slot=-1),
            plan(2),
        ],
    )
    assert stats.figures["a"].num_waiting == 1 and stats.live_waits()[0].wait_steps == 2  # so far
    fold_all(stats, [ev.AdapterLoadCompleted(0, 0, 1, "disk", 240.0, 10, 100.25), plan(3, "r1")])
    fold_all(stats, [arrived("r2", "a", 101.0), plan(4, "r2")])  # ready at its arrival: a hit
    fold_all(
        stats,
        [
            ev.RequestFinished("r1", "length", 2),
            ev.RequestFinished("r2", "length", 2),
            ev.AdapterEvicted(0, 1),
            arrived("r3", "a", 102.0),
            ev.AdapterSlotAssigned(1, 1, "/a"),
            plan(5),
            ev.AdapterLoadCompleted(0, 1, 1, "cpu", 20.0, 10, 102.5),
            plan(6, "r3", slot=1),
            ev.RequestFinished("r3", "length", 2),
        ],
    )
    waits = {w.req_id: (w.hit, w.wait_steps, w.wait_ms) for w in stats.finished_waits}
    assert waits == {
        "r1": (False, 2, pytest.approx(250.0)),
        "r2": (True, 0, 0.0),
        "r3": (False, 1, pytest.approx(500.0)),
    }
    fig = stats.figures["a"]
    assert (fig.num_hits, fig.num_misses, fig.wait_steps, fig.num_timed_waits) == (1, 2, 3, 2)
    assert fig.wait_ms == pytest.approx(750.0) and stats.lora_wait_ms == pytest.approx(750.0)
    assert (fig.num_running, fig.num_waiting, fig.num_prompt_tokens, fig.num_generated_tokens) == (0, 0, 9, 6)


def test_a_slot_ready_at_arrival_but_reloaded_before_the_first_plan_is_a_miss():
    stats = AdapterStats(num_ranks=1, overlap_loading=True, keep_waits=True)
    fold_all(
        stats,
        [
            ev.AdapterRegistered("a", 1, "/a"),
            ev.AdapterSlotAssigned(0, 1, "/a"),
            ev.AdapterLoadCompleted(0, 0, 1, "disk", 1.0, 10),
            arrived("r1", "a"),
            ev.AdapterEvicted(0, 1),
            plan(1),
            ev.AdapterSlotAssigned(0, 1, "/a"),
            ev.AdapterLoadCompleted(0, 0, 1, "cpu", 1.0, 10),
            plan(2, "r1"),
            ev.RequestFinished("r1", "length", 2),
        ],
    )
    assert [(w.hit, w.wait_steps, w.wait_ms) for w in stats.finished_waits] == [(False, 1, None)]  # no times in the log


def test_without_overlap_a_slot_is_ready_at_assignment():
    stats = AdapterStats(num_ranks=1, overlap_loading=False, keep_waits=True)
    fold_all(
        stats,
        [
            ev.AdapterRegistered("a", 1, "/a"),
            arrived("r1", "a", 10.0),
            ev.AdapterSlotAssigned(0, 1, "/a"),
            plan(1, "r1"),
            ev.AdapterLoadCompleted(0, 0, 1, "disk", 4.0, 10, 10.5),
        ],
    )
    assert stats.tier(1) == "gpu" and stats.figures["a"].num_loads == {"disk": 1}
    assert [(w.hit, w.wait_steps) for w in stats.live_waits()] == [(False, 0)]


def test_unload_drops_the_figures_and_late_requests_are_not_counted():
    stats = AdapterStats(num_ranks=1, overlap_loading=True)
    fold_all(
        stats,
        [
            ev.AdapterRegistered("a", 1, "/a"),
            arrived("r1", "a"),
            ev.AdapterSlotAssigned(0, 1, "/a"),
            ev.AdapterLoadCompleted(0, 0, 1, "disk", 1.0, 10),
            plan(1, "r1"),
        ],
    )
    assert [(r.name, r.tier, r.num_running, r.num_waiting) for r in stats.take_changed_rows()] == [("a", "gpu", 1, 0)]
    assert stats.take_changed_rows() == []  # only rows that changed go out
    fold_all(stats, [ev.AdapterUnloaded("a", 1), ev.AdapterEvictionDeferred(1, 0, 1)])
    assert stats.figures == {} and stats.take_changed_rows() == []
    fold_all(
        stats,
        [
            ev.AdapterRegistered("a", 2, "/a2"),
            ev.RequestFinished("r1", "length", 2),
            ev.AdapterEvicted(0, 1),
            ev.AdapterCpuEvicted(1),
        ],
    )
    (row,) = stats.take_changed_rows()
    assert (row.version_id, row.num_running, row.num_prompt_tokens, row.tier) == (2, 0, 0, "disk")
    assert sorted(stats._versions) == [2]  # the old version is forgotten once nothing holds it


def test_a_rejected_duplicate_id_leaves_the_live_request_alone():
    stats = AdapterStats(num_ranks=1, overlap_loading=True)
    fold_all(
        stats,
        [
            ev.AdapterRegistered("a", 1, "/a"),
            arrived("r1", "a"),
            arrived("r1", "a"),
            ev.RequestRejected("r1", "Request id 'r1' is already in use."),
        ],
    )
    assert stats.figures["a"].num_waiting == 1
    fold_all(stats, [ev.RequestRejected("r1", "too long")])  # a request the core can never serve
    assert stats.figures["a"].num_waiting == 0


class RecordingDriver(Driver):
    """Folds every input and decision as the shell logs them, and checks the fold's running
    and waiting requests and locations against the core's state after each input."""

    def __init__(self, **kwargs) -> None:
        config_ranks = kwargs.get("tensor_parallel_size", 1)
        self.stats = AdapterStats(config_ranks, kwargs.get("lora_overlap_loading", False))
        super().__init__(**kwargs)

    def send(self, event):
        decisions = super().send(event)
        fold_all(self.stats, [event, *decisions])
        self.check_against_core()
        return decisions

    def check_against_core(self) -> None:
        core = self.core
        ready = {s.version_id for s in core.adapters.slots.slots if s.state in (SlotState.LOADED, SlotState.PINNED)}
        for name, version_id in sorted(core.adapters.registry.items()):
            fig = self.stats.figures[name]
            running = sum(1 for r in core.scheduler.running if r.lora_name == name and r.version_id == version_id)
            waiting = sum(1 for r in core.scheduler.waiting if r.lora_name == name and r.version_id == version_id)
            assert fig.version_id == version_id
            if all(r.version_id == version_id for r in core.requests.values() if r.lora_name == name):
                assert (fig.num_running, fig.num_waiting) == (running, waiting), name
            assert (self.stats.tier(version_id) == "gpu") == (version_id in ready), name
        assert sorted(self.stats.figures) == sorted(core.adapters.registry)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_loras=st.integers(1, 3), tp=st.integers(1, 2), overlap=st.booleans())
def test_the_fold_agrees_with_the_core_on_random_workloads(seed, max_loras, tp, overlap):
    policy = dict(load_policy=LoadPolicy(seed, 0.5, 0.02), digests=True) if overlap else {}
    d = RecordingDriver(
        num_kv_blocks=12,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        max_model_len=32,
        enable_lora=True,
        max_loras=max_loras,
        max_cpu_loras=max_loras + 1,
        lora_max_wait_steps=4,
        tensor_parallel_size=tp if overlap else 1,
        lora_overlap_loading=overlap,
        **policy,
    )
    run_adapter_workload(d, seed, num_events=120)
    num_first_plans = sum(f.num_hits + f.num_misses for f in d.stats.figures.values())
    assert num_first_plans <= sum(1 for x in d.inputs if isinstance(x, ev.RequestArrived))
    if overlap:  # every slot load that every rank finished counts once, while its name stays registered
        assert sum(f.num_loads_total for f in d.stats.figures.values()) <= len(d.of_type(ev.AdapterSlotAssigned))


def test_replay_shows_the_figures_the_running_fold_had(tmp_path, capsys):
    engine = EngineConfig(
        model_dir="m",
        served_model_name="m",
        max_model_len=32,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        tensor_parallel_size=2,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
        lora_max_wait_steps=4,
    )
    writer = EventLogWriter(str(tmp_path), engine.to_json(), run_id="figures")
    d = RecordingDriver(
        num_kv_blocks=12,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        max_model_len=32,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
        lora_max_wait_steps=4,
        tensor_parallel_size=2,
        lora_overlap_loading=True,
        load_policy=LoadPolicy(7, 0.5, 0.0),
        digests=True,
        log=writer,
    )
    run_adapter_workload(d, 7, num_events=150)
    writer.close()
    assert replay_main([writer.path, "--show", "adapters,requests", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)["figures"]
    live = d.stats
    assert figures["adapter_figures"]["adapters"] == [
        live.figures[n].to_json(live.tier(live.figures[n].version_id)) for n in sorted(live.figures)
    ]
    assert figures["adapter_figures"]["engine"]["num_lora_wait_steps"] == d.engine_stats.num_lora_wait_steps
    num_planned = len({r.req_id for p in d.plans for r in p.new_reqs if d.worker.req_versions.get(r.req_id)})
    assert sum(w["hit"] is not None for w in figures["adapter_waits"]) == num_planned
    assert sum(sum(row["loads"].values()) for row in figures["adapter_figures"]["adapters"]) > 0
    assert replay_main([writer.path, "--show", "adapters,requests"]) == 0
    text = capsys.readouterr().out
    assert "== adapter figures ==" in text and "== adapter waits ==" in text and "slot hits" in text
