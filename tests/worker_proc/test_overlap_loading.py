"""Overlapped adapter loading on the ModelRunner: loads run on the loader threads and end in
any order; steps on other slots run while a load is under way, and a step on the loading slot
waits for it; evictions of either tier during a load; a version whose files changed since
registration, or vanished, or broke, fails alone; many loads at once; and the CPU tier's pool
gets every page back."""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest
import torch

from ledgerserve.shared.adapter_digest import content_sha256
from ledgerserve.shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from ledgerserve.shared.events import (
    AdapterCpuEvicted,
    AdapterEvicted,
    AdapterLoadCompleted,
    AdapterLoadFailed,
    AdapterPrefetched,
    AdapterSlotAssigned,
    NewReq,
    StepPlan,
)
from ledgerserve.worker_proc.lora import loader
from ledgerserve.worker_proc.runner import ModelRunner
from tests.reference import assert_greedy_matches
from tests.worker_proc.fake_scheduler import FakeScheduler, run_to_completion
from tests.worker_proc.load_gate import ReadGate, poll_until, settle
from tests.worker_proc.lora_setup import BLOCK_SIZE, GREEDY, NUM_BLOCKS, LoraSetup, lora_config


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> ReadGate:
    gate = ReadGate()
    monkeypatch.setattr(loader, "read_image", gate)
    return gate


def _runner(setup: LoraSetup, **kw) -> ModelRunner:
    return ModelRunner(lora_config(setup.base_dir, lora_overlap_loading=True, **kw))


def _assign(runner: ModelRunner, slot: int, version_id: int, path: str, digest: str = "") -> list:
    return runner.adapters.command(AdapterSlotAssigned(slot, version_id, path, content_sha256=digest), time.monotonic())


def _for(replies: list, slot: int) -> list:
    return [r for r in replies if r.slot == slot]


def _generate(runner: ModelRunner, setup: LoraSetup, slots: dict[str, int]) -> None:
    """Greedy generation of each named prompt on its slot (-1: base), checked against PEFT."""
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    for name, slot in slots.items():
        sched.add(name, setup.prompts[name], GREEDY, chunk=6, lora_slot=slot)
    done = run_to_completion(runner, sched)
    assert_greedy_matches({n: r.outputs for n, r in done.items()}, {n: setup.refs[n] for n in slots})


def test_loads_run_on_loader_threads_and_end_out_of_command_order(lora_setup: LoraSetup, gate: ReadGate) -> None:
    runner = _runner(lora_setup)
    attn, mlp = lora_setup.adapter_dirs["attn"], lora_setup.adapter_dirs["mlp"]
    gate.hold(attn)
    assert _assign(runner, 0, 1, attn) == [] and _assign(runner, 1, 2, mlp) == []
    first = poll_until(runner, lambda r: bool(_for(r, 1)))
    assert [(r.slot, type(r).__name__) for r in first] == [(1, "AdapterLoadCompleted")]
    assert 0 in runner.lora.loader.loads and 0 not in runner.lora.slots  # still reading
    gate.release(attn)
    second = poll_until(runner, lambda r: bool(_for(r, 0)))
    done = _for(second, 0)[0]
    assert isinstance(done, AdapterLoadCompleted) and done.source_tier == "disk" and done.duration_ms > 0
    assert done.num_bytes == sum(os.path.getsize(os.path.join(attn, f)) for f in (CONFIG_FILE, WEIGHTS_FILE))
    assert gate.thread_names and all(name.startswith("adapter-load") for name in gate.thread_names)
    _generate(runner, lora_setup, {"attn": 0, "mlp": 1})


def test_steps_run_beside_a_load_and_a_step_on_the_loading_slot_waits(lora_setup: LoraSetup, gate: ReadGate) -> None:
    runner = _runner(lora_setup)
    assert isinstance(
        runner.adapters.load(AdapterSlotAssigned(1, 2, lora_setup.adapter_dirs["mlp"])), AdapterLoadCompleted
    )
    held = gate.hold(lora_setup.adapter_dirs["all"])
    _assign(runner, 0, 1, lora_setup.adapter_dirs["all"])
    _generate(runner, lora_setup, {"mlp": 1, "base": -1})  # whole generations, the read still held
    assert not held.is_set() and 0 not in runner.lora.slots
    threading.Timer(0.2, held.set).start()
    _generate(runner, lora_setup, {"all": 0, "mlp": 1})  # the first step on slot 0 waits for its load
    replies = settle(runner)
    assert [(type(r).__name__, r.slot) for r in replies] == [("AdapterLoadCompleted", 0)]


