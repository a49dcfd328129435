"""Random adapter workloads: integrity after every event, the cap in every plan, an idle
end with no pins and no deferred evictions, identical decisions under any hash seed, and
a recorded run that replays; on the reference path and with overlapped loading, where
loads end at random moments, in any order over the ranks, and sometimes fail."""

import os
import subprocess
import sys

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from ledgerserve.scheduler_proc.core import CoreConfig
from ledgerserve.scheduler_proc.replay import replay
from ledgerserve.shared import codec
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import EventLogWriter
from ledgerserve.sim.slots import LoadPolicy
from ledgerserve.sim.workload import run_adapter_workload
from tests.scheduler_proc.driver import Driver

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _driver(num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=16, max_loras=2, aging=4, log=None) -> Driver:
    return Driver(
        num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=4,
        max_model_len=32,
        enable_lora=True,
        max_loras=max_loras,
        max_cpu_loras=max_loras + 1,
        lora_max_wait_steps=aging,
        log=log,
    )


def _check_idle_end(d: Driver, max_loras: int) -> None:
    stats = d.engine_stats
    assert not d.core.has_unfinished() and stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks
    assert stats.num_pinned_slots == 0 and stats.num_deferred_evictions == 0
    assert not d.of_type(ev.EngineFailed)
    assert all(len(d.plan_versions(plan)) <= max_loras for plan in d.plans)
    answered = {x.req_id for x in d.of_type(ev.RequestFinished)} | {x.req_id for x in d.of_type(ev.RequestRejected)}
    assert answered == {x.req_id for x in d.inputs if isinstance(x, ev.RequestArrived)}


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_kv_blocks=st.integers(8, 24),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(2, 40),
    max_loras=st.integers(1, 3),
    aging=st.integers(1, 8),
)
def test_integrity_after_random_adapter_workloads(
    seed, num_kv_blocks, max_num_seqs, max_num_batched_tokens, max_loras, aging
):
    d = _driver(num_kv_blocks, max_num_seqs, max_num_batched_tokens, max_loras, aging)
    run_adapter_workload(d, seed)  # the driver checks integrity and the slot table after every event
    _check_idle_end(d, max_loras)


def test_workload_exercises_the_adapter_paths():
    d = _driver()
    run_adapter_workload(d, 5, num_events=300)
    _check_idle_end(d, 2)
    for kind in (ev.AdapterEvictionDeferred, ev.AdapterEvicted, ev.AdapterCpuEvicted, ev.RequestPreempted):
        assert d.of_type(kind), kind.__name__
    assert any(x.replaced_version_id for x in d.of_type(ev.AdapterRegistered))
    assert any(x.code == 500 for x in d.of_type(ev.RequestRejected))
    assert len({d.plan_versions(p)[0] for p in d.plans if d.plan_versions(p)}) >= 3


def adapter_fingerprint(seed: int) -> str:
    d = _driver()
    run_adapter_workload(d, seed, num_events=200)
    return xxhash.xxh64_hexdigest(b"".join(codec.encode(x) for x in d.decisions))


def _printed_under_hash_seeds(fingerprint: str) -> list[str]:
    """What `fingerprint`(5) and `fingerprint`(8) print in a fresh interpreter under PYTHONHASHSEED 0 and 4242."""
    code = f"from tests.scheduler_proc.test_adapter_random import {fingerprint} as f; print(f(5), f(8))"
    outputs = []
    for hash_seed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=ROOT)
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
        )
        outputs.append(proc.stdout)
    return outputs


def test_adapter_decisions_identical_across_pythonhashseed():
    outputs = _printed_under_hash_seeds("adapter_fingerprint")
    assert outputs[0] == outputs[1]
    assert outputs[0].split() == [adapter_fingerprint(5), adapter_fingerprint(8)]


def test_recorded_adapter_run_replays(tmp_path):
    engine = EngineConfig(
        model_dir="m",
        served_model_name="m",
        max_model_len=32,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
        lora_overlap_loading=False,
    )
    writer = EventLogWriter(str(tmp_path), engine.to_json(), run_id="lora")
    d = _driver(aging=16, log=writer)  # 16: EngineConfig's default, which replay reads from the header
    run_adapter_workload(d, 5, num_events=150)
    writer.append(ev.LogClosed("done"))
    writer.close()
    result = replay(writer.path)
    assert result.ok, result.divergence.describe() if result.divergence else ""
    assert result.core.snapshot()["adapters"] == d.core.snapshot()["adapters"]


