"""Tensor parallelism's process group: one torch.distributed group over the worker ranks, NCCL on
CUDA and gloo on the CPU. The ranks meet through a FileStore in the run's private directory (no
port to pick or leak); the transports bind to loopback (the launcher sets GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME for the workers). With one rank there is no group and every collective is the
identity, so the single-GPU path runs no torch.distributed code at all.

A collective that fails raises CollectiveFailed, saying whether it timed out (a rank stalled:
gloo raises once `timeout_s` passed) or lost a peer (a rank died). Nothing here waits on the
device: on CUDA the collectives are queued on the current stream and can be captured in a CUDA
graph. A stalled NCCL collective never raises here: NCCL's watchdog aborts the waiting rank's
process after `timeout_s` where it sees the collective, and the worker fails a step still running
`timeout_s` after its launch (worker_proc/main.py), which covers collectives replayed in a graph."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

RENDEZVOUS_FILE = "tp-rendezvous"


class CollectiveFailed(RuntimeError):
    """A collective of the group failed: it timed out waiting for a rank, or a rank is gone."""

    def __init__(self, name: str, timeout_s: float, cause: Exception) -> None:
        text = str(cause)
        self.timed_out = "timed out" in text.lower()  # gloo's words when timeout_s passed
        if self.timed_out:
            what = f"timed out after {timeout_s:g} s waiting for another rank (a rank stalled)"
        else:
            what = f"failed (a rank is gone?): {text.splitlines()[0] if text else type(cause).__name__}"
        super().__init__(f"tensor-parallel collective {name} {what}")


@dataclass(frozen=True)
class TpGroup:
    """This rank's place in the group: which shard it holds of every sharded weight."""

    rank: int = 0
    size: int = 1
    timeout_s: float = 0.0  # how long a collective waits for the other ranks (what init_group was given)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in place (x must be contiguous); x itself with one rank."""
        if self.size > 1:
            try:
                dist.all_reduce(x)
            except RuntimeError as e:
                raise CollectiveFailed("all_reduce", self.timeout_s, e) from e
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n]: the ranks' x side by side along the last dim."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        try:
            dist.all_gather(parts, x.contiguous())
        except RuntimeError as e:
            raise CollectiveFailed("all_gather", self.timeout_s, e) from e
        return torch.cat(parts, dim=-1)


def rank_device(device: str, rank: int) -> torch.device:
    """The device of `rank`: its own GPU on CUDA (cuda:rank), else the CPU."""
    return torch.device(f"cuda:{rank}" if device == "cuda" else "cpu")


def use_rank_device(device: str, rank: int) -> torch.device:
    """rank_device, made the calling thread's current CUDA device, so the kernels it launches
    (Triton's included) run on the rank's own GPU."""
    own = rank_device(device, rank)
    if own.type == "cuda":
        torch.cuda.set_device(own)
    return own


def init_group(rank: int, size: int, run_dir: str, device: torch.device, timeout_s: float) -> TpGroup:
    """Join the group of `size` ranks (blocks until all have joined, at most `timeout_s`); a
    collective that waits longer than `timeout_s` for a stalled rank raises."""
    if size == 1:
        return TpGroup()
    store = dist.FileStore(os.path.join(run_dir, RENDEZVOUS_FILE), size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return TpGroup(rank, size, timeout_s)


def close_group(group: TpGroup) -> None:
    if group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
