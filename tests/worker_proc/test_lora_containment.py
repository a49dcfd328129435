"""The worker re-reads an adapter (disk -> CPU tier) under the HTTP process's containment rule:
inside a --lora-allowed-dir root, a file that links out of every root is refused; a link that
stays inside is followed, and the slot's tensors come from the file that was checked. A run-time
adapter whose directory no longer lies inside a root when it is read again is refused; a trusted
start-up adapter may lie anywhere."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ledgerserve.shared.adapter_format import WEIGHTS_FILE
from ledgerserve.shared.events import (
    AdapterCpuEvicted,
    AdapterEvicted,
    AdapterLoadCompleted,
    AdapterLoadFailed,
    AdapterSlotAssigned,
)
from ledgerserve.worker_proc.runner import ModelRunner
from tests.model_factory import make_tiny_checkpoint
from tests.peft_util import make_tiny_peft_adapter
from tests.worker_proc.lora_setup import lora_config


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    top = tmp_path_factory.mktemp("containment")
    base_dir = make_tiny_checkpoint("llama", top / "base")
    return base_dir, Path(make_tiny_peft_adapter(base_dir, top / "good", target_modules=["q_proj", "v_proj"]))


def _runner(base_dir: str, root: Path) -> ModelRunner:
    return ModelRunner(lora_config(base_dir, max_lora_rank=16, lora_allowed_dirs=(str(root),)))


def test_links_out_of_the_root_are_refused_inside_followed(setup, tmp_path: Path) -> None:
    base_dir, good = setup
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    escaping = Path(shutil.copytree(good, root / "escaping"))
    os.replace(escaping / WEIGHTS_FILE, outside / WEIGHTS_FILE)
    (escaping / WEIGHTS_FILE).symlink_to(outside / WEIGHTS_FILE)
    runner = _runner(base_dir, root)
    refused = runner.adapters.load(AdapterSlotAssigned(0, 1, str(escaping)))
    assert isinstance(refused, AdapterLoadFailed) and "leaves --lora-allowed-dir" in refused.message

    linked = Path(shutil.copytree(good, root / "linked"))
    os.replace(linked / WEIGHTS_FILE, root / "blob.safetensors")
    (linked / WEIGHTS_FILE).symlink_to(root / "blob.safetensors")
    assert isinstance(runner.adapters.load(AdapterSlotAssigned(1, 2, str(linked))), AdapterLoadCompleted)
    reference = load_file(str(good / WEIGHTS_FILE))
    a = reference["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]  # [rank, in]
    b = reference["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]  # [out, rank]
    w = runner.lora.weights["model.layers.0.self_attn.qkv_proj"]
    assert torch.equal(w.a[1, 0, : a.shape[0]], a) and torch.equal(w.b[1, 0, : b.shape[0], : b.shape[1]], b)


@pytest.mark.parametrize("swapped", ["directory", "parent"])
def test_a_reread_refuses_a_directory_swapped_out_of_the_roots(setup, tmp_path: Path, swapped: str) -> None:
    """A run-time adapter read again from disk (its CPU copy dropped) after its directory, or one
    above it, became a link out of every root: refused, without saying where it leads. A trusted
    start-up adapter (--lora-modules) outside the roots still loads."""
    base_dir, good = setup
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    moved = root / "sub" if swapped == "parent" else root / "sub" / "a"
    adapter = Path(shutil.copytree(good, root / "sub" / "a"))
    trusted = Path(shutil.copytree(good, outside / "trusted"))
    config = lora_config(
        base_dir, max_lora_rank=16, lora_allowed_dirs=(str(root),), lora_modules=(("t", str(trusted)),)
    )
    runner = ModelRunner(config)
    assert isinstance(runner.adapters.load(AdapterSlotAssigned(0, 1, str(adapter))), AdapterLoadCompleted)
    runner.adapters.evict(AdapterEvicted(0, 1))
    runner.adapters.drop_cpu(AdapterCpuEvicted(1))
    os.replace(moved, outside / moved.name)
    moved.symlink_to(outside / moved.name, target_is_directory=True)
    refused = runner.adapters.load(AdapterSlotAssigned(0, 1, str(adapter)))
    assert isinstance(refused, AdapterLoadFailed), refused
    assert "no longer lies inside any --lora-allowed-dir" in refused.message and str(outside) not in refused.message
    assert 0 not in runner.lora.slots
    assert isinstance(runner.adapters.load(AdapterSlotAssigned(1, 2, str(trusted))), AdapterLoadCompleted)
