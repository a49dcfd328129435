"""CUDA graphs for the steps that are not pure decode: prompt chunks, alone or beside decodes, one
graph per token bucket, in the slot sets of the decode graphs (worker_proc/cuda_graphs.py).

An eager step of a Llama-8B-sized model launches some 400 kernels; on a slow host that costs
five times the GPU time of a 256-token prefill. A mixed graph replays them as one launch.

Each graph reads one static int64 row of the fields of step_inputs.HostInputs, padded to its
bucket (`pad_for_mixed`): `num_tokens` token rows (padding tokens sit outside every request,
write their K/V into the scratch block and use no adapter) and `num_reqs` requests (padding
requests have no queries and seq_len 0). Attention runs on the tile table of
kernels/attention_tiles.py, so its grid is the bucket's, whatever the mix (a decode row takes a
tile per kv head, its GQA group's heads packed in it: running decodes apart, through the decode
kernel over every request of the bucket, measured slower on an H200 for 256-token prompts beside
16 decodes, 14.6 ms against 10.9); LoRA runs on the grouped layout, as in the decode graphs. The graph's output
is the final hidden states; the logits of the sampled rows (and any prompt logprobs) are
computed after it, eagerly, as for an eager step, so no bucket holds a vocabulary-wide buffer.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ledgerserve.kernels.attention_tiles import attention_tiles, max_attention_tiles
from ledgerserve.kernels.lora_types import Tiles, max_tiles
from ledgerserve.worker_proc.cuda_graphs import capture
from ledgerserve.worker_proc.lora.mapping import LoraMapping
from ledgerserve.worker_proc.pinned_staging import PinnedStaging
from ledgerserve.worker_proc.requests import ReqState
from ledgerserve.worker_proc.step_inputs import (
    STAGED,
    HostInputs,
    StepInputs,
    assemble,
    fill_placeholders,
    host_inputs,
    pad_rows,
    placeholder_pairs,
)

# tokens per step that get a graph; a larger step (compute-bound) runs eagerly
TOKEN_BUCKETS = (64, 128, 256, 512, 768, 1024, 1536, 2048)


@dataclass(frozen=True)
class Bucket:
    num_tokens: int
    num_reqs: int  # min(num_tokens, max_num_seqs): every request of a step has a token
    num_slots: int  # the slot set: 0 without LoRA, else the stacked GEMM reads the A of slots [0, num_slots)
    attn_group: int  # query heads per kv head: the attention tile table packs them (kernels/attention_tiles.py)

    @property
    def num_lora_tiles(self) -> int | None:
        return max_tiles(self.num_tokens, self.num_slots) if self.num_slots else None


def pad_for_mixed(host: HostInputs, bucket: Bucket, scratch_kv_slot: int) -> HostInputs:
    """A step's inputs padded to the bucket's tokens and requests (every field to a fixed length:
    the graph's row), with the attention's tile table and (LoRA sets) the grouped layout. The
    sampled rows' indices are padded with row 0; only the first ones are read (the logits are eager)."""
    padded = pad_rows(host, bucket.num_tokens, bucket.num_reqs, scratch_kv_slot, bucket.num_lora_tiles)
    tile_reqs, tile_firsts = attention_tiles(
        padded.query_start_loc,
        max_attention_tiles(bucket.num_tokens, bucket.num_reqs, bucket.attn_group),
        bucket.attn_group,
    )
    sample_indices = host.sample_indices + [0] * (bucket.num_reqs - len(host.sample_indices))
    return replace(padded, sample_indices=sample_indices, attn_tile_reqs=tile_reqs, attn_tile_starts=tile_firsts)


def bucket_inputs(views: dict[str, torch.Tensor], layout: HostInputs, num_slots: int) -> StepInputs:
    """The StepInputs a mixed graph runs on: views of its row by field name (`views`), laid out as
    `layout` (a pad_for_mixed result); every row of the bucket, sampling left to the caller."""
    lora = None
    if num_slots:
        tiles = Tiles(views["order"], views["tile_starts"], views["tile_slots"])
        lora = LoraMapping.for_graph(views["lora_slots"], tiles, num_slots)
    return assemble(views, layout, lora, None)


class MixedGraph:
    """One captured forward pass over a bucket: static input row in, static hidden states out."""

    def __init__(self, bucket: Bucket, width: int, scratch_kv_slot: int, device: torch.device) -> None:
        self.bucket = bucket
        empty = pad_for_mixed(HostInputs(width=width), bucket, scratch_kv_slot)  # the row's layout at capture
        self.lengths = [len(p) for p in empty.parts()]
        self.inputs = torch.tensor(list(itertools.chain(*empty.parts())), dtype=torch.long, device=device)
        self.views = dict(zip(STAGED, self.inputs.split(self.lengths)))
        self.empty = empty
        self.graph = torch.cuda.CUDAGraph(keep_graph=True)  # edited (pdl.launch_after_block_start), then instantiated
        self.hidden: torch.Tensor | None = None  # [num_tokens, hidden]

    def step_inputs(self) -> StepInputs:
        return bucket_inputs(self.views, self.empty, self.bucket.num_slots)

    def forward(self, model: torch.nn.Module, kv_layers: list) -> torch.Tensor:
        return model(self.step_inputs(), kv_layers)  # [num_tokens, hidden]

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        assert self.hidden is not None
        return self.hidden


@dataclass(frozen=True)
class MixedStep:
    """A step staged into a mixed graph's static row: replay it, then sample `sample_indices`."""

    graph: MixedGraph
    num_tokens: int
    sample_indices: torch.Tensor  # [num_sampling] int64, rows of the graph's hidden states
    sample_lora: LoraMapping | None  # of the sampled rows


class MixedGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_layers: list,
        scratch_kv_slot: int,
        width: int,
        limits: tuple[int, int],  # max_num_batched_tokens, max_num_seqs
        max_loras: int,  # 0: no LoRA
        attn_group: int,  # query heads per kv head
        device: torch.device,
    ) -> None:
        self.model, self.kv_layers, self.scratch_kv_slot, self.width = model, kv_layers, scratch_kv_slot, width
        self.attn_group = attn_group
        max_tokens, max_reqs = limits
        self.token_buckets = [n for n in TOKEN_BUCKETS if n < max_tokens] + [min(max_tokens, TOKEN_BUCKETS[-1])]
        self.max_reqs, self.device = max_reqs, device
        # no LoRA, and every slot: a prompt chunk's GEMMs are compute-bound, so reading the A of
        # slots no token uses costs little, while each set is a capture at start-up per bucket
        self.slot_sets = [0, max_loras] if max_loras else [0]
        self.graphs: dict[tuple[int, int], MixedGraph] = {}  # (num_slots, num_tokens) -> graph
        self.replays = 0

    def capture(self, pool: tuple | None) -> tuple | None:
        """Warm up (Triton compiles) and capture every bucket, largest first, in `pool` (the decode
        graphs'; they never run at once); the pool."""
        for num_slots in self.slot_sets:
            for num_tokens in sorted(self.token_buckets, reverse=True):
                bucket = Bucket(num_tokens, min(num_tokens, self.max_reqs), num_slots, self.attn_group)
                g = MixedGraph(bucket, self.width, self.scratch_kv_slot, self.device)
                g.forward(self.model, self.kv_layers)  # eager warm-up
                g.hidden, pool = capture(g.graph, functools.partial(g.forward, self.model, self.kv_layers), pool)
                self.graphs[num_slots, num_tokens] = g
        torch.cuda.synchronize()
        return pool

    def fits(self, reqs: Sequence[ReqState]) -> bool:
        """A step within the largest bucket (and max_num_seqs) whose block tables fit the graphs' width."""
        num_tokens = sum(r.num_scheduled_tokens for r in reqs)
        within = 0 < num_tokens <= self.token_buckets[-1] and len(reqs) <= self.max_reqs
        return within and all(len(r.block_ids) <= self.width for r in reqs)

    def pick(self, reqs: Sequence[ReqState], num_tokens: int) -> MixedGraph:
        """The smallest token bucket that holds the step, in the LoRA set if a request uses an adapter."""
        bucket = next(n for n in self.token_buckets if n >= num_tokens)
        num_slots = self.slot_sets[-1] if any(r.lora_slot >= 0 for r in reqs) else 0
        return self.graphs[num_slots, bucket]

    def stage(
        self, reqs: Sequence[ReqState], block_size: int, staging: PinnedStaging, prev_token_ids: torch.Tensor | None
    ) -> MixedStep:
        """One device copy of a fitting step's padded inputs into its graph's static row; placeholder
        ids are written into the row on the device behind it."""
        host = host_inputs(reqs, block_size, self.width)
        g = self.pick(reqs, len(host.input_ids))
        padded = pad_for_mixed(host, g.bucket, self.scratch_kv_slot)
        placeholders = placeholder_pairs(reqs, [end - 1 for end in host.query_start_loc[1:]])
        if placeholders[0]:
            dst, src = staging.upload_into(g.inputs, padded.parts(), placeholders)
            fill_placeholders(g.views["input_ids"], dst, src, prev_token_ids)
        else:
            staging.upload_into(g.inputs, padded.parts())
        sample_indices = g.views["sample_indices"][: len(host.sample_indices)]
        sample_slots = [host.lora_slots[i] for i in host.sample_indices]
        sample_lora = LoraMapping.from_host(sample_slots, g.views["lora_slots"][sample_indices])
        return MixedStep(g, len(host.input_ids), sample_indices, sample_lora)

    def replay(self, step: MixedStep) -> torch.Tensor:
        """The final hidden states [step.num_tokens, hidden] of a staged step: the graph's static
        buffer, which the next replay overwrites, so they are read on this stream before it."""
        self.replays += 1
        return step.graph.replay()[: step.num_tokens]
