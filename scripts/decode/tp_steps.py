"""The timed decode steps of bench_decode_tp's ranks, and rank 0's sampled tokens on every rank,
as the engine's scheduler hands them to all ranks in its next plan (every rank samples, only
rank 0 reports). The tokens travel over a CPU (gloo) group of their own: a collective on the
device would queue behind whatever step is in flight there, and with --async-scheduling that is
the step launched after the one read back."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ledgerserve.worker_proc.runner import InFlightStep
from scripts.decode.decode_bench import Bench


def cpu_group(num_ranks: int) -> dist.ProcessGroup | None:
    """A gloo group of every rank (collective: all ranks call it at the same point); None with one rank."""
    return dist.new_group(backend="gloo") if num_ranks > 1 else None


def rank0_tokens(group: dist.ProcessGroup | None, req_ids: list[str], sampled: dict[str, int]) -> dict[str, int]:
    """req_id -> rank 0's token for each of `req_ids` (`sampled`: this rank's read-back, empty off rank 0)."""
    if group is None:
        return sampled
    ids = torch.tensor([sampled.get(r, 0) for r in req_ids], dtype=torch.int64)  # [num_reqs]
    dist.broadcast(ids, src=0, group=group)
    return dict(zip(req_ids, ids.tolist(), strict=True))


class SharingBench(Bench):
    """Bench at TP N. Ahead (--async-scheduling), every read-back is rank 0's tokens on every rank:
    step s + 2's plan is built between the launch of s + 1 and its own, so they are shared there,
    inside the timed period, as the engine's scheduler receives and forwards them. One step at a
    time, the caller shares them after the timed step (`share`)."""

    def __init__(self, group: dist.ProcessGroup | None, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.group = group

    def share(self, sampled: dict[str, int]) -> dict[str, int]:
        """Rank 0's tokens of the live requests (a no-op ahead: the read-back shared them)."""
        return sampled if self.ahead else rank0_tokens(self.group, self.live, sampled)

    def _read(self, in_flight: InFlightStep) -> dict[str, int]:
        sampled = super()._read(in_flight)
        return rank0_tokens(self.group, in_flight.sampling_req_ids, sampled) if self.ahead else sampled


def timed_steps(
    bench: SharingBench, last: dict[str, int], warmup: int, steps: int
) -> tuple[dict[str, int], list[float]]:
    """`warmup` then `steps` decode steps: (the last tokens, every rank's, and the timed steps' wall
    seconds). Ahead, each step launched while the one before runs (Bench.decode_ahead)."""
    if bench.ahead:
        last, walls, _ = bench.decode_ahead(last, warmup + steps + 1)
        return last, walls[warmup:]
    walls = []
    for i in range(warmup + steps):
        sampled, wall = bench.decode(last)
        last = bench.share(sampled)  # after the timed step, as the scheduler's next plan would
        if i >= warmup:
            walls.append(wall)
    return last, walls
