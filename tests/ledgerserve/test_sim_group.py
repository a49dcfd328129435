"""ledgerserve/sim's fake worker group as the in-process engine's Runner: the real core serves base
and adapter requests through it (slots loaded in command order, or overlapped), its log verifies on
replay, and its checks still catch a plan or an eviction a real worker could not carry out."""

from __future__ import annotations

import random

import pytest

from ledgerserve.engine import Engine
from ledgerserve.scheduler_proc.replay import replay
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.sim.group import EOS, FakeGroup
from ledgerserve.sim.slots import LoadPolicy

ADAPTERS = ("a", "b", "c")


def _config(overlap: bool) -> EngineConfig:
    return EngineConfig(
        model_dir="sim",
        served_model_name="sim",
        max_model_len=64,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=3,
        lora_overlap_loading=overlap,
    )


def _finished(decisions: list[ev.Event]) -> dict[str, str]:
    return {d.req_id: d.finish_reason for d in decisions if isinstance(d, ev.RequestFinished)}


def _serve(engine: Engine, group: FakeGroup, seed: int, num_reqs: int) -> dict[str, str]:
    """Register the adapters, send base and adapter requests (some scripted to stop early), run to idle
    after every third; each request's finish reason."""
    versions: dict[str | None, int] = {None: 0}
    for i, name in enumerate(ADAPTERS):
        decisions = engine.apply(ev.AdapterLoadRequested(f"op-{i}", name, f"/adapters/{name}", 8, 1000))
        versions.update({d.name: d.version_id for d in decisions if isinstance(d, ev.AdapterRegistered)})
    rng = random.Random(seed)
    finished: dict[str, str] = {}
    for n in range(num_reqs):
        req_id, lora = f"r{n}", rng.choice((None, *ADAPTERS))
        group.worker.req_versions[req_id] = versions[lora]
        group.script(req_id, [rng.choice([5, 6, EOS]) for _ in range(rng.randint(0, 4))])
        prompt = list(range(100, 100 + rng.randint(1, 20)))
        engine.apply(ev.RequestArrived(req_id, prompt, SamplingParams(max_tokens=rng.randint(1, 8)), lora_name=lora))
        if n % 3 == 2:
            finished.update(_finished(engine.run_until_idle()))
    finished.update(_finished(engine.run_until_idle()))
    return finished


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_engine_serves_through_the_fake_group_and_its_log_verifies(tmp_path, overlap: bool, seed: int) -> None:
    config = _config(overlap)
    policy = LoadPolicy(seed) if overlap and seed else None  # seed 0: every load ends at the next poll
    group = FakeGroup.from_engine(config, num_kv_blocks=12, load_policy=policy)
    engine = Engine(config, group, log_dir=str(tmp_path))
    finished = _serve(engine, group, seed, num_reqs=30)
    engine.close()
    assert sorted(finished) == sorted(f"r{n}" for n in range(30))
    assert set(finished.values()) <= {"stop", "length"}
    assert not group.adapters.busy() and not engine.core.has_unfinished()
    assert len(group.slots.versions) <= config.max_loras
    assert replay(str(tmp_path)).ok


def test_a_plan_for_a_request_the_group_does_not_hold_fails() -> None:
    group = FakeGroup.from_engine(_config(False), num_kv_blocks=12)
    plan = ev.StepPlan(1, cached_reqs=[ev.CachedReq("ghost", [5], [], 3, 1)])
    with pytest.raises(AssertionError, match="does not hold"):
        group.execute(plan)


def _running_on_slot(group: FakeGroup) -> ev.StepPlan:
    """A first plan that runs r0 (version 1) on slot 0, just loaded."""
    assert group.adapters.command(ev.AdapterSlotAssigned(0, 1, "/adapters/a"), 0.0)[0].version_id == 1
    group.worker.req_versions["r0"] = 1
    new = ev.NewReq("r0", [100, 101, 102], 3, SamplingParams(max_tokens=4), [0], 0, 3, lora_slot=0)
    group.execute(ev.StepPlan(1, new_reqs=[new]))
    return ev.StepPlan(2, cached_reqs=[ev.CachedReq("r0", [], [], 3, 1, lora_slot=0)])


def test_an_eviction_under_a_running_request_fails_at_the_next_plan() -> None:
    group = FakeGroup.from_engine(_config(False), num_kv_blocks=12)
    next_plan = _running_on_slot(group)
    group.adapters.command(ev.AdapterEvicted(0, 1), 0.0)  # r0 may have finished: the next plan says
    with pytest.raises(AssertionError, match="still ran on it"):
        group.execute(next_plan)


def test_an_eviction_after_its_request_ended_passes() -> None:
    group = FakeGroup.from_engine(_config(False), num_kv_blocks=12)
    _running_on_slot(group)
    group.adapters.command(ev.AdapterEvicted(0, 1), 0.0)
    completed, digest = group.execute(ev.StepPlan(2, finished_req_ids=["r0"]))
    assert completed.step == digest.step == 2 and completed.sampled == []
