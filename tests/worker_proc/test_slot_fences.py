"""The copy fencing rule: a write into slot k waits only for the last launched step that reads
k, and only while that step may still run; steps on other slots, or none, never hold it up.
And the runner notes, after launching each step, exactly the slots that step's requests use."""

from __future__ import annotations

from ledgerserve.worker_proc.lora.fences import SlotFences
from ledgerserve.worker_proc.runner import ModelRunner
from tests.worker_proc.fake_scheduler import FakeScheduler
from tests.worker_proc.lora_setup import BLOCK_SIZE, GREEDY, NUM_BLOCKS, LoraSetup, load_all, lora_config


class FakeEvent:
    """Stands in for a CUDA event recorded after one step: done once the test says so."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_write_waits_only_for_the_last_step_that_read_its_slot() -> None:
    fences = SlotFences()
    assert fences.pending(0) is None  # never read: nothing to wait for
    steps = [FakeEvent(i) for i in range(4)]
    fences.read([0, 2], steps[0])
    fences.read([2], steps[1])
    fences.read([], steps[2])  # a base-model step
    fences.read([1], steps[3])
    assert fences.pending(0) is steps[0]
    assert fences.pending(2) is steps[1]  # not the earlier step, nor any later one that skipped it
    assert fences.pending(1) is steps[3]
    assert fences.pending(3) is None
    steps[0].done = True
    assert fences.pending(0) is None  # its reader finished: the copy need not wait
    assert fences.pending(2) is steps[1]
    steps[1].done = True
    assert fences.pending(2) is None and fences.pending(1) is steps[3]


def test_a_finished_reader_is_forgotten_and_a_new_one_takes_its_place() -> None:
    fences = SlotFences()
    first, second = FakeEvent(0), FakeEvent(1)
    fences.read([5], first)
    first.done = True
    assert fences.pending(5) is None and 5 not in fences.last_read
    fences.read([5], second)
    assert fences.pending(5) is second


def test_the_runner_notes_the_slots_each_launched_step_reads(lora_setup: LoraSetup) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir))
    slots = load_all(runner, lora_setup)
    noted: list[list[int]] = []
    real = runner.lora.fences.read
    runner.lora.fences.read = lambda s, event: (noted.append(list(s)), real(s, event))[1]  # type: ignore[method-assign]
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    sched.add("base", lora_setup.prompts["base"], GREEDY, chunk=4)
    completed, _ = runner.execute(sched.plan())  # a base-model step reads no slot
    sched.complete(completed)
    for name in ("mlp", "head"):
        sched.add(name, lora_setup.prompts[name], GREEDY, chunk=4, lora_slot=slots[name])
    runner.execute(sched.plan())
    assert noted == [sorted([slots["mlp"], slots["head"]])]
    assert set(runner.lora.fences.last_read) <= {slots["mlp"], slots["head"]}
