"""A step's inputs: built once on the host from the scheduled requests (`host_inputs`), padded for
a CUDA graph (`pad_for_graph`), and put on the device by field name (`build_step_inputs`, or a
graph's static row) as one `StepInputs`, the struct every forward pass reads.

On CUDA every int list goes up in one non-blocking copy out of a reusable pinned buffer
(worker_proc/pinned_staging.py); on the CPU the same struct holds plain CPU tensors. Nothing here waits
on the GPU, except that the pinned buffer is not rewritten before the previous step's copy
out of it finished.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

import torch

from ledgerserve.kernels.lora_types import group_tiles
from ledgerserve.worker_proc.lora.mapping import LoraMapping, runs
from ledgerserve.worker_proc.pinned_staging import PinnedStaging
from ledgerserve.worker_proc.requests import ReqState, StepBatch

if TYPE_CHECKING:
    from ledgerserve.worker_proc.cuda_graphs import DecodeGraph, DecodeGraphs
    from ledgerserve.worker_proc.mixed_graphs import MixedGraphs, MixedStep


@dataclass(frozen=True)
class StepInputs:
    """Everything a forward pass and its logits read, on the model's device."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    kv_slots: torch.Tensor  # [num_tokens] int64 flat KV cache slot of each token
    lora_slots: torch.Tensor  # [num_tokens] int64, -1 = base model
    seq_lens: torch.Tensor  # [num_reqs] int32, cached + new tokens; 0 = padding row
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32 offsets of each request's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with block 0 (never read)
    sample_indices: torch.Tensor  # [num_sampling] int64, the last token of each sampling request
    max_query_len: int
    lora: LoraMapping | None  # of every token; None when no token uses an adapter
    sample_lora: LoraMapping | None  # of the sampled tokens
    attn_tiles: tuple[torch.Tensor, torch.Tensor] | None = None  # mixed-step graphs: the attention's tile table

    @property
    def is_decode(self) -> bool:
        return self.attn_tiles is None and self.max_query_len == 1


@dataclass
class HostInputs:
    """A step's inputs as host int lists, one per staged field (`parts` gives them in order)."""

    input_ids: list[int] = field(default_factory=list)  # a placeholder's is 0, written on the device
    positions: list[int] = field(default_factory=list)
    kv_slots: list[int] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    sample_indices: list[int] = field(default_factory=list)
    seg_starts: list[int] = field(default_factory=list)  # runs of one adapter slot (eager)
    seg_slots: list[int] = field(default_factory=list)
    order: list[int] = field(default_factory=list)  # the grouped LoRA layout (CUDA graphs)
    tile_starts: list[int] = field(default_factory=list)
    tile_slots: list[int] = field(default_factory=list)
    attn_tile_reqs: list[int] = field(default_factory=list)  # the attention's tile table (mixed-step graphs)
    attn_tile_starts: list[int] = field(default_factory=list)
    block_tables: list[int] = field(default_factory=list)  # [num_reqs * width], rows padded with 0
    width: int = 1  # blocks per row of block_tables

    def parts(self) -> list[list[int]]:
        return [getattr(self, f.name) for f in fields(self) if f.name != "width"]

    @property
    def max_query_len(self) -> int:
        return max((b - a for a, b in zip(self.query_start_loc, self.query_start_loc[1:])), default=0)


STAGED = [f.name for f in fields(HostInputs) if f.name != "width"]


