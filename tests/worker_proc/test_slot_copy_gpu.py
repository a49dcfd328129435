"""CUDA: adapter copies on the copy stream. A slot is never read while its copy runs (the copy
stream held back with a device-side sleep): a step on another slot runs and is right, a step
on the loading slot waits and is right. The steps on slot 1 run the stacked decode GEMM over
the A rows of slot 0 too, while the copy may be writing them (it waits only for slot 0's last reader):
their outputs still match the reference, as only the rows of the slots a step uses matter.
The staging path gives the bytes the CPU path gives; CUDA graphs captured at start-up serve
adapters loaded (and replaced) after the capture."""

from __future__ import annotations

import time

import pytest
import torch

from ledgerserve.shared.events import AdapterEvicted, AdapterLoadCompleted, AdapterSlotAssigned
from ledgerserve.worker_proc.lora.slot_copy import SlotCopier
from ledgerserve.worker_proc.runner import ModelRunner
from ledgerserve.worker_proc.step_inputs import build_step_inputs
from tests.reference import assert_greedy_matches
from tests.worker_proc.fake_scheduler import FakeScheduler, run_to_completion
from tests.worker_proc.load_gate import settle
from tests.worker_proc.lora_setup import BLOCK_SIZE, GREEDY, NUM_BLOCKS, LoraSetup, lora_config
from tests.worker_proc.test_cuda_graphs import _decode_reqs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SLEEP_CYCLES = 2_000_000_000  # about a second of the copy stream doing nothing


def _generate(runner: ModelRunner, setup: LoraSetup, slots: dict[str, int]) -> None:
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    for name, slot in slots.items():
        sched.add(name, setup.prompts[name], GREEDY, chunk=8, lora_slot=slot)
    done = run_to_completion(runner, sched)
    print(assert_greedy_matches({n: r.outputs for n, r in done.items()}, {n: setup.refs[n] for n in slots}))


def test_a_slot_is_never_read_while_its_copy_runs(lora_setup: LoraSetup, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir, device="cuda", lora_overlap_loading=True))
    assert isinstance(
        runner.adapters.load(AdapterSlotAssigned(1, 2, lora_setup.adapter_dirs["mlp"])), AdapterLoadCompleted
    )
    real = SlotCopier._copy
    monkeypatch.setattr(SlotCopier, "_copy", lambda self, *a: (torch.cuda._sleep(SLEEP_CYCLES), real(self, *a)))
    runner.adapters.command(AdapterSlotAssigned(0, 1, lora_setup.adapter_dirs["all"]), time.monotonic())
    while 0 not in runner.lora.slots:  # the copy gets queued behind the sleep
        runner.adapters.poll()
    event = runner.lora.events[0]
    pending_at_start = not event.query()
    assert runner.lora.fences.pending(0) is None  # no step read slot 0: its copy waited for none
    _generate(runner, lora_setup, {"mlp": 1, "base": -1})  # never waits for slot 0
    print(f"slot 0's copy pending when the steps on slot 1 began: {pending_at_start}; after: {not event.query()}")
    runner.adapters.evict(AdapterEvicted(0, 1))
    runner.adapters.command(AdapterSlotAssigned(0, 3, lora_setup.adapter_dirs["all"]), time.monotonic())
    _generate(runner, lora_setup, {"all": 0, "mlp": 1})  # the first step on slot 0 waits for its copy
    assert [(type(r).__name__, r.slot, r.version_id) for r in settle(runner)] == [("AdapterLoadCompleted", 0, 3)]


def test_the_staging_path_gives_the_cpu_path_bytes(lora_setup: LoraSetup, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = ModelRunner(lora_config(lora_setup.base_dir, device="cuda", dtype="bfloat16"))
    cpu = ModelRunner(lora_config(lora_setup.base_dir, dtype="bfloat16"))
    calls = []
    real = SlotCopier._copy
    monkeypatch.setattr(
        SlotCopier, "_copy", lambda self, image, *a: (calls.append(len(image.extents)), real(self, image, *a))[1]
    )
    for slot, name in enumerate(["all", "head", "attn"]):
        for runner in (gpu, cpu):
            runner.adapters.load(AdapterSlotAssigned(slot, slot, lora_setup.adapter_dirs[name]))
    assert len(calls) == 6 and max(calls) <= 2  # a handful of host -> device copies per load
    for name, w in gpu.lora.weights.items():
        c = cpu.lora.weights[name]
        for gt, ct in ((w.a, c.a), (w.b, c.b), (w.ranks, c.ranks), (w.scalings, c.scalings)):
            assert torch.equal(gt[:3].cpu(), ct[:3]), name
    assert all(block.is_pinned() for block in gpu.lora.pool.blocks)


def test_graphs_serve_adapters_loaded_after_capture(lora_setup: LoraSetup) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir, device="cuda", dtype="bfloat16"))
    assert runner.graphs is not None
    for round_, names in enumerate((["all", "mlp", "head"], ["attn", "all", "mlp"])):  # the second replaces them
        for slot, name in enumerate(names):
            if round_:
                runner.adapters.evict(AdapterEvicted(slot, 10 * (round_ - 1) + slot))
            runner.adapters.load(AdapterSlotAssigned(slot, 10 * round_ + slot, lora_setup.adapter_dirs[name]))
        reqs = _decode_reqs(lora_setup, [0, -1, 1, 2])
        inputs = build_step_inputs(reqs, BLOCK_SIZE, runner.device, runner.staging)
        hidden = runner.model(inputs, runner.kv_cache.layers)
        eager = runner.model.compute_logits(hidden[inputs.sample_indices], inputs.sample_lora)
        graph = runner.graphs.replay(runner.inputs.stage_graph(reqs)).clone()
        err = float((graph - eager).norm() / eager.norm())
        assert err < 1e-2, (round_, err)