def test_an_evict_during_a_load_clears_the_slot_and_reports_nothing(lora_setup: LoraSetup, gate: ReadGate) -> None:
    runner = _runner(lora_setup)
    head, attn = lora_setup.adapter_dirs["head"], lora_setup.adapter_dirs["attn"]
    gate.hold(head)
    _assign(runner, 2, 5, head)
    runner.adapters.evict(AdapterEvicted(2, 5))
    assert runner.lora.digest_table() == []
    _assign(runner, 2, 6, attn)  # the slot is reused while the first read is still held
    assert [(r.slot, r.version_id) for r in poll_until(runner, lambda r: bool(r))] == [(2, 6)]
    gate.release(head)
    assert settle(runner) == []  # the evicted load ends unreported and never writes the slot
    assert runner.lora.slot_table() == [[2, 6]] and runner.lora.digest_table() == [[2, 6, ""]]
    _generate(runner, lora_setup, {"attn": 2})
    runner.adapters.evict(AdapterEvicted(2, 6))
    assert all(not w.ranks[2].any() and not any(w.rank_table[2]) for w in runner.lora.weights.values())
    for version_id in (5, 6):  # both images reached the CPU tier; dropping them frees every page
        runner.adapters.drop_cpu(AdapterCpuEvicted(version_id))
    assert settle(runner) == [] and runner.lora.pool.num_used_pages == 0


def test_a_cpu_evict_during_a_load_waits_for_it(lora_setup: LoraSetup, gate: ReadGate) -> None:
    runner = _runner(lora_setup)
    mlp = lora_setup.adapter_dirs["mlp"]
    gate.hold(mlp)
    _assign(runner, 3, 8, mlp)
    runner.adapters.drop_cpu(AdapterCpuEvicted(8))
    gate.release(mlp)
    done = _for(settle(runner), 3)
    assert [(type(r).__name__, r.source_tier) for r in done] == [("AdapterLoadCompleted", "disk")]
    assert runner.lora.pool.num_used_pages == 0  # the image left once its copy had ended
    _generate(runner, lora_setup, {"mlp": 3})
    runner.adapters.evict(AdapterEvicted(3, 8))
    again = runner.adapters.load(AdapterSlotAssigned(3, 8, mlp))
    assert isinstance(again, AdapterLoadCompleted) and again.source_tier == "disk"  # no longer in the tier


def test_a_version_changed_on_disk_fails_alone(lora_setup: LoraSetup, tmp_path) -> None:
    runner = _runner(lora_setup)
    path = shutil.copytree(lora_setup.adapter_dirs["attn"], tmp_path / "attn-copy")
    registered = _digest(path)
    other = lora_setup.adapter_dirs["mlp"]
    weights = os.path.join(path, WEIGHTS_FILE)
    data = bytearray(open(weights, "rb").read())
    data[-4:] = bytes(4)  # the last value of the last tensor: still a valid, finite file
    with open(weights, "wb") as f:
        f.write(data)
    _assign(runner, 0, 1, str(path), registered)
    _assign(runner, 1, 2, other, _digest(other))
    runner.adapters.command(AdapterPrefetched(3, str(path), content_sha256=registered), time.monotonic())
    replies = settle(runner)
    failed = [r for r in replies if isinstance(r, AdapterLoadFailed)]
    assert sorted(r.slot for r in failed) == [-1, 0]
    assert all(
        r.message.startswith("adapter attn-copy changed on disk since it was registered (content SHA-256")
        for r in failed
    )
    assert [(r.slot, r.version_id) for r in replies if isinstance(r, AdapterLoadCompleted)] == [(1, 2)]
    assert runner.lora.slot_table() == [[1, 2]] and 3 not in runner.lora.loader.cpu.entries
    _assign(runner, 0, 4, str(path), _digest(path))
    assert [type(r).__name__ for r in settle(runner)] == ["AdapterLoadCompleted"]
    assert runner.lora.slot_table() == [[0, 4], [1, 2]]  # its new content, registered again, loads


def _digest(path) -> str:
    with open(os.path.join(path, CONFIG_FILE), "rb") as c, open(os.path.join(path, WEIGHTS_FILE), "rb") as w:
        return content_sha256(c.read(), w.read())


@pytest.mark.parametrize("damage", ["vanished", "truncated", "fifo", "nan"])
def test_a_broken_file_fails_only_its_load(lora_setup: LoraSetup, tmp_path, damage: str) -> None:
    runner = _runner(lora_setup)
    path = str(shutil.copytree(lora_setup.adapter_dirs["mlp"], tmp_path / f"mlp-{damage}"))
    _damage(os.path.join(path, WEIGHTS_FILE), damage)
    _assign(runner, 0, 1, path)
    _assign(runner, 1, 2, lora_setup.adapter_dirs["attn"])
    replies = settle(runner)
    failed = _for(replies, 0)[0]
    assert isinstance(failed, AdapterLoadFailed) and failed.message.startswith(f"adapter mlp-{damage}: ")
    assert {
        "vanished": "No adapter directory",
        "truncated": "truncated",
        "fifo": "not a regular file",
        "nan": "NaN or infinite",
    }[damage] in failed.message
    assert isinstance(_for(replies, 1)[0], AdapterLoadCompleted)
    assert runner.lora.slot_table() == [[1, 2]] and runner.lora.pool.num_used_pages > 0
    runner.adapters.drop_cpu(AdapterCpuEvicted(2))
    assert runner.lora.pool.num_used_pages == 0  # the failed read left nothing behind