# ---------------------------------------------------------------- overlapped loading


def _overlap_driver(
    seed: int,
    num_kv_blocks=8,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_loras=2,
    aging=4,
    tp=1,
    steps_in_flight=1,
    p_finish=0.4,
    p_fail=0.02,
    log=None,
) -> Driver:
    """Loads end at random after steps (and one at a time when no step runs), in any order
    over the ranks; a slot load fails now and then."""
    return Driver(
        num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=4,
        max_model_len=32,
        enable_lora=True,
        max_loras=max_loras,
        max_cpu_loras=max_loras + 1,
        lora_max_wait_steps=aging,
        tensor_parallel_size=tp,
        max_steps_in_flight=steps_in_flight,
        log=log,
        lora_overlap_loading=True,
        load_policy=LoadPolicy(seed, p_finish, p_fail),
        digests=True,
    )


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_kv_blocks=st.integers(8, 24),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(2, 40),
    max_loras=st.integers(1, 3),
    aging=st.integers(1, 8),
    tp=st.integers(1, 2),
    steps_in_flight=st.integers(1, 2),
    p_finish=st.sampled_from([0.1, 0.5, 0.9]),
)
def test_integrity_after_random_adapter_workloads_with_overlapped_loading(
    seed, num_kv_blocks, max_num_seqs, max_num_batched_tokens, max_loras, aging, tp, steps_in_flight, p_finish
):
    d = _overlap_driver(
        seed, num_kv_blocks, max_num_seqs, max_num_batched_tokens, max_loras, aging, tp, steps_in_flight, p_finish
    )
    run_adapter_workload(d, seed)  # integrity, the slot tables and every rank's loads checked after every event
    _check_idle_end(d, max_loras)
    assert d.engine_stats.num_loading_slots == 0 and d.pending_loads == []


def test_overlap_workload_exercises_the_movement_paths():
    d = _overlap_driver(25, tp=2, p_fail=0.05)
    run_adapter_workload(d, 25, num_events=300)
    _check_idle_end(d, 2)
    for kind in (
        ev.AdapterPrefetched,
        ev.AdapterSlotAssigned,
        ev.AdapterEvicted,
        ev.AdapterCpuEvicted,
        ev.RequestPreempted,
        ev.AdapterDrainStarted,
        ev.AdapterDrainCancelled,
    ):
        assert d.of_type(kind), kind.__name__
    completions = [x for x in d.inputs if isinstance(x, ev.AdapterLoadCompleted)]
    assert {x.rank for x in completions} == {0, 1} and any(x.slot == -1 for x in completions)
    assert any(x.slot >= 0 for x in d.inputs if isinstance(x, ev.AdapterLoadFailed))
    assert d.engine_stats.num_lora_wait_steps > 0
    assert any(isinstance(x, ev.AdapterEvictionDeferred) and x.num_reqs == 0 for x in d.decisions)  # unloaded mid-load


def overlap_fingerprint(seed: int) -> str:
    d = _overlap_driver(seed, tp=2, steps_in_flight=2, p_fail=0.05)
    run_adapter_workload(d, seed, num_events=200)
    assert seed != 8 or d.of_type(ev.AdapterDrainStarted)  # seed 8 drains slots
    return xxhash.xxh64_hexdigest(b"".join(codec.encode(x) for x in d.decisions))


def test_overlap_decisions_identical_across_pythonhashseed():
    code = "from tests.scheduler_proc.test_adapter_random import overlap_fingerprint as f; print(f(5), f(8))"
    outputs = []
    for hash_seed in ("0", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=ROOT)
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
        )
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1]
    assert outputs[0].split() == [overlap_fingerprint(5), overlap_fingerprint(8)]


@pytest.mark.parametrize("seed", [5, 8])  # seed 8 drains slots
def test_recorded_overlap_run_replays(tmp_path, seed):
    engine = EngineConfig(
        model_dir="m",
        served_model_name="m",
        max_model_len=32,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
        tensor_parallel_size=2,
        async_scheduling=True,
    )
    assert engine.lora_overlap_loading
    writer = EventLogWriter(str(tmp_path), engine.to_json(), run_id="overlap")
    d = _overlap_driver(seed, aging=16, tp=2, steps_in_flight=2, p_fail=0.05, log=writer)
    assert CoreConfig.from_engine(engine) == d.config
    run_adapter_workload(d, seed, num_events=150)
    writer.append(ev.LogClosed("done"))
    writer.close()
    result = replay(writer.path)
    assert result.ok, result.divergence.describe() if result.divergence else ""
    assert result.core.snapshot()["adapters"] == d.core.snapshot()["adapters"]
    assert any(isinstance(x, ev.AdapterLoadCompleted) for x in d.inputs)
    assert seed != 8 or d.of_type(ev.AdapterDrainStarted)


