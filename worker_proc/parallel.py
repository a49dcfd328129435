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
`timeout_s` after its launch (worker_proc/main.py), which covers collectives replayed in a graph.

On CUDA the small all-reduces of decode (a [batch, hidden] activation, twice a layer) are
latency-bound: NCCL spends more time per call than moving the bytes takes. With_one_shot gives the
group a one-shot all-reduce over CUDA symmetric memory (torch.distributed._symmetric_memory): each
rank copies its input into its own buffer, and after a barrier every rank reads all the ranks'
buffers over NVLink and sums them, in one kernel. It takes every all-reduce of the model's dtype up
to ONE_SHOT_MAX_BYTES; larger ones (prefill) and other dtypes go to NCCL.

Beside it the group maps a second buffer (`peer_buffers`) for the all-reduce of a row-parallel
projection's output, which the residual-add RMSNorm consuming it performs in the same kernel
(kernels/all_reduce_norm.py; LEDGERSERVE_FUSED_ALL_REDUCE_NORM=0 turns that off)."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ledgerserve.kernels import ops
from ledgerserve.kernels.peer_buffers import PeerBuffers
from ledgerserve.shared import env

RENDEZVOUS_FILE = "tp-rendezvous"
# Decode steps and prefill chunks up to 512 tokens of hidden 4096 fit; past some size NCCL's ring
# beats one-shot (each rank reads every peer's whole input). scripts/decode/bench_all_reduce.py times both
# against size: on two H100s one-shot was ahead up to 4 MiB (37 against 40 us) and behind at 8 MiB.
ONE_SHOT_MAX_BYTES = 4 << 20
ONE_SHOT_ALIGN_BYTES = 16  # the input's address must be as aligned as the buffer's for the kernel
# The fused all-reduce + norm's rows: each rank's buffer holds, per part, a row of packets (twice the
# row's bytes) from each rank, for up to this many rows as far as a part of ONE_SHOT_MAX_BYTES holds
# them (120 rows of hidden 4096 at TP 2); more rows take the all-reduce, then the norm.
FUSED_NORM_MAX_ROWS = 256
FUSED_NORM_PARTS = 3  # consecutive calls take different parts: layers alternate two, a step's first the third
log = logging.getLogger(__name__)


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
class OneShotAllReduce:
    """A one-shot all-reduce through a buffer in symmetric memory (see the module's docstring)."""

    buffer: torch.Tensor  # [ONE_SHOT_MAX_BYTES // itemsize] of the model's dtype, mapped by every rank
    group_name: str
    norm: PeerBuffers | None = None  # the fused all-reduce + norm's buffers, where it is on

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.dtype == self.buffer.dtype
            and x.is_contiguous()
            and x.numel() <= self.buffer.numel()
            and x.data_ptr() % ONE_SHOT_ALIGN_BYTES == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks, in a new tensor (x is only read)."""
        out = torch.empty_like(x)
        symm = self.buffer[: x.numel()].view_as(x)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(symm, x, "sum", self.group_name, out)


@dataclass(frozen=True)
class TpGroup:
    """This rank's place in the group: which shard it holds of every sharded weight."""

    rank: int = 0
    size: int = 1
    timeout_s: float = 0.0  # how long a collective waits for the other ranks (what init_group was given)
    one_shot: OneShotAllReduce | None = field(default=None, compare=False)  # see with_one_shot

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (x must be contiguous): x itself, summed in place, or a new
        tensor on the one-shot path; use the returned tensor. x itself with one rank."""
        if self.size == 1:
            return x
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        try:
            dist.all_reduce(x)
        except RuntimeError as e:
            raise CollectiveFailed("all_reduce", self.timeout_s, e) from e
        return x

    def all_reduce_(self, x: torch.Tensor) -> None:
        """The sum of x over the ranks, in x (contiguous)."""
        out = self.all_reduce(x)
        if out is not x:
            x.copy_(out)

    @property
    def peer_buffers(self) -> PeerBuffers | None:
        """The buffers of ops.all_reduce_add_rms_norm; None where it is off (CPU, NCCL only)."""
        return self.one_shot.norm if self.one_shot is not None else None

    def all_gather(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[rows, n] on every rank -> [rows, size * n] in `dtype` (x's by default): the ranks' x side
        by side, gathered into one tensor, then laid out and cast in one copy."""
        if self.size == 1:
            return x if dtype is None else x.to(dtype)
        stacked = torch.empty(self.size * x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)  # [size * rows, n]
        try:
            _all_gather_into(stacked, x.contiguous())
        except RuntimeError as e:
            raise CollectiveFailed("all_gather", self.timeout_s, e) from e
        out = torch.empty(x.shape[0], self.size, x.shape[1], dtype=dtype or x.dtype, device=x.device)  # [rows, size, n]
        out.copy_(stacked.view(self.size, *x.shape).transpose(0, 1))
        return out.view(x.shape[0], -1)


# The ranks' tensors one after another along dim 0 (torch renamed the call; NCCL and gloo take both)
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


