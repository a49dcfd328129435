"""What bench_decode measures beside each step's time: the share of the timed span the GPU
ran no step (StepClock's events around each step's launch, read by idle_share), and adapter
loads kept running in spare slots the whole time (LoadChurn), as the worker's loop runs them."""

from __future__ import annotations

import time

import torch

from ledgerserve.shared.events import AdapterCpuEvicted, AdapterEvicted, AdapterSlotAssigned
from ledgerserve.worker_proc.runner import ModelRunner
from scripts.common.bench_fixtures import adapter_digest


def idle_share(spans: list[tuple[float, float]]) -> float:
    """The share of [first start, last end] in which the GPU ran no step: spans are each step's
    (start, end) on the device's clock (ms), in launch order. A step's start event is queued before
    its first copy, so it fires when the GPU reaches it: the later of the end of the step before
    and the moment the host queued it; the gap between them is time the GPU waited on the host."""
    if len(spans) < 2:
        return 0.0
    gaps = sum(max(0.0, start - prev_end) for (_, prev_end), (start, _) in zip(spans, spans[1:]))
    return gaps / (spans[-1][1] - spans[0][0])


class StepClock:
    """CUDA events around each step's launch: the spans idle_share reads, once the steps are done."""

    def __init__(self) -> None:
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def begin(self) -> None:
        self.events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        self.events[-1][0].record()

    def end(self) -> None:
        self.events[-1][1].record()

    def idle_share(self, first: int) -> float:
        """Over the steps from index `first` on (all of them read back by now)."""
        origin = self.events[first][0]
        return idle_share([(origin.elapsed_time(a), origin.elapsed_time(b)) for a, b in self.events[first:]])


class LoadChurn:
    """Keeps slots [first_slot, first_slot + num_slots) loading adapters while steps run, as the
    worker's loop does: between steps it sends the replies of loads that ended and starts the
    next. Every other load takes a version the CPU tier still holds; the others take a new
    version (a new id: read from disk again). Each carries its files' content digest, as the
    server's loads do (the read is checked against it)."""

    def __init__(self, runner: ModelRunner, first_slot: int, num_slots: int, paths: list[str]) -> None:
        self.runner, self.paths = runner, paths
        self.digests = {path: adapter_digest(path) for path in paths}
        self.slots = list(range(first_slot, first_slot + num_slots))
        self.held: dict[int, int] = {}  # slot -> version loading or loaded there
        self.num_versions = 10_000  # above the ids the sweep's own adapters use
        self.num_loads = 0
        self.sources: dict[str, int] = {}

    def start(self) -> None:
        self.num_loads, self.sources = 0, {}
        for slot in self.slots:
            self._load(slot, reuse=False)

    def pump(self) -> None:
        """Replies of loads that ended: each slot starts its next load at once."""
        for reply in self.runner.adapters.poll():
            if reply.slot not in self.held or self.held[reply.slot] != reply.version_id:
                continue
            self.num_loads += 1
            source = getattr(reply, "source_tier", "failed") or "failed"
            self.sources[source] = self.sources.get(source, 0) + 1
            self._load(reply.slot, reuse=self.num_loads % 2 == 0)

    def stop(self) -> None:
        for slot, version in sorted(self.held.items()):
            self.runner.adapters.command(AdapterEvicted(slot, version), time.monotonic())
        self.held = {}

    def _load(self, slot: int, reuse: bool) -> None:
        old = self.held.get(slot)
        if old is not None:
            self.runner.adapters.command(AdapterEvicted(slot, old), time.monotonic())
        if old is not None and not reuse:
            self.runner.adapters.command(AdapterCpuEvicted(old), time.monotonic())
        version = old if reuse and old is not None else self._new_version()
        path = self.paths[version % len(self.paths)]
        self.held[slot] = version
        self.runner.adapters.command(
            AdapterSlotAssigned(slot, version, path, content_sha256=self.digests[path]), time.monotonic()
        )

    def _new_version(self) -> int:
        self.num_versions += 1
        return self.num_versions
