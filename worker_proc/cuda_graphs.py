"""CUDA graphs for decode steps, one per batch-size bucket: a set without LoRA and, when
LoRA is enabled, a set with it. Each graph reads one static int64 input row, the fields of
worker_proc/step_inputs.py's StepInputs (token ids, positions, KV slots, adapter slots,
sequence lengths, block tables, ...) padded to its batch (`pad_for_graph`), that every step
overwrites with a single device copy; adapter slots and block tables being inputs, one
graph serves any mix of adapters and requests. The LoRA set also reads the grouped layout
(kernels/lora_types.py): token rows sorted by slot and a padded table of max_tiles(batch,
max_loras) tiles, built on the host from the plan, so each distinct adapter's A / B are read
once per tile, not once per token. Each projection's single GEMM also returns every slot's
x A^T (A stacked under the base weight, worker_proc/models/layers.py); so that a step on few
adapters does not read the A of every slot, the LoRA graphs come in slot buckets: a graph
of bucket n reads the A of slots [0, n), and a step replays the smallest bucket above its
highest slot (the scheduler fills free slots lowest first). Padding rows use seq_len 0,
slot -1 and write their K/V into a scratch block past the scheduler's blocks.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence

import torch

from ledgerserve.kernels import gemm_tuning, pdl
from ledgerserve.kernels.lora_types import Tiles, max_tiles
from ledgerserve.worker_proc.lora.layout import slot_buckets
from ledgerserve.worker_proc.lora.mapping import LoraMapping
from ledgerserve.worker_proc.requests import ReqState
from ledgerserve.worker_proc.step_inputs import STAGED, GraphStep, HostInputs, StepInputs, assemble, pad_for_graph

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class DecodeGraph:
    """One captured decode step at `batch` rows: static input row in, static logits out."""

    def __init__(
        self, batch: int, width: int, num_tiles: int | None, scratch_kv_slot: int, device: torch.device
    ) -> None:
        self.batch, self.num_tiles = batch, num_tiles  # num_tiles: the LoRA set's grouped layout, else None
        # an empty batch padded: the row's layout, and the values the capture runs on
        self.empty = pad_for_graph(HostInputs(width=width), batch, scratch_kv_slot, num_tiles)
        self.lengths = [len(p) for p in self.empty.parts()]
        self.inputs = torch.tensor(list(itertools.chain(*self.empty.parts())), dtype=torch.long, device=device)
        self.graph = torch.cuda.CUDAGraph(keep_graph=True)  # edited (pdl.launch_after_block_start), then instantiated
        self.logits: torch.Tensor | None = None  # [batch, vocab] float32

    def step_inputs(self, num_slots: int) -> StepInputs:
        """Views of the static row; num_slots: 0 without LoRA, else the graph's slot bucket."""
        views = dict(zip(STAGED, self.inputs.split(self.lengths)))
        lora = None
        if num_slots:
            tiles = Tiles(views["order"], views["tile_starts"], views["tile_slots"])
            lora = LoraMapping.for_graph(views["lora_slots"], tiles, num_slots)
        return assemble(views, self.empty, lora, lora)

    def forward(self, model: torch.nn.Module, kv_layers: list, num_slots: int) -> torch.Tensor:
        inputs = self.step_inputs(num_slots)
        hidden = model(inputs, kv_layers)  # [batch, hidden]: every row samples
        return model.compute_logits(hidden, inputs.lora)  # [batch, vocab] float32


class DecodeGraphs:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_layers: list,
        scratch_kv_slot: int,
        width: int,
        max_batch: int,
        with_lora: bool,
        device: torch.device,
        max_loras: int = 0,
    ) -> None:
        self.model, self.kv_layers, self.scratch_kv_slot, self.width = model, kv_layers, scratch_kv_slot, width
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        self.device, self.max_loras = device, max_loras
        # slot bucket (0: no LoRA) -> batch bucket -> graph
        self.sets: dict[int, dict[int, DecodeGraph]] = {
            n: {} for n in [0] + (slot_buckets(max_loras) if with_lora else [])
        }
        self.pool = None
        self.replays = 0

    def capture(self) -> None:
        """Warm up (Triton compiles) and capture every bucket, largest first, in one memory pool."""
        for num_slots, graphs in self.sets.items():
            for b in sorted(self.buckets, reverse=True):
                num_tiles = max_tiles(b, num_slots) if num_slots else None
                g = DecodeGraph(b, self.width, num_tiles, self.scratch_kv_slot, self.device)
                with gemm_tuning.recording() as gemms:
                    g.forward(self.model, self.kv_layers, num_slots)  # eager warm-up
                _log_tuning(b, num_slots, gemm_tuning.tune(gemms))  # nothing recorded when tuning is off
                g.logits, self.pool = capture(
                    g.graph, functools.partial(g.forward, self.model, self.kv_layers, num_slots), self.pool
                )
                graphs[b] = g
        torch.cuda.synchronize()

    def fits(self, reqs: Sequence[ReqState]) -> bool:
        """A pure decode step (one new token per request, each sampling) within the largest bucket."""
        return 0 < len(reqs) <= self.buckets[-1] and all(
            r.num_scheduled_tokens == 1 and r.samples and len(r.block_ids) <= self.width for r in reqs
        )

    def pick(self, reqs: Sequence[ReqState]) -> DecodeGraph:
        """The graph of a step that fits (`fits`): the smallest batch bucket that holds it, in the set of
        the smallest slot bucket above its highest adapter slot (0: no LoRA)."""
        bucket = next(b for b in self.buckets if b >= len(reqs))
        top_slot = max(r.lora_slot for r in reqs)
        num_slots = next((s for s in self.sets if s > top_slot), 0) if top_slot >= 0 else 0
        return self.sets[num_slots][bucket]

    def replay(self, step: GraphStep) -> torch.Tensor:
        """Logits [step.num_reqs, vocab] float32 of a decode step staged into its graph's static row
        (step_inputs.StepInputBuilder). The logits are the graph's static buffer: the next replay
        overwrites them, so they are read (sampled) on this stream before it."""
        step.graph.graph.replay()
        self.replays += 1
        assert step.graph.logits is not None
        return step.graph.logits[: step.num_reqs]


def capture(graph: torch.cuda.CUDAGraph, forward: Callable[[], torch.Tensor], pool: tuple | None) -> tuple:
    """Capture `forward` (already run once eagerly: Triton compiled) into `graph`, in `pool` (None:
    a new one), with its kernels' PDL edges moved to block start; (its static output, the pool)."""
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    moved = pdl.launch_after_block_start(graph.raw_cuda_graph())
    log.debug("graph captured: %d edges launch at block start", moved)
    graph.instantiate()
    return out, graph.pool()


def _log_tuning(batch: int, num_slots: int, timings: dict) -> None:
    for shape, (torch_us, chosen_us, _) in timings.items():
        log.info(
            "decode GEMM %dx%dx%d (batch %d, %d slots): F.linear %.1f us, chosen %.1f us",
            shape.m,
            shape.n,
            shape.k,
            batch,
            num_slots,
            torch_us,
            chosen_us,
        )
