"""The worker's serve loop with overlapped adapter loading: an adapter command neither drains
the step in flight nor holds up the steps after it, the load's reply goes out between steps
as soon as it ends, and the loader threads make progress while the loop spins on a step, or
while a tensor-parallel rank waits for the step it completes behind the next."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from ledgerserve.shared import codec, events
from ledgerserve.worker_proc.loop import WorkerLoop
from ledgerserve.worker_proc.lora import loader
from ledgerserve.worker_proc.main import serve
from ledgerserve.worker_proc.runner import InFlightStep, ModelRunner
from ledgerserve.worker_proc.sampler import HostCopy, PendingSample
from tests.reference import assert_greedy_matches
from tests.worker_proc.fake_scheduler import FakeScheduler
from tests.worker_proc.load_gate import ReadGate
from tests.worker_proc.lora_setup import BLOCK_SIZE, GREEDY, NUM_BLOCKS, LoraSetup, lora_config
from tests.worker_proc.test_serve import AheadScheduler, BusyDevice

LOG = logging.getLogger("test-serve-loads")


class LoadingScheduler(AheadScheduler):
    """One step ahead; once step `assign_after` completed it sends `command`, and once step
    `release_after` completed it releases the held read. Records what the worker sends."""

    def __init__(
        self, sched: FakeScheduler, command: events.Event, assign_after: int, release_after: int, release
    ) -> None:
        super().__init__(sched)
        self.command, self.assign_after, self.release_after, self.release = (
            command,
            assign_after,
            release_after,
            release,
        )
        self.command_due = False
        self.sent: list[events.Event] = []
        self.num_sent_at_command = -1  # how many replies the worker had sent when the command went out

    def poll(self, timeout: int = 0) -> bool:
        return self.command_due or super().poll(timeout)

    def recv(self) -> bytes:
        if self.command_due:
            frame = codec.encode(self.command)
            self.command_due, self.command, self.num_sent_at_command = False, None, len(self.sent)
            return frame
        return super().recv()

    def send(self, frame: bytes) -> None:
        ev = self.decoder.decode(frame)
        self.sent.append(ev)
        if isinstance(ev, events.AdapterLoadCompleted | events.AdapterLoadFailed):
            return
        super().send(frame)
        if isinstance(ev, events.StepCompleted):
            self.command_due = self.command_due or (ev.step == self.assign_after and self.command is not None)
            if ev.step == self.release_after:
                self.release()


def test_a_load_neither_drains_nor_delays_the_steps_and_is_reported_between_them(
    lora_setup: LoraSetup, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = ReadGate()
    monkeypatch.setattr(loader, "read_image", gate)
    path = lora_setup.adapter_dirs["all"]
    gate.hold(path)
    runner = ModelRunner(lora_config(lora_setup.base_dir, lora_overlap_loading=True))
    calls: list[str] = []
    for owner, name in ((runner, "launch"), (runner, "complete"), (runner.adapters, "command")):
        real = getattr(owner, name)
        setattr(owner, name, lambda *a, _real=real, _name=name: (calls.append(_name), _real(*a))[1])
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    for name, chunk in (("base", 4), ("base-twin", 3)):  # base-model requests: no step uses the loading slot
        sched.add(name, lora_setup.prompts["base"], GREEDY, chunk=chunk)
    ahead = LoadingScheduler(
        sched,
        events.AdapterSlotAssigned(0, 1, path),
        assign_after=1,
        release_after=5,
        release=lambda: gate.release(path),
    )
    assert serve(runner, 0, ahead, ahead, LOG, overlap_loading=True) == 0  # type: ignore[arg-type]
    kinds = [type(ev).__name__ for ev in ahead.sent]
    steps = [ev.step for ev in ahead.sent if isinstance(ev, events.StepCompleted)]
    reply = kinds.index("AdapterLoadCompleted")
    num_steps_before = kinds[:reply].count("StepCompleted")
    assert steps.index(5) < num_steps_before < len(steps)  # sent between steps, once released
    assert kinds[ahead.num_sent_at_command : reply].count("StepCompleted") >= 3  # steps ran while it read
    i = calls.index("command")  # a step was in flight, and was not drained for the command
    assert calls[:i].count("launch") == calls[:i].count("complete") + 1 and calls[i + 1] == "launch"
    assert runner.lora.slot_table() == [[0, 1]]
    assert_greedy_matches(
        {n: r.outputs for n, r in sched.done.items()}, {n: lora_setup.refs["base"] for n in ("base", "base-twin")}
    )


class Silent:
    def poll(self, timeout: int = 0) -> bool:
        return False


class Collect:
    def __init__(self) -> None:
        self.sent: list[events.Event] = []
        self.decoder = codec.from_worker_decoder()

    def send(self, frame: bytes) -> None:
        self.sent.append(self.decoder.decode(frame))


class BusyUntil(BusyDevice):
    """A step that runs until `outbox` got a reply (at most `num_queries` queries)."""

    def __init__(self, outbox: Collect, num_queries: int) -> None:
        super().__init__(num_queries)
        self.outbox = outbox

    def query(self) -> bool:
        return bool(self.outbox.sent) or super().query()


def test_loader_threads_progress_while_the_loop_spins_on_a_step(lora_setup: LoraSetup) -> None:
    """The loop spins on the socket and the step's event; the loader threads must still get the
    GIL, or the load would never end while this step runs. Prints the load's time both ways."""
    runner = ModelRunner(lora_config(lora_setup.base_dir, lora_overlap_loading=True, max_lora_rank=32))
    path = lora_setup.adapter_dirs["all"]
    start = time.monotonic()
    runner.adapters.load(events.AdapterSlotAssigned(1, 1, path))
    alone_ms = (time.monotonic() - start) * 1000
    outbox = Collect()
    runner.adapters.command(events.AdapterSlotAssigned(0, 2, path), time.monotonic())
    host = HostCopy((), BusyUntil(outbox, 50_000_000))  # type: ignore[arg-type]
    step = InFlightStep(
        0, [], PendingSample(torch.zeros(1, dtype=torch.long), host, []), [], events.RankDigest(0, 0, 0)
    )
    assert not WorkerLoop(runner, 0, outbox, LOG).wait_for_command(Silent(), step)  # type: ignore[arg-type]
    assert [(type(r).__name__, r.slot) for r in outbox.sent] == [("AdapterLoadCompleted", 0)]
    print(f"load alone {alone_ms:.1f} ms; beside a spinning step {outbox.sent[0].duration_ms:.1f} ms")


