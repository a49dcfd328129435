"""The worker's LoRA state: stacked buffers hung on every SlotLinear, the slot table
(slot -> version_id) and the CPU tier behind it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from shared.adapter_format import BaseShapes
from shared.config import EngineConfig
from worker_proc.lora.cpu_tier import CpuAdapter, CpuTier
from worker_proc.lora.weights import LoraWeights, SliceWeights
from worker_proc.models.layers import SlotLinear

# PEFT module kind -> (our module path under a decoder layer, slice of that fused module)
_SLICES = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
    "lm_head": ("lm_head", 0),
}


class LoraManager:
    def __init__(self, model: nn.Module, config: EngineConfig, base: BaseShapes,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.max_loras = config.max_loras
        self.weights: dict[str, LoraWeights] = {}  # module path -> its slot buffers
        for name, module in model.named_modules():
            if isinstance(module, SlotLinear):  # lm_head unstacked: it may share the embedding table
                self.weights[name] = module.attach_lora(config.max_loras, config.max_lora_rank, name != "lm_head")
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the unstacked weights just freed
        self.cpu = CpuTier(base, config.max_lora_rank, config.lora_allowed_dirs, dtype, pin_memory=device.type == "cuda")
        self.slots: dict[int, int] = {}  # slot -> version_id

    def load(self, slot: int, version_id: int, path: str) -> None:
        """Load `version_id` into `slot` (from the CPU tier, or disk first). On any error the
        slot is left empty and the error propagates (AdapterError / ValueError)."""
        self.check_slot(slot)
        self.clear(slot)
        adapter = self.cpu.get_or_load(version_id, path)
        per_module = self._slices(adapter)
        for name, weights in self.weights.items():
            weights.load_slot(slot, per_module.get(name, [None] * len(weights.output_sizes)))
        self.slots[slot] = version_id

    def evict(self, slot: int, version_id: int) -> None:
        """Free `slot` if it holds `version_id` (a stale evict never wipes a newer version)."""
        if self.slots.get(slot) == version_id:
            self.clear(slot)

    def clear(self, slot: int) -> None:
        for weights in self.weights.values():
            weights.clear_slot(slot)
        self.slots.pop(slot, None)

    @contextlib.contextmanager
    def zero_adapter(self, slot: int) -> Iterator[None]:
        """Within: `slot` (empty) holds an adapter of full rank on every slice whose weights are all
        zero, so the LoRA kernels run (an empty slot skips them) and change nothing. The start-up
        warm-up compiles them this way. Empty again after."""
        self.check_slot(slot)
        if slot in self.slots:
            raise ValueError(f"slot {slot} holds version {self.slots[slot]}")
        for weights in self.weights.values():
            rank, num_in = weights.max_rank, weights.a.shape[3]
            zeros = [(weights.a.new_zeros(rank, num_in), weights.b.new_zeros(size, rank), 0.0)
                     for size in weights.output_sizes]
            weights.load_slot(slot, zeros)
        try:
            yield
        finally:
            self.clear(slot)

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is outside [0, {self.max_loras})")

    def slot_table(self) -> list[list[int]]:
        """[[slot, version_id], ...] sorted by slot."""
        return [[slot, self.slots[slot]] for slot in sorted(self.slots)]

    def _slices(self, adapter: CpuAdapter) -> dict[str, list[SliceWeights | None]]:
        """Module path -> per-slice weights of this adapter, every slice checked against the buffers."""
        per_module: dict[str, list[SliceWeights | None]] = {}
        for (layer, kind), weights in sorted(adapter.tensors.items()):
            suffix, s = _SLICES[kind]
            name = suffix if kind == "lm_head" else f"model.layers.{layer}.{suffix}"
            buffers = self.weights.get(name)
            if buffers is None:
                raise ValueError(f"the model has no module {name} for this adapter")
            buffers.check_slice(s, weights)
            per_module.setdefault(name, [None] * len(buffers.output_sizes))[s] = weights
        return per_module
