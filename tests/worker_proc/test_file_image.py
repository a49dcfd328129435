"""File images round-trip: an adapter moved disk -> CPU file image -> slot leaves every module's
A, B, ranks, scalings and host tables exactly as the pre-CPU-tier path (safetensors' reader,
one copy per tensor) does, whatever the rank, targets, patterns, file dtype or model dtype,
whatever the slot held before, with PEFT's saved embeddings in the file, through a staging
buffer smaller than the image, and with tensors unaligned in the file. Also the pool's page
accounting and tensors straddling extents."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ledgerserve.shared.adapter_format import WEIGHTS_FILE, BaseShapes, max_tensors, read_manifest
from ledgerserve.shared.events import (
    AdapterCpuEvicted,
    AdapterEvicted,
    AdapterLoadCompleted,
    AdapterLoadFailed,
    AdapterSlotAssigned,
)
from ledgerserve.shared.safetensors_header import read_header
from ledgerserve.worker_proc.lora import slot_copy
from ledgerserve.worker_proc.lora.file_image import FILE_DTYPES, SlotLayout
from ledgerserve.worker_proc.lora.pinned_pool import PinnedPool, PoolFull
from ledgerserve.worker_proc.lora.reader import ReadSpec, read_image
from ledgerserve.worker_proc.lora.slot_copy import SlotCopier, flat_tables, staging_bytes
from ledgerserve.worker_proc.lora.weights import LoraWeights
from ledgerserve.worker_proc.runner import ModelRunner
from tests.worker_proc.lora_files import reference_load, write_adapter, write_raw
from tests.worker_proc.lora_setup import ALL_SEVEN, LoraSetup, lora_config

MAX_RANK = 64
CASES = {  # name -> write_adapter keyword arguments
    "r4-all-head-f32": dict(r=4, targets=ALL_SEVEN + ["lm_head"]),
    "r16-all-head-bf16": dict(r=16, targets=ALL_SEVEN + ["lm_head"], dtype=torch.bfloat16),
    "r64-all-head-f32": dict(r=64, targets=ALL_SEVEN + ["lm_head"], alpha=8.0),
    "r32-patterns-bf16": dict(
        r=32,
        targets=ALL_SEVEN,
        dtype=torch.bfloat16,
        use_rslora=True,
        rank_pattern={"k_proj": 4, "layers.1.mlp.up_proj": 12},
        alpha_pattern={"down_proj": 3.0, "v_proj": 5.0},
    ),
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
def test_file_image_matches_the_reference_path(lora_setup: LoraSetup, tmp_path, dtype: str) -> None:
    base = _base(lora_setup)
    config = lora_config(lora_setup.base_dir, max_lora_rank=MAX_RANK, dtype=dtype)
    new, ref = ModelRunner(config), ModelRunner(config)
    full = write_adapter(str(tmp_path / "full"), base, r=MAX_RANK, targets=ALL_SEVEN + ["lm_head"], seed=99)
    for i, (name, kw) in enumerate(CASES.items()):
        path = write_adapter(str(tmp_path / name), base, seed=i, **kw)
        slot = i % config.max_loras
        # the slot first holds a full-rank adapter everywhere: every stale row must be cleared
        assert isinstance(new.adapters.load(AdapterSlotAssigned(slot, 1000 + i, full)), AdapterLoadCompleted)
        new.adapters.evict(AdapterEvicted(slot, 1000 + i))
        done = new.adapters.load(AdapterSlotAssigned(slot, i, path))
        assert isinstance(done, AdapterLoadCompleted) and done.source_tier == "disk", done
        assert done.num_bytes == sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        reference_load(ref.lora, slot, path, base, MAX_RANK, new.dtype)
        _assert_slot_equal(new, ref, slot)
    assert new.lora.slot_table() == [[i, i] for i in range(len(CASES))]


STREAMED = {  # name -> write_adapter keyword arguments: what the cases above lack
    "r64-all-head-f32-saved": dict(r=64, targets=ALL_SEVEN + ["lm_head"], dtype=torch.float32, saved_embeddings=True),
    "r12-attn-head-f64": dict(r=12, targets=["q_proj", "k_proj", "o_proj", "lm_head"], dtype=torch.float64, alpha=3.0),
    "r16-mlp-head-bf16-saved": dict(
        r=16,
        targets=["gate_proj", "down_proj", "lm_head"],
        dtype=torch.bfloat16,
        saved_embeddings=True,
        rank_pattern={"lm_head": 5},
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_saved_embeddings_f64_files_and_a_staging_buffer_smaller_than_the_image(
    lora_setup: LoraSetup, tmp_path, monkeypatch: pytest.MonkeyPatch, dtype: str
) -> None:
    """The staging buffer at its floor (one F64 tensor): each image streams through it in many
    chunks of whole tensors; the saved embeddings are read, hashed and left out of the image."""
    base = _base(lora_setup)
    config = lora_config(lora_setup.base_dir, max_lora_rank=MAX_RANK, dtype=dtype)
    ref = ModelRunner(config)
    monkeypatch.setattr(slot_copy, "MAX_STAGING_BYTES", 1)
    new = ModelRunner(config)
    staging = new.lora.copier.staging.numel()
    num_chunks = []
    for slot, (name, kw) in enumerate(STREAMED.items()):
        path = write_adapter(str(tmp_path / name), base, seed=10 + slot, **kw)
        layout = _layout(new, path, base)
        chunks = new.lora.copier.scatter(slot, layout).chunks
        assert max(c.stop - c.start for c in chunks) <= staging
        num_chunks.append(len(chunks))
        done = new.adapters.load(AdapterSlotAssigned(slot, slot, path))
        assert isinstance(done, AdapterLoadCompleted), done
        assert done.num_bytes == sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        kept = sum(r.stop - r.start for r in layout.runs)  # the image keeps the adapter's tensors only
        saved = 2 * base.vocab_size * base.hidden_size * kw["dtype"].itemsize if kw.get("saved_embeddings") else 0
        assert kept == layout.runs[-1].stop - saved and len(layout.runs) == (2 if saved else 1)
        reference_load(ref.lora, slot, path, base, MAX_RANK, new.dtype)
        _assert_slot_equal(new, ref, slot)
    assert num_chunks[0] >= 4  # the largest image needs several


def _layout(runner: ModelRunner, path: str, base: BaseShapes):
    fd = os.open(os.path.join(path, WEIGHTS_FILE), os.O_RDONLY)
    try:
        header = read_header(fd, os.fstat(fd).st_size, max_tensors(base))
    finally:
        os.close(fd)
    return runner.lora.layout.plan(read_manifest(path, base, MAX_RANK).modules, header)


def test_pieces_straddling_extents_are_split(lora_setup: LoraSetup, tmp_path) -> None:
    """A fragmented pool hands an image several extents: pieces across their seams still land."""
    base = _base(lora_setup)
    config = lora_config(lora_setup.base_dir, max_lora_rank=MAX_RANK)
    new, ref = ModelRunner(config), ModelRunner(config)
    pool = new.lora.pool
    path = write_adapter(str(tmp_path / "a"), base, r=48, targets=ALL_SEVEN + ["lm_head"], seed=5)
    image_bytes = _layout(new, path, base).num_bytes
    assert image_bytes > pool.page_bytes
    pool.max_blocks = 1  # one block, every other page of it free
    hold = [pool.alloc(pool.page_bytes) for _ in range(pool.pages_per_block)]
    for extents in hold[::2]:
        pool.free(extents)
    assert isinstance(new.adapters.load(AdapterSlotAssigned(2, 7, path)), AdapterLoadCompleted)
    assert len(new.lora.loader.cpu.entries[7].image.extents) == -(-image_bytes // pool.page_bytes)
    reference_load(ref.lora, 2, path, base, MAX_RANK, new.dtype)
    _assert_slot_equal(new, ref, 2)
    for extents in hold[1::2]:
        pool.free(extents)
    new.adapters.drop_cpu(AdapterCpuEvicted(7))
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
    failed = runner.adapters.load(AdapterSlotAssigned(0, 1, path))
    assert isinstance(failed, AdapterLoadFailed) and "NaN or infinite" in failed.message, failed
    fine = write_adapter(str(tmp_path / "fine"), base, r=4, targets=["q_proj", "down_proj"], seed=2)
    assert isinstance(runner.adapters.load(AdapterSlotAssigned(0, 2, fine)), AdapterLoadCompleted)
    assert runner.lora.slot_table() == [[0, 2]]


ODD = BaseShapes(num_layers=1, hidden_size=24, intermediate_size=37, q_size=24, kv_size=8, vocab_size=40)


def _buffers(base: BaseShapes, max_rank: int) -> dict[str, LoraWeights]:
    """Two slots of every projection's buffers, as the worker stacks them (bfloat16, on the CPU)."""
    h, i = base.hidden_size, base.intermediate_size
    fused = {
        "self_attn.qkv_proj": (h, [base.q_size, base.kv_size, base.kv_size]),
        "self_attn.o_proj": (base.q_size, [h]),
        "mlp.gate_up_proj": (h, [i, i]),
        "mlp.down_proj": (i, [h]),
    }
    weights = {
        f"model.layers.{layer}.{name}": LoraWeights(2, max_rank, n_in, outs, torch.bfloat16, torch.device("cpu"))
        for layer in range(base.num_layers)
        for name, (n_in, outs) in fused.items()
    }
    weights["lm_head"] = LoraWeights(2, max_rank, h, [base.vocab_size], torch.bfloat16, torch.device("cpu"))
    return weights


