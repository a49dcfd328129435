"""A tensor-parallel rank's CPU tier keeps only its shard of an adapter: its file image holds all of
A and the rank's rows of B on column-parallel layers (the fused q/k/v with KV heads shared by ranks,
gate/up, and lm_head over a padded vocabulary), the rank's columns of A and all of B on row-parallel
ones (o, down); byte for byte what safetensors reads for those parts, the ranks' parts together
covering every tensor, while every rank still hashes the whole file (the registered content
digest; a change in bytes a rank does not keep fails its read too). Read with every kept range
through scratch and with every run read straight into its pages, over scratch chunks that cut the
ranges anywhere. Then a rank's slot, loaded from disk and
again from its CPU tier, holds the same parts in the model dtype, and the pool's bound holds the
largest shard image. No collective runs here; tests/worker_proc/test_tensor_parallel.py checks the
sharded adapters' logits against one rank's."""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch
from safetensors import safe_open

from ledgerserve.shared.adapter_digest import content_sha256
from ledgerserve.shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, BaseShapes, max_tensors, read_manifest
from ledgerserve.shared.events import AdapterLoadCompleted
from ledgerserve.shared.safetensors_header import read_header
from ledgerserve.worker_proc.lora import reader
from ledgerserve.worker_proc.lora.file_image import ImageBytes, ImageLayout, SliceSpec, module_path
from ledgerserve.worker_proc.lora.manager import LoraManager
from ledgerserve.worker_proc.models.config import load_model_config
from ledgerserve.worker_proc.models.loader import build_model
from ledgerserve.worker_proc.parallel import TpGroup
from tests.model_factory import make_tiny_checkpoint
from tests.worker_proc.lora_files import write_adapter
from tests.worker_proc.lora_setup import ALL_SEVEN, lora_config

MAX_RANK = 16
EVERYTHING = ALL_SEVEN + ["lm_head"]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """llama: 4 heads over 2 KV heads (4 ranks share them in pairs); qwen3: head_dim 24 and a
    vocabulary of 251, which pads to 252 (rank 1 of 2 holds 125 real rows)."""
    root = tmp_path_factory.mktemp("shard-image")
    return {
        "llama": make_tiny_checkpoint("llama", root / "llama"),
        "qwen3": make_tiny_checkpoint("qwen3", root / "qwen3", vocab_size=251),
    }


def _base(base_dir: str) -> BaseShapes:
    with open(os.path.join(base_dir, "config.json"), encoding="utf-8") as f:
        return BaseShapes.from_hf_config(json.load(f))


def _manager(base_dir: str, rank: int, size: int, dtype: torch.dtype = torch.float32) -> LoraManager:
    """Rank `rank` of `size`'s model (dummy weights) with its LoRA buffers, tier and loader."""
    cfg = load_model_config(base_dir)
    model = build_model(cfg, base_dir, "dummy", dtype, torch.device("cpu"), 0, rank, TpGroup(rank, size))
    config = lora_config(base_dir, max_loras=2, max_lora_rank=MAX_RANK, lora_overlap_loading=False)
    return LoraManager(model, config, _base(base_dir), dtype, torch.device("cpu"), rank)


def _registered(path: str) -> str:
    """The content digest of the whole files, as the HTTP process records it at registration."""
    with open(os.path.join(path, CONFIG_FILE), "rb") as c, open(os.path.join(path, WEIGHTS_FILE), "rb") as w:
        return content_sha256(c.read(), w.read())


def _parts(
    manager: LoraManager, path: str, base: BaseShapes
) -> dict[int, tuple[SliceSpec, torch.Tensor, torch.Tensor]]:
    """Per global slice the adapter targets: its spec, and the rank's part of A [rank, cols] and of
    B [rows, rank] as safetensors reads them (file dtype)."""
    out = {}
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt", device="cpu") as f:
        for m in read_manifest(path, base, MAX_RANK).modules:
            g = manager.layout.index[module_path(m.layer, m.kind)]
            spec = manager.layout.slices[g]
            a, b = f.get_tensor(m.a_key), f.get_tensor(m.b_key)
            out[g] = (spec, a[:, spec.cols[0] : spec.cols[1]], b[spec.rows[0] : spec.rows[1]])
    return out