def host_inputs(reqs: Sequence[ReqState], block_size: int, width: int = 1) -> HostInputs:
    """One pass over the scheduled requests, in order: every token of theirs this step computes;
    block table rows padded to at least `width` blocks."""
    host = HostInputs()
    for req in reqs:
        start, end = req.num_computed_tokens, req.num_tokens_after_step
        host.input_ids += req.step_input_ids()
        host.positions += range(start, end)
        host.kv_slots += [req.block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
        host.lora_slots += [req.lora_slot] * (end - start)
        host.seq_lens.append(end)
        host.query_start_loc.append(len(host.input_ids))
        if req.samples:
            host.sample_indices.append(len(host.input_ids) - 1)
    host.block_tables, host.width = padded_tables([r.block_ids for r in reqs], width)
    host.seg_starts, host.seg_slots = runs(host.lora_slots)
    return host


def pad_rows(
    host: HostInputs, num_tokens: int, num_reqs: int, scratch_kv_slot: int, num_tiles: int | None
) -> HostInputs:
    """`host` padded to `num_tokens` token rows and `num_reqs` requests: padding tokens read token 0
    at position 0, write their K/V into `scratch_kv_slot`, use no adapter and belong to no request;
    padding requests have no queries and no key (seq_len 0). With `num_tiles` (the LoRA graphs) the
    grouped layout is filled in. Sampled rows and the attention's tiles are left to the caller."""
    pad_tokens, pad_reqs = num_tokens - len(host.input_ids), num_reqs - len(host.seq_lens)
    lora_slots = host.lora_slots + [-1] * pad_tokens
    order, tile_starts, tile_slots = group_tiles(lora_slots, num_tiles) if num_tiles is not None else ([], [], [])
    return HostInputs(
        input_ids=host.input_ids + [0] * pad_tokens,
        positions=host.positions + [0] * pad_tokens,
        kv_slots=host.kv_slots + [scratch_kv_slot] * pad_tokens,
        lora_slots=lora_slots,
        seq_lens=host.seq_lens + [0] * pad_reqs,
        query_start_loc=host.query_start_loc + [host.query_start_loc[-1]] * pad_reqs,
        sample_indices=host.sample_indices,
        order=order,
        tile_starts=tile_starts,
        tile_slots=tile_slots,
        block_tables=host.block_tables + [0] * (pad_reqs * host.width),
        width=host.width,
    )


def pad_for_graph(host: HostInputs, bucket: int, scratch_kv_slot: int, num_tiles: int | None) -> HostInputs:
    """A decode step's inputs (one token per request) padded to `bucket` rows (`pad_rows`), every
    row sampled and every padding row a request of its own."""
    padded = pad_rows(host, bucket, bucket, scratch_kv_slot, num_tiles)
    return replace(padded, query_start_loc=list(range(bucket + 1)), sample_indices=list(range(bucket)))


def build_step_inputs(
    reqs: Sequence[ReqState],
    block_size: int,
    device: torch.device,
    staging: PinnedStaging | None = None,
    prev_token_ids: torch.Tensor | None = None,
) -> StepInputs:
    """The inputs of one eager step over every scheduled token of `reqs`. With `staging` (CUDA) they
    go up in one non-blocking copy and the LoRA mappings come from the host lists, so building them
    never waits on the GPU. Placeholder ids are taken on the device from `prev_token_ids`
    [num_prev_sampling] int64, the previous step's sampled tokens (worker_proc/requests.py)."""
    host = host_inputs(reqs, block_size)
    placeholders = placeholder_pairs(reqs, [end - 1 for end in host.query_start_loc[1:]])
    parts = host.parts() + placeholders
    if staging is not None:
        views = staging.upload(parts)
    else:
        views = [torch.tensor(p, dtype=torch.long, device=device) for p in parts]
    tensors = dict(zip(STAGED, views))
    if placeholders[0]:
        fill_placeholders(tensors["input_ids"], *views[len(STAGED) :], prev_token_ids)
    lora_slots, sample_indices = tensors["lora_slots"], tensors["sample_indices"]
    lora = LoraMapping.from_host(host.lora_slots, lora_slots, (tensors["seg_starts"], tensors["seg_slots"]))
    sample_slots = [host.lora_slots[i] for i in host.sample_indices]
    sample_lora = LoraMapping.from_host(sample_slots, lora_slots[sample_indices]) if lora else None
    return assemble(tensors, host, lora, sample_lora)


def assemble(
    tensors: dict[str, torch.Tensor], host: HostInputs, lora: LoraMapping | None, sample_lora: LoraMapping | None
) -> StepInputs:
    """StepInputs from the device views of `host`'s fields (`tensors`, by field name)."""
    num_reqs = len(host.seq_lens)
    return StepInputs(
        tensors["input_ids"],
        tensors["positions"],
        tensors["kv_slots"],
        tensors["lora_slots"],
        tensors["seq_lens"].int(),
        tensors["query_start_loc"].int(),
        tensors["block_tables"].view(num_reqs, host.width).int(),
        tensors["sample_indices"],
        host.max_query_len,
        lora,
        sample_lora,
        (tensors["attn_tile_reqs"], tensors["attn_tile_starts"]) if host.attn_tile_reqs else None,
    )


@dataclass(frozen=True)
class GraphStep:
    """A pure decode step staged into a CUDA graph's static input row, ready to replay."""

    graph: DecodeGraph
    num_reqs: int


class StepInputBuilder:
    """Builds each step's tensors: into a CUDA graph's static row when `graphs` (a pure decode step)
    or `mixed` (any other step within its buckets) has one that fits the step, else as eager
    StepInputs; None for a step that computes nothing."""

    def __init__(
        self,
        block_size: int,
        device: torch.device,
        staging: PinnedStaging | None,
        graphs: DecodeGraphs | None,
        mixed: MixedGraphs | None = None,
    ) -> None:
        self.block_size, self.device, self.staging, self.graphs, self.mixed = block_size, device, staging, graphs, mixed

    def build(self, batch: StepBatch, prev_token_ids: torch.Tensor | None) -> StepInputs | GraphStep | MixedStep | None:
        """`prev_token_ids` [num_prev_sampling] int64: the previous step's sampled tokens, on the
        device, whose rows the batch's placeholders name."""
        reqs = batch.scheduled
        if not reqs:
            return None
        if self.graphs is not None and self.staging is not None and self.graphs.fits(reqs):
            return self.stage_graph(reqs, prev_token_ids)
        if self.mixed is not None and self.staging is not None and self.mixed.fits(reqs):
            return self.mixed.stage(reqs, self.block_size, self.staging, prev_token_ids)
        return build_step_inputs(reqs, self.block_size, self.device, self.staging, prev_token_ids)

    def stage_graph(self, reqs: Sequence[ReqState], prev_token_ids: torch.Tensor | None = None) -> GraphStep:
        """One device copy of a pure decode step's padded inputs into its graph's static row (the
        graphs must fit `reqs`); placeholder ids are written into the row on the device behind it."""
        graphs, staging = self.graphs, self.staging
        assert graphs is not None and staging is not None, "stage_graph needs CUDA graphs and pinned staging"
        g = graphs.pick(reqs)
        host = pad_for_graph(
            host_inputs(reqs, self.block_size, graphs.width), g.batch, graphs.scratch_kv_slot, g.num_tiles
        )
        placeholders = placeholder_pairs(reqs, range(len(reqs)))
        if placeholders[0]:
            dst, src = staging.upload_into(g.inputs, host.parts(), placeholders)
            fill_placeholders(g.inputs[: g.batch], dst, src, prev_token_ids)  # the row's token ids: [bucket]
        else:
            staging.upload_into(g.inputs, host.parts())
        return GraphStep(g, len(reqs))


def placeholder_pairs(reqs: Sequence[ReqState], last_token_index: Sequence[int]) -> list[list[int]]:
    """[dst, src]: for each request with a placeholder, the index in the flat batch of its one
    scheduled token (`last_token_index` gives each request's last), and its row in the previous
    step's sampled tokens."""
    pairs = [(i, r.placeholder_row) for r, i in zip(reqs, last_token_index) if r.placeholder_row >= 0]
    return [[dst for dst, _ in pairs], [src for _, src in pairs]]


def fill_placeholders(
    input_ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, prev_token_ids: torch.Tensor | None
) -> None:
    """input_ids[dst] = prev_token_ids[src], queued on the device behind the step that sampled them.
    input_ids: [num_tokens] int64; dst, src: [num_placeholders] int64."""
    if prev_token_ids is None:
        raise ValueError("placeholder tokens, but the previous step sampled nothing")
    input_ids.index_copy_(0, dst, prev_token_ids.index_select(0, src))


def padded_tables(tables: list[list[int]], width: int = 1) -> tuple[list[int], int]:
    """Flat [num_reqs * max_blocks] block ids, each row padded with 0 to max_blocks (at least `width`)."""
    width = max([width, *(len(t) for t in tables)])
    return [b for t in tables for b in itertools.chain(t, itertools.repeat(0, width - len(t)))], width
