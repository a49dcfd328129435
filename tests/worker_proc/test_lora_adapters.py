"""Adapter ops on the ModelRunner: failed loads leave the slot empty and the runner
serving; the CPU tier serves reloads without disk; the digest covers the slot table."""

from __future__ import annotations

import os
import shutil

import pytest

from ledgerserve.shared.adapter_format import WEIGHTS_FILE
from ledgerserve.shared.events import (
    AdapterCpuEvicted,
    AdapterEvicted,
    AdapterLoadCompleted,
    AdapterLoadFailed,
    AdapterSlotAssigned,
    NewReq,
    StepPlan,
)
from ledgerserve.worker_proc.runner import ModelRunner
from tests.reference import assert_greedy_matches
from tests.worker_proc.fake_scheduler import FakeScheduler, run_to_completion
from tests.worker_proc.lora_setup import BLOCK_SIZE, GREEDY, NUM_BLOCKS, LoraSetup, lora_config


def _assigned(slot: int, version_id: int, path: str) -> AdapterSlotAssigned:
    return AdapterSlotAssigned(slot, version_id, path)


def _done(reply) -> tuple[int, int, str]:
    assert isinstance(reply, AdapterLoadCompleted), reply
    return reply.slot, reply.version_id, reply.source_tier


def _run_one(runner: ModelRunner, setup: LoraSetup, name: str, slot: int) -> list[int]:
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    sched.add(name, setup.prompts[name], GREEDY, chunk=5, lora_slot=slot)
    return run_to_completion(runner, sched)[name].outputs


def _truncated_copy(src: str, dst: str) -> str:
    shutil.copytree(src, dst)
    weights = os.path.join(dst, WEIGHTS_FILE)
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    return dst


def test_failed_loads_leave_slot_empty_and_runner_serving(lora_setup: LoraSetup, tmp_path) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir))
    missing = runner.adapters.load(_assigned(0, 1, str(tmp_path / "no-such-adapter")))
    assert isinstance(missing, AdapterLoadFailed) and (missing.slot, missing.version_id) == (0, 1)
    assert "no-such-adapter" in missing.message
    bad = _truncated_copy(lora_setup.adapter_dirs["mlp"], str(tmp_path / "truncated-mlp"))
    truncated = runner.adapters.load(_assigned(1, 2, bad))
    assert isinstance(truncated, AdapterLoadFailed) and "truncated-mlp" in truncated.message
    assert "truncated" in truncated.message.replace("truncated-mlp", "")
    fits = runner.adapters.load(_assigned(2, 3, lora_setup.adapter_dirs["all"]))  # rank 32 fits
    assert isinstance(fits, AdapterLoadCompleted)
    narrow = ModelRunner(lora_config(lora_setup.base_dir, max_lora_rank=16))
    refused = narrow.adapters.load(_assigned(0, 4, lora_setup.adapter_dirs["all"]))
    assert isinstance(refused, AdapterLoadFailed) and "max-lora-rank" in refused.message
    out_of_range = runner.adapters.load(_assigned(99, 5, lora_setup.adapter_dirs["mlp"]))
    assert isinstance(out_of_range, AdapterLoadFailed)
    assert runner.lora.slot_table() == [[2, 3]]
    assert not runner.lora.weights["model.layers.0.mlp.down_proj"].ranks[1].any()
    _check_unloaded_slot_fails_alone(runner, lora_setup)
    assert_greedy_matches({"all": _run_one(runner, lora_setup, "all", 2)}, {"all": lora_setup.refs["all"]})


def _check_unloaded_slot_fails_alone(runner: ModelRunner, setup: LoraSetup) -> None:
    prompt = setup.prompts["base"]
    blocks = list(range((len(prompt) + BLOCK_SIZE - 1) // BLOCK_SIZE))
    good = NewReq("good", prompt, len(prompt), GREEDY, blocks, 0, len(prompt))
    orphan = NewReq("orphan", prompt, len(prompt), GREEDY, [b + len(blocks) for b in blocks], 0, len(prompt), 1)
    done, _ = runner.execute(StepPlan(0, [good, orphan]))
    assert [f.req_id for f in done.failed] == ["orphan"] and "slot 1" in done.failed[0].message
    assert [t.req_id for t in done.sampled] == ["good"]
    assert done.sampled[0].token_id == setup.refs["base"].token_ids[0]
    runner.execute(StepPlan(1, finished_req_ids=["good"]))
    assert runner.requests.reqs == {}


def test_cpu_tier_reload_skips_disk_until_dropped(lora_setup: LoraSetup, tmp_path) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir))
    path = shutil.copytree(lora_setup.adapter_dirs["mlp"], tmp_path / "mlp-copy")
    assert _done(runner.adapters.load(_assigned(0, 7, str(path)))) == (0, 7, "disk")
    shutil.rmtree(path)
    runner.adapters.evict(AdapterEvicted(0, 7))
    assert _done(runner.adapters.load(_assigned(3, 7, str(path)))) == (3, 7, "cpu")
    assert_greedy_matches({"mlp": _run_one(runner, lora_setup, "mlp", 3)}, {"mlp": lora_setup.refs["mlp"]})
    runner.adapters.drop_cpu(AdapterCpuEvicted(7))
    gone = runner.adapters.load(_assigned(4, 7, str(path)))
    assert isinstance(gone, AdapterLoadFailed) and "mlp-copy" in gone.message
    assert runner.lora.slot_table() == [[3, 7]]


def test_stale_evict_keeps_newer_version_and_digest_tracks_slots(lora_setup: LoraSetup) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir))
    empty = runner.digest()
    runner.adapters.load(_assigned(1, 11, lora_setup.adapter_dirs["attn"]))
    one = runner.digest()
    runner.adapters.evict(AdapterEvicted(1, 10))  # names an older version: no-op
    assert runner.lora.slot_table() == [[1, 11]] and runner.digest() == one != empty
    runner.adapters.load(_assigned(1, 12, lora_setup.adapter_dirs["attn"]))  # same weights, new version
    assert runner.digest() not in (one, empty)
    runner.adapters.evict(AdapterEvicted(1, 12))
    assert runner.digest() == empty


def test_lora_disabled_refuses_loads_and_slots(lora_setup: LoraSetup) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir, enable_lora=False))
    failed = runner.adapters.load(_assigned(0, 1, lora_setup.adapter_dirs["mlp"]))
    assert isinstance(failed, AdapterLoadFailed) and "not enabled" in failed.message
    prompt = lora_setup.prompts["base"]
    req = NewReq("r", prompt, len(prompt), GREEDY, list(range(4)), 0, len(prompt), 0)
    done, _ = runner.execute(StepPlan(0, [req]))
    assert [f.req_id for f in done.failed] == ["r"] and runner.lora is None


@pytest.mark.parametrize("slot", [-2, 6])
def test_evict_out_of_range_is_ignored(lora_setup: LoraSetup, slot: int) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir))
    runner.adapters.evict(AdapterEvicted(slot, 1))
    assert runner.lora.slot_table() == []