class BusyUntilSynced(BusyUntil):
    """BusyUntil whose synchronize spins on it: the read-back of a step that is done returns at once."""

    def synchronize(self) -> None:
        while not self.query():
            pass


def test_a_rank_waiting_out_its_step_lets_loads_end_and_reports_them(lora_setup: LoraSetup) -> None:
    """With tensor parallelism a rank completes step s right after launching s + 1, waiting for the
    device to finish s within the collective timeout: most of every step. Loads must go on meanwhile
    and their replies go out as they end, as in the loop's own spin: here the step runs until the
    load's reply was sent, so waiting without letting the loader threads run or without sending
    replies would read the step back (after 5 M queries) with the load still unreported."""
    runner = ModelRunner(lora_config(lora_setup.base_dir, lora_overlap_loading=True, max_lora_rank=32))
    outbox = Collect()
    runner.adapters.command(events.AdapterSlotAssigned(0, 2, lora_setup.adapter_dirs["all"]), time.monotonic())
    steps = WorkerLoop(runner, 0, outbox, LOG, stall_s=600.0)  # type: ignore[arg-type]
    host = HostCopy((torch.zeros(1, dtype=torch.long),), BusyUntilSynced(outbox, 5_000_000))  # type: ignore[arg-type]
    pending = PendingSample(torch.zeros(1, dtype=torch.long), host, [])
    steps.hold(InFlightStep(7, [], pending, [], events.RankDigest(7, 0, 0)), time.monotonic())
    assert steps.flush()
    sent = [(type(r).__name__, getattr(r, "slot", getattr(r, "step", None))) for r in outbox.sent]
    assert sent == [("AdapterLoadCompleted", 0), ("StepCompleted", 7), ("RankDigest", 7)]
