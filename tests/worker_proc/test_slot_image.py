"""Slot images round-trip: an adapter moved disk -> CPU image -> slot leaves every module's
A, B, ranks, scalings and host tables exactly as the pre-image path (safetensors' reader, one
copy per tensor) does, whatever the rank, targets, patterns, file dtype or model dtype, and
whatever the slot held before. Also the pool's page accounting and straddling pieces."""

from __future__ import annotations

import json
import os

import pytest
import torch

from safetensors.torch import load_file, save_file

from shared.adapter_format import WEIGHTS_FILE, BaseShapes, read_manifest
from shared.events import (
    AdapterCpuEvicted, AdapterEvicted, AdapterLoadCompleted, AdapterLoadFailed, AdapterSlotAssigned,
)
from tests.worker_proc.lora_files import reference_load, write_adapter
from tests.worker_proc.lora_setup import ALL_SEVEN, LoraSetup, lora_config
from worker_proc.lora.pinned_pool import PinnedPool, PoolFull
from worker_proc.runner import ModelRunner

MAX_RANK = 64
CASES = {  # name -> write_adapter keyword arguments
    "r4-all-head-f32": dict(r=4, targets=ALL_SEVEN + ["lm_head"]),
    "r16-all-head-bf16": dict(r=16, targets=ALL_SEVEN + ["lm_head"], dtype=torch.bfloat16),
    "r64-all-head-f32": dict(r=64, targets=ALL_SEVEN + ["lm_head"], alpha=8.0),
    "r32-patterns-bf16": dict(r=32, targets=ALL_SEVEN, dtype=torch.bfloat16, use_rslora=True,
                              rank_pattern={"k_proj": 4, "layers.1.mlp.up_proj": 12},
                              alpha_pattern={"down_proj": 3.0, "v_proj": 5.0}),
    "r8-attn-f16": dict(r=8, targets=["q_proj", "v_proj", "o_proj"], dtype=torch.float16),
}


def _base(setup: LoraSetup) -> BaseShapes:
    with open(os.path.join(setup.base_dir, "config.json"), encoding="utf-8") as f:
        return BaseShapes.from_hf_config(json.load(f))


def _assert_slot_equal(new: ModelRunner, ref: ModelRunner, slot: int) -> None:
    for name, w in new.lora.weights.items():
        r = ref.lora.weights[name]
        assert torch.equal(w.a[slot], r.a[slot]), name
        assert torch.equal(w.b[slot], r.b[slot]), name
        assert torch.equal(w.ranks[slot], r.ranks[slot]) and torch.equal(w.scalings[slot], r.scalings[slot]), name
        assert w.rank_table[slot] == r.rank_table[slot] and w.scale_table[slot] == r.scale_table[slot], name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_slot_image_matches_the_reference_path(lora_setup: LoraSetup, tmp_path, dtype: str) -> None:
    base = _base(lora_setup)
    config = lora_config(lora_setup.base_dir, max_lora_rank=MAX_RANK, dtype=dtype)
    new, ref = ModelRunner(config), ModelRunner(config)
    full = write_adapter(str(tmp_path / "full"), base, r=MAX_RANK, targets=ALL_SEVEN + ["lm_head"], seed=99)
    for i, (name, kw) in enumerate(CASES.items()):
        path = write_adapter(str(tmp_path / name), base, seed=i, **kw)
        slot = i % config.max_loras
        # the slot first holds a full-rank adapter everywhere: every stale row must be cleared
        assert isinstance(new.load_adapter(AdapterSlotAssigned(slot, 1000 + i, full)), AdapterLoadCompleted)
        new.evict_adapter(AdapterEvicted(slot, 1000 + i))
        done = new.load_adapter(AdapterSlotAssigned(slot, i, path))
        assert isinstance(done, AdapterLoadCompleted) and done.source_tier == "disk", done
        assert done.num_bytes == sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        reference_load(ref.lora, slot, path, base, MAX_RANK, new.dtype)
        _assert_slot_equal(new, ref, slot)
    assert new.lora.slot_table() == [[i, i] for i in range(len(CASES))]


def test_pieces_straddling_extents_are_split(lora_setup: LoraSetup, tmp_path) -> None:
    """A fragmented pool hands an image several extents: pieces across their seams still land."""
    base = _base(lora_setup)
    config = lora_config(lora_setup.base_dir, max_lora_rank=MAX_RANK)
    new, ref = ModelRunner(config), ModelRunner(config)
    pool = new.lora.pool
    path = write_adapter(str(tmp_path / "a"), base, r=48, targets=ALL_SEVEN + ["lm_head"], seed=5)
    image_bytes = new.lora.layout.plan(read_manifest(path, base, MAX_RANK), new.dtype).num_bytes
    assert image_bytes > pool.page_bytes
    pool.max_blocks = 1  # one block, every other page of it free
    hold = [pool.alloc(pool.page_bytes) for _ in range(pool.pages_per_block)]
    for extents in hold[::2]:
        pool.free(extents)
    assert isinstance(new.load_adapter(AdapterSlotAssigned(2, 7, path)), AdapterLoadCompleted)
    assert len(new.lora.loader.cpu.entries[7].image.extents) == -(-image_bytes // pool.page_bytes)
    reference_load(ref.lora, 2, path, base, MAX_RANK, new.dtype)
    _assert_slot_equal(new, ref, 2)
    for extents in hold[1::2]:
        pool.free(extents)
    new.drop_cpu_copy(AdapterCpuEvicted(7))
    assert pool.num_used_pages == 0


def test_pool_pages_are_accounted_and_bounded() -> None:
    pool = PinnedPool(max_bytes=10 * 4096, page_bytes=4096, pin=False, block_bytes=4 * 4096)
    a = pool.alloc(3 * 4096)
    b = pool.alloc(4096 + 1)  # two pages
    assert pool.num_used_pages == 5 and len(pool.blocks) == 2
    with pytest.raises(PoolFull):
        pool.alloc(8 * 4096)
    assert pool.num_used_pages == 5  # a refused allocation takes nothing
    pool.free(a)
    c = pool.alloc(7 * 4096)  # whatever is free, in runs, plus the last block
    assert sum(e.num_pages for e in c) == 7 and len(pool.blocks) == 3 and pool.max_blocks == 3
    pool.free(b)
    pool.free(c)
    assert pool.num_used_pages == 0
    with pytest.raises(RuntimeError, match="already free"):
        pool.free(c)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_values_not_finite_in_the_model_dtype_are_refused(lora_setup: LoraSetup, tmp_path, dtype: str) -> None:
    """A float32 value past float16's range becomes infinite there: refused like a NaN is."""
    base = _base(lora_setup)
    runner = ModelRunner(lora_config(lora_setup.base_dir, dtype=dtype))
    path = write_adapter(str(tmp_path / "big"), base, r=4, targets=["q_proj", "down_proj"], seed=1)
    weights = os.path.join(path, WEIGHTS_FILE)
    tensors = load_file(weights)
    key = sorted(tensors)[-1]
    tensors[key][0, 0] = 1e6 if dtype == "float16" else float("nan")
    save_file(tensors, weights)
    failed = runner.load_adapter(AdapterSlotAssigned(0, 1, path))
    assert isinstance(failed, AdapterLoadFailed) and "NaN or infinite" in failed.message, failed
    fine = write_adapter(str(tmp_path / "fine"), base, r=4, targets=["q_proj", "down_proj"], seed=2)
    assert isinstance(runner.load_adapter(AdapterSlotAssigned(0, 2, fine)), AdapterLoadCompleted)
    assert runner.lora.slot_table() == [[0, 2]]