def _damage(weights: str, damage: str) -> None:
    if damage == "vanished":
        shutil.rmtree(os.path.dirname(weights))
    elif damage == "truncated":
        os.truncate(weights, os.path.getsize(weights) - 100)
    elif damage == "fifo":
        os.remove(weights)
        os.mkfifo(weights)
    else:  # the last float32 of the data section becomes NaN
        with open(weights, "r+b") as f:
            f.seek(-4, os.SEEK_END)
            f.write(torch.tensor([float("nan")]).numpy().tobytes())


def test_a_hundred_loads_at_once_and_every_page_comes_back(lora_setup: LoraSetup, tmp_path) -> None:
    runner = _runner(lora_setup, max_cpu_loras=128)
    dirs = list(lora_setup.adapter_dirs.values()) + [str(tmp_path / "missing")]
    now = time.monotonic()
    for version_id in range(100):  # versions 0..99 staged into the CPU tier, every fifth one missing
        runner.adapters.command(AdapterPrefetched(version_id, dirs[version_id % 5]), now)
    for slot in range(6):  # and slot loads of fresh versions among them
        _assign(runner, slot, 200 + slot, dirs[slot % 4])
    replies = settle(runner)
    staged = {r.version_id: type(r).__name__ for r in replies if r.slot == -1}
    assert staged == {v: "AdapterLoadFailed" if v % 5 == 4 else "AdapterLoadCompleted" for v in range(100)}
    assert sorted((r.slot, r.version_id) for r in replies if r.slot >= 0) == [(s, 200 + s) for s in range(6)]
    assert all(isinstance(r, AdapterLoadCompleted) for r in replies if r.slot >= 0)
    assert runner.lora.slot_table() == [[s, 200 + s] for s in range(6)]
    _generate(runner, lora_setup, {"head": 0, "attn": 1, "mlp": 2, "all": 3})
    pool = runner.lora.pool
    assert len(pool.blocks) <= pool.max_blocks
    for slot in range(6):
        runner.adapters.evict(AdapterEvicted(slot, 200 + slot))
    for version_id in [*range(100), *range(200, 206)]:
        runner.adapters.drop_cpu(AdapterCpuEvicted(version_id))
    assert settle(runner) == [] and pool.num_used_pages == 0 and not runner.lora.loader.cpu.entries


def test_a_prefetched_version_loads_from_the_cpu_tier(lora_setup: LoraSetup) -> None:
    runner = _runner(lora_setup)
    path = lora_setup.adapter_dirs["head"]
    runner.adapters.command(AdapterPrefetched(9, path), time.monotonic())
    staged = settle(runner)
    assert [(r.slot, r.version_id, r.source_tier) for r in staged] == [(-1, 9, "disk")]
    assert runner.adapters.command(AdapterPrefetched(9, path), time.monotonic()) == []
    assert [(r.slot, r.source_tier) for r in settle(runner)] == [(-1, "cpu")]
    _assign(runner, 4, 9, path)
    done = settle(runner)
    assert [(r.slot, r.source_tier) for r in done] == [(4, "cpu")]
    assert done[0].num_bytes == runner.lora.loader.cpu.entries[9].image.layout.num_bytes
    _generate(runner, lora_setup, {"head": 4, "base": -1})


def test_a_step_on_a_slot_whose_load_failed_fails_that_request_naming_the_adapter(
    lora_setup: LoraSetup, tmp_path
) -> None:
    runner = _runner(lora_setup)
    path = str(tmp_path / "gone-adapter")
    _assign(runner, 0, 1, path)
    prompt = lora_setup.prompts["base"]
    blocks = list(range(-(-len(prompt) // BLOCK_SIZE)))
    reqs = [
        NewReq("on-slot", prompt, len(prompt), GREEDY, blocks, 0, len(prompt), 0),
        NewReq("base", prompt, len(prompt), GREEDY, [b + len(blocks) for b in blocks], 0, len(prompt)),
    ]
    done, _ = runner.execute(StepPlan(0, reqs))
    assert [(f.req_id, f.message.split(":")[0]) for f in done.failed] == [("on-slot", "adapter gone-adapter")]
    assert [t.req_id for t in done.sampled] == ["base"]
    assert [(type(r).__name__, r.slot) for r in settle(runner)] == [("AdapterLoadFailed", 0)]