def _image_tensor(image: ImageBytes, offset: int, like: torch.Tensor) -> torch.Tensor:
    num_bytes = like.numel() * like.element_size()
    raw = torch.cat(image.ranges(offset, offset + num_bytes)) if num_bytes else torch.empty(0, dtype=torch.uint8)
    return raw.view(like.dtype).view(like.shape)


def _check_image(manager: LoraManager, layout: ImageLayout, image: ImageBytes, parts: dict) -> None:
    """The image's tensors are the rank's parts; it keeps their bytes and nothing more."""
    assert sorted(p.slice for p in layout.pieces) == sorted(parts)
    num_kept = 0
    for piece in layout.pieces:
        _, a, b = parts[piece.slice]
        assert piece.a.shape == tuple(a.shape) and piece.b.shape == tuple(b.shape)
        assert torch.equal(_image_tensor(image, piece.a.offset, a), a), piece
        assert torch.equal(_image_tensor(image, piece.b.offset, b), b), piece
        num_kept += a.numel() * a.element_size() + b.numel() * b.element_size()
    assert sum(run.stop - run.start for run in layout.runs) == num_kept
    table_end = -(-layout.table_bytes // 64) * 64
    assert num_kept < layout.num_bytes <= table_end + num_kept + 64 * 2 * len(layout.pieces)
    assert manager.pool.num_used_pages == -(-layout.num_bytes // manager.pool.page_bytes)


# (arch, ranks, file dtype, PEFT's saved embeddings in the file)
SHARDINGS = [("qwen3", 2, torch.bfloat16, True), ("llama", 4, torch.float32, False)]
READS = {  # name -> (DIRECT_READ_BYTES, READ_CHUNK_BYTES)
    "through-scratch": (1 << 40, 4096 + 5),
    "straight-into-pages": (1, 4096 + 5),
}


@pytest.mark.parametrize("arch, size, file_dtype, saved", SHARDINGS)
@pytest.mark.parametrize("read", list(READS))
def test_each_rank_keeps_its_shard_and_hashes_the_whole_file(
    bases: dict[str, str], tmp_path, monkeypatch: pytest.MonkeyPatch, arch, size, file_dtype, saved, read
) -> None:
    direct, chunk = READS[read]
    monkeypatch.setattr(reader, "DIRECT_READ_BYTES", direct)
    monkeypatch.setattr(reader, "READ_CHUNK_BYTES", chunk)
    monkeypatch.setattr(reader, "_local", threading.local())  # scratch buffers of that size, for this test only
    base_dir, base = bases[arch], _base(bases[arch])
    kw = dict(r=8, targets=EVERYTHING, dtype=file_dtype, rank_pattern={"k_proj": 3}, saved_embeddings=saved)
    path = write_adapter(str(tmp_path / "adapter"), base, seed=7, **kw)
    digest = _registered(path)
    file_bytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    covered: dict[tuple[int, str], torch.Tensor] = {}  # (slice, "a" / "b") -> columns of A / rows of B held
    for rank in range(size):
        manager = _manager(base_dir, rank, size)
        image = reader.read_image(manager.loader.spec, manager.pool, 1, path, digest)
        assert image.content_sha256 == digest and image.num_file_bytes == file_bytes
        parts = _parts(manager, path, base)
        _check_image(manager, image.layout, ImageBytes([manager.pool.view(e) for e in image.extents]), parts)
        for g, (spec, _, _) in parts.items():
            covered.setdefault((g, "a"), torch.zeros(spec.in_features, dtype=torch.bool))[slice(*spec.cols)] = True
            covered.setdefault((g, "b"), torch.zeros(spec.out_features, dtype=torch.bool))[slice(*spec.rows)] = True
        manager.pool.free(list(image.extents))
        manager.close()
    assert all(held.all() for held in covered.values())  # the ranks' parts cover every tensor


def test_a_rank_fills_its_slots_from_its_shard_image(bases: dict[str, str], tmp_path) -> None:
    """Rank 1 of 2 over the padded vocabulary: from disk (the file's bytes reported), then from the
    CPU tier into another slot (the image's bytes reported); both slots hold the rank's parts in
    the model dtype, zero past the adapter's rank and past the real vocabulary rows."""
    base_dir, base = bases["qwen3"], _base(bases["qwen3"])
    path = write_adapter(str(tmp_path / "a"), base, r=12, targets=EVERYTHING, dtype=torch.float32, seed=3)
    manager = _manager(base_dir, 1, 2, torch.bfloat16)
    digest = _registered(path)
    [disk] = manager.load_now(0, 5, path, digest, 0.0)
    [cpu] = manager.load_now(1, 5, path, digest, 0.0)
    image = manager.loader.cpu.ready(5)
    assert isinstance(disk, AdapterLoadCompleted) and isinstance(cpu, AdapterLoadCompleted)
    assert (disk.source_tier, disk.num_bytes) == ("disk", image.num_file_bytes)
    assert (cpu.source_tier, cpu.num_bytes) == ("cpu", image.layout.num_bytes)
    lm_head = manager.layout.slices[manager.layout.index[("lm_head", 0)]]
    assert lm_head.rows == (126, 251) and manager.weights["lm_head"].b.shape[2] == 126  # one padding row
    parts = _parts(manager, path, base)
    for slot in (0, 1):
        for g, spec in enumerate(manager.layout.slices):
            w = manager.weights[spec.module]
            a_slot, b_slot = w.a[slot, spec.index], w.b[slot, spec.index]  # [max_rank, in], [max_out, max_rank]
            _, a, b = parts[g]
            rank, rows = a.shape[0], b.shape[0]
            assert torch.equal(a_slot[:rank], a.to(torch.bfloat16)), spec
            assert torch.equal(b_slot[:rows, :rank], b.to(torch.bfloat16)), spec
            assert not a_slot[rank:].any() and not b_slot[rows:].any() and not b_slot[:, rank:].any(), spec
            assert w.rank_table[slot][spec.index] == rank
    manager.close()


@pytest.mark.parametrize("arch, size", [("qwen3", 2), ("llama", 4)])
def test_the_pool_bound_holds_the_largest_shard_image(bases: dict[str, str], tmp_path, arch: str, size: int) -> None:
    """An F32 adapter of the largest rank on every module fits each rank's per-image bound, and the
    bound (hence the pool for --max-cpu-loras images) shrinks with the shard."""
    base_dir = bases[arch]
    path = write_adapter(str(tmp_path / "max"), _base(base_dir), r=MAX_RANK, targets=EVERYTHING, seed=1)
    whole = _manager(base_dir, 0, 1).layout.max_image_bytes(MAX_RANK)
    for rank in range(size):
        manager = _manager(base_dir, rank, size)
        bound = manager.layout.max_image_bytes(MAX_RANK)
        image = reader.read_image(manager.loader.spec, manager.pool, 1, path, "")
        assert image.layout.num_bytes <= bound < whole
        manager.close()


def test_every_rank_refuses_a_change_in_bytes_it_does_not_keep(bases: dict[str, str], tmp_path) -> None:
    """A byte of lm_head's B in the last vocabulary row (rank 1's) changed after registration: rank 0,
    which keeps none of that row, still hashes it and refuses the version, leaving no page taken."""
    base_dir, base = bases["qwen3"], _base(bases["qwen3"])
    path = write_adapter(str(tmp_path / "a"), base, r=4, targets=EVERYTHING, seed=5)
    digest = _registered(path)
    weights = os.path.join(path, WEIGHTS_FILE)
    fd = os.open(weights, os.O_RDONLY)
    try:
        header = read_header(fd, os.fstat(fd).st_size, max_tensors(base))
    finally:
        os.close(fd)
    entry = header.tensors["base_model.model.lm_head.lora_B.weight"]  # [251, 4] F32
    with open(weights, "r+b") as f:
        f.seek(header.data_offset + entry.stop - 1)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    for rank in range(2):
        manager = _manager(base_dir, rank, 2)
        assert manager.layout.slices[manager.layout.index[("lm_head", 0)]].rows[1] == (126 if rank == 0 else 251)
        with pytest.raises(reader.ChangedOnDisk, match="changed on disk since it was registered"):
            reader.read_image(manager.loader.spec, manager.pool, 1, path, digest)
        assert manager.pool.num_used_pages == 0
        manager.close()
