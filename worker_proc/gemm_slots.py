"""How many slots' A each stacked decode GEMM reads, chosen by timing at startup.

A LoRA decode graph of slot bucket n needs x A^T of slots [0, n) only, but the stacked
tensor holds every slot's A under the base weight, so the GEMM may read more rows: the
extra slots' outputs are computed and ignored. cuBLAS picks its kernel from the shape, and a
few more rows can land on a faster one. On an H200 at 32 rows (cuBLAS of torch 2.11), o_proj
with 4 slots' A (4096 + 64 rows) took 13.3 us and with 32 slots' (4096 + 512) 12.2 us; down_proj
34.4 us with 4 slots and 33.1 us with 8; gate_up and qkv were fastest exact. Which count
wins depends on the GPU and the cuBLAS version, so it is measured here, not tabled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from worker_proc.models.layers import SlotLinear

# (GEMM input [num_tokens, in], number of slots to read) -> seconds for one pass over a projection
# class (every layer's, so each weight comes from HBM, not L2)
TimeFn = Callable[[torch.Tensor, int], float]
NUM_REPS = 3  # passes per candidate; the fastest counts


def candidates(num_slots: int, max_loras: int) -> list[int]:
    """num_slots, then doubling, capped at max_loras: 4 of 32 -> [4, 8, 16, 32]."""
    counts = [num_slots]
    while counts[-1] < max_loras:
        counts.append(min(2 * counts[-1], max_loras))
    return counts


def fastest(times: dict[int, float]) -> int:
    """The count with the least time; within 2 % of it, the fewest slots (less to read)."""
    best = min(times.values())
    return min(n for n, t in times.items() if t <= best * 1.02)


def projection_classes(model: torch.nn.Module) -> list[list[SlotLinear]]:
    """The stacked projections grouped by shape (every layer's qkv_proj together, and so on)."""
    classes: dict[tuple, list[SlotLinear]] = {}
    for module in model.modules():
        if isinstance(module, SlotLinear) and module.stacked is not None and module.lora is not None:
            classes.setdefault((tuple(module.stacked[0].shape), tuple(module.lora.a.shape)), []).append(module)
    return list(classes.values())


def cuda_pass_timer(layers: list[SlotLinear]) -> TimeFn:
    """Times one pass of `layers`' stacked GEMMs with CUDA events."""

    def time_pass(x: torch.Tensor, num_read: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for layer in layers:
            layer.stacked_gemm(x, num_read)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return time_pass


def tune(layers: list[SlotLinear], batch_sizes: Iterable[int], slot_counts: Iterable[int],
         time_fn: TimeFn | None = None) -> dict[tuple[int, int], int]:
    """(num_tokens, num_slots) -> slots to read, for one projection class; set on every layer of it."""
    first = layers[0]
    assert first.lora is not None
    max_loras = first.lora.a.shape[0]
    time_fn = time_fn or cuda_pass_timer(layers)
    choice: dict[tuple[int, int], int] = {}
    for num_tokens in batch_sizes:
        x = torch.randn(num_tokens, first.in_features, dtype=first.weight.dtype, device=first.weight.device)
        for num_slots in slot_counts:
            counts = candidates(num_slots, max_loras)
            times = {n: min(time_fn(x, n) for _ in range(NUM_REPS)) for n in counts} if len(counts) > 1 else {num_slots: 0.0}
            choice[(num_tokens, num_slots)] = fastest(times)
    for layer in layers:
        layer.gemm_slots = dict(choice)
    return choice


def tune_model(model: torch.nn.Module, batch_sizes: list[int], slot_counts: list[int]) -> None:
    """tune every stacked projection class of `model` (CUDA) for the decode graphs' buckets."""
    for layers in projection_classes(model):
        tune(layers, batch_sizes, slot_counts)