def cpu_threads_of_rank(num_cores: int, num_ranks: int) -> int:
    """Intra-op threads of one of `num_ranks` ranks on `num_cores` CPU cores: an even share, at least one."""
    return max(1, num_cores // num_ranks)


def share_cpu_cores(group: TpGroup, device: torch.device) -> int | None:
    """On the CPU with several ranks, make this rank's torch intra-op threads its share of the cores
    the process may run on (unless OMP_NUM_THREADS names them): ranks that each took every core
    would oversubscribe them, their OpenMP threads spinning at a collective while another rank's
    still compute. The threads set, or None where nothing changed (CUDA, one rank, OMP_NUM_THREADS)."""
    if device.type != "cpu" or group.size == 1 or env.omp_threads_given():
        return None
    num_threads = cpu_threads_of_rank(len(os.sched_getaffinity(0)), group.size)
    torch.set_num_threads(num_threads)
    return num_threads


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


def with_one_shot(
    group: TpGroup, dtype: torch.dtype, device: torch.device, enabled: bool = True, max_bytes: int = ONE_SHOT_MAX_BYTES
) -> TpGroup:
    """`group` whose all-reduces of `dtype` up to `max_bytes` run one-shot, and whose norms after a
    row-parallel projection can be that all-reduce too (`enabled`, CUDA, more than one rank, and
    every rank could map the others' buffers); `group` itself otherwise.
    Collective: every rank calls it at the same point, and they agree on the outcome."""
    if not enabled or group.size == 1 or device.type != "cuda":
        return group
    one_shot, error = _map_one_shot_buffer(dtype, device, max_bytes)
    if not _everyone(one_shot is not None, device):
        log.warning("one-shot all-reduce unavailable (%s); every all-reduce goes through NCCL", error or "a peer")
        return group
    assert one_shot is not None
    norm = _fused_norm_buffers(dtype, device, max_bytes) if env.fused_all_reduce_norm_wanted() else None
    return dataclasses.replace(group, one_shot=dataclasses.replace(one_shot, norm=norm))


def _everyone(ok: bool, device: torch.device) -> bool:
    """Whether `ok` holds on every rank (collective)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _map_one_shot_buffer(
    dtype: torch.dtype, device: torch.device, max_bytes: int
) -> tuple[OneShotAllReduce | None, str]:
    """The buffer, mapped by every rank and tried once on a small sum; None and why where it fails."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        group_name = dist.group.WORLD.group_name
        symm_mem.rendezvous(buffer, group_name)
        one_shot = OneShotAllReduce(buffer, group_name)
        probe = one_shot(torch.ones(8, dtype=dtype, device=device))  # [8]
        if not bool((probe == dist.get_world_size()).all()):
            return None, f"a trial sum gave {probe.tolist()}"
        return one_shot, ""
    except Exception as e:  # no peer access, a torch without these ops: NCCL does it all
        return None, f"{type(e).__name__}: {e}"


def _fused_norm_buffers(dtype: torch.dtype, device: torch.device, part_bytes: int) -> PeerBuffers | None:
    """The fused all-reduce + norm's buffers, once every rank mapped them and a trial through every
    part summed right on every rank; None (logged) otherwise. Collective."""
    peers, error = _map_norm_buffers(dtype, device, part_bytes)
    if _everyone(peers is not None, device):
        assert peers is not None
        error = _try_fused_norm(peers, device)
        clear_packets(peers, device)  # the trial's rows are laid out unlike the model's
        if _everyone(not error, device):
            return peers
    log.warning("all-reduce fused into the norm unavailable (%s); it runs as its own kernel", error or "a peer")
    return None


def clear_packets(peers: PeerBuffers, device: torch.device) -> None:
    """Zero this rank's packets and epochs once its calls finished. After calls laid out unlike the
    model's (other hidden size or LoRA rank), every rank clears, then a collective, before any sends."""
    torch.cuda.synchronize(device)
    peers.buffer.zero_()
    peers.epochs.zero_()
    torch.cuda.synchronize(device)


def _map_norm_buffers(dtype: torch.dtype, device: torch.device, part_bytes: int) -> tuple[PeerBuffers | None, str]:
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        part_numel = part_bytes // 8  # int64 packets
        buffer = symm_mem.empty(FUSED_NORM_PARTS * part_numel, dtype=torch.int64, device=device)
        buffer.zero_()  # epoch 0 everywhere: no packet is valid before its first call
        handle = symm_mem.rendezvous(buffer, dist.group.WORLD.group_name)
        torch.cuda.synchronize(device)  # zeroed before any peer's first send (the caller's collective follows)
        peers = PeerBuffers(
            buffer=buffer,
            buffer_ptrs=torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device),
            epochs=torch.zeros(FUSED_NORM_PARTS, FUSED_NORM_MAX_ROWS, dtype=torch.int32, device=device),
            rank=handle.rank,
            world_size=handle.world_size,
            dtype=dtype,
            part_numel=part_numel,
        )
        return peers, ""
    except Exception as e:  # as _map_one_shot_buffer
        return None, f"{type(e).__name__}: {e}"


def _try_fused_norm(peers: PeerBuffers, device: torch.device) -> str:
    """Why a trial of the fused kernel on every rank went wrong here; "" where it summed right."""
    x = torch.ones(2, 64, dtype=peers.dtype, device=device)  # [2, 64]
    weight = torch.ones(64, dtype=peers.dtype, device=device)
    try:
        for part in range(peers.num_parts):
            if not ops.fuses_all_reduce_norm(x, None, peers):
                return "the kernel does not take a trial row"
            _, residual = ops.all_reduce_add_rms_norm(x, torch.zeros_like(x), weight, 1e-6, None, peers, part)
            if not bool((residual == peers.world_size).all()):
                return f"a trial sum gave {residual[0, :4].tolist()}"
        return ""
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def close_group(group: TpGroup) -> None:
    if group.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