def test_tensors_unaligned_in_the_file_land_exactly(tmp_path) -> None:
    """Packed tensors of mixed dtypes (odd sizes: an F32 or F64 tensor may start off its item
    size) are staged as bytes and aligned on the device before their copy."""
    max_rank = 8
    path = write_adapter(str(tmp_path / "odd"), ODD, r=3, targets=ALL_SEVEN + ["lm_head"], seed=3)
    weights_file = os.path.join(path, WEIGHTS_FILE)
    dtypes = [torch.float16, torch.float32, torch.bfloat16, torch.float64]
    tensors = [
        (key, t.to(dtypes[i % 4], copy=True))  # copies: the file is rewritten under load_file's map
        for i, (key, t) in enumerate(sorted(load_file(weights_file).items()))
    ]
    write_raw(weights_file, tensors)
    fd = os.open(weights_file, os.O_RDONLY)
    try:
        header = read_header(fd, os.fstat(fd).st_size, max_tensors(ODD))
    finally:
        os.close(fd)
    assert any(e.start % FILE_DTYPES[e.dtype].itemsize for e in header.tensors.values())
    new, ref = _buffers(ODD, max_rank), _buffers(ODD, max_rank)
    ranks, scalings = flat_tables(new)
    layout = SlotLayout(new)
    copier = SlotCopier(new, layout, ranks, scalings, staging_bytes(layout, max_rank), torch.device("cpu"))
    pool = PinnedPool(4 * layout.max_image_bytes(max_rank), 4096, pin=False)
    spec = ReadSpec(ODD, max_rank, (), layout, torch.bfloat16)
    image = read_image(spec, pool, 1, path, "")
    scatter = copier.scatter(1, image.layout)
    assert any(chunk.unaligned for chunk in scatter.chunks)
    copier.copy(image, pool, scatter, None)
    reference_load(ref, 1, path, ODD, max_rank, torch.bfloat16)
    for name, w in new.items():
        r = ref[name]
        assert torch.equal(w.a, r.a) and torch.equal(w.b, r.b), name
        assert torch.equal(w.ranks, r.ranks) and torch.equal(w.scalings, r.scalings), name