# ---------------------------------------------------------------- user pins and on-demand registrations


def _marked_driver(seed: int, overlap: bool, max_loras=3, max_on_demand_loras=2, log=None, **kwargs) -> Driver:
    """Loads pinned or on demand at random, with a small on-demand bound: the driver checks that
    no pinned version is evicted while registered, the core's integrity covers the bounds."""
    policy = LoadPolicy(seed, 0.5, 0.02) if overlap else None
    return Driver(
        8,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        max_model_len=32,
        enable_lora=True,
        max_loras=max_loras,
        max_cpu_loras=max_loras + 1,
        lora_max_wait_steps=4,
        log=log,
        lora_overlap_loading=overlap,
        load_policy=policy,
        max_on_demand_loras=max_on_demand_loras,
        **kwargs,
    )


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    overlap=st.booleans(),
    max_loras=st.integers(1, 3),
    max_on_demand_loras=st.integers(1, 3),
    steps_in_flight=st.integers(1, 2),
)
def test_integrity_with_pins_and_on_demand_loads(seed, overlap, max_loras, max_on_demand_loras, steps_in_flight):
    d = _marked_driver(seed, overlap, max_loras, max_on_demand_loras, max_steps_in_flight=steps_in_flight)
    run_adapter_workload(d, seed, marks=True)
    _check_idle_end(d, max_loras)


def test_marked_workload_exercises_pins_and_lru():
    for overlap in (False, True):
        d = _marked_driver(2, overlap, max_on_demand_loras=1)
        run_adapter_workload(d, 2, num_events=300, marks=True)
        _check_idle_end(d, 3)
        loads = [x for x in d.inputs if isinstance(x, ev.AdapterLoadRequested)]
        assert any(x.pinned for x in loads) and any(x.on_demand for x in loads)
        assert any(x.reason == "lru" for x in d.of_type(ev.AdapterUnloaded)), overlap
        assert any(x.code == 503 for x in d.of_type(ev.AdapterOpReplied)), overlap  # every on-demand one in use
        pinned_ids = {d.replies[x.op_id].version_id for x in loads if x.pinned and d.replies[x.op_id].code == 200}
        assert pinned_ids & {x.version_id for x in d.of_type(ev.AdapterSlotAssigned)}, overlap


def marked_fingerprint(seed: int) -> str:
    d = _marked_driver(seed, True, max_on_demand_loras=1, tensor_parallel_size=2, digests=True, max_steps_in_flight=2)
    run_adapter_workload(d, seed, num_events=200, marks=True)
    return xxhash.xxh64_hexdigest(b"".join(codec.encode(x) for x in d.decisions))


def test_marked_decisions_identical_across_pythonhashseed():
    outputs = _printed_under_hash_seeds("marked_fingerprint")
    assert outputs[0] == outputs[1]
    assert outputs[0].split() == [marked_fingerprint(5), marked_fingerprint(8)]


def test_recorded_marked_run_replays(tmp_path):
    for overlap in (False, True):
        engine = EngineConfig(
            model_dir="m",
            served_model_name="m",
            max_model_len=32,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            block_size=4,
            enable_lora=True,
            max_loras=3,
            max_cpu_loras=4,
            lora_overlap_loading=overlap,
            max_on_demand_loras=1,
            lora_max_wait_steps=4,
        )
        writer = EventLogWriter(str(tmp_path / str(overlap)), engine.to_json(), run_id="marked")
        d = _marked_driver(5, overlap, max_on_demand_loras=1, log=writer)
        assert CoreConfig.from_engine(engine) == d.config
        run_adapter_workload(d, 5, num_events=200, marks=True)
        writer.append(ev.LogClosed("done"))
        writer.close()
        result = replay(writer.path)
        assert result.ok, result.divergence.describe() if result.divergence else ""
        snapshot = result.core.snapshot()["adapters"]
        assert snapshot == d.core.snapshot()["adapters"]
        assert any(x.reason == "lru" for x in d.of_type(ev.AdapterUnloaded)) and any(
            x.pinned for x in d.inputs if isinstance(x, ev.AdapterLoadRequested)
        )
