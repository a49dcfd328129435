"""The CPU tier: adapter versions read from disk once, kept as (pinned) CPU tensors.

Filled by `load`, emptied only by `drop` (the scheduler owns the LRU and tells the worker
which version to drop with AdapterCpuEvicted). Weights come from safetensors by the
manifest's keys; nothing is unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import SafetensorError, safe_open

from shared.adapter_format import WEIGHTS_FILE, AdapterError, AdapterManifest, BaseShapes, read_manifest

ModuleKey = tuple[int, str]  # (layer, kind); layer -1 for lm_head


@dataclass(frozen=True)
class CpuAdapter:
    version_id: int
    manifest: AdapterManifest
    tensors: dict[ModuleKey, tuple[torch.Tensor, torch.Tensor, float]]  # A [rank, in], B [out, rank], scaling

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b, _ in self.tensors.values())


class CpuTier:
    def __init__(self, base: BaseShapes, max_lora_rank: int, allowed_dirs: tuple[str, ...], dtype: torch.dtype,
                 pin_memory: bool) -> None:
        self.base = base
        self.max_lora_rank = max_lora_rank
        self.allowed_dirs = allowed_dirs  # the same containment rule as the HTTP process
        self.dtype = dtype
        self.pin_memory = pin_memory
        self.adapters: dict[int, CpuAdapter] = {}  # version_id -> CPU copy

    def get_or_load(self, version_id: int, path: str) -> CpuAdapter:
        """The CPU copy of `version_id`, read from `path` only if not held yet."""
        adapter = self.adapters.get(version_id)
        if adapter is None:
            adapter = self._read(version_id, path)
            self.adapters[version_id] = adapter
        return adapter

    def drop(self, version_id: int) -> None:
        self.adapters.pop(version_id, None)

    def _read(self, version_id: int, path: str) -> CpuAdapter:
        manifest = read_manifest(path, self.base, self.max_lora_rank, self.allowed_dirs)
        tensors = {}
        try:
            with safe_open(manifest.weights_path, framework="pt", device="cpu") as f:  # the checked file, not a link
                for m in manifest.modules:
                    a, b = self._tensor(f, m.a_key), self._tensor(f, m.b_key)
                    tensors[(m.layer, m.kind)] = (a, b, m.scaling)
        except (OSError, RuntimeError, ValueError, SafetensorError) as e:
            raise AdapterError(f"could not read {WEIGHTS_FILE}: {e}") from None
        return CpuAdapter(version_id, manifest, tensors)

    def _tensor(self, f, key: str) -> torch.Tensor:
        t = f.get_tensor(key).to(self.dtype).contiguous()
        if not torch.isfinite(t).all():
            raise AdapterError(f"tensor {key} holds non-finite values")
        return t.pin_memory() if self.pin_memory else t
