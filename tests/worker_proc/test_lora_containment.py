"""The worker's CPU tier re-reads an adapter under the HTTP process's containment rule: inside
a --lora-allowed-dir root, a file that links out of every root is refused; a link that stays
inside is followed, and the tensors come from the file that was checked."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shared.adapter_format import WEIGHTS_FILE, AdapterError, BaseShapes
from tests.model_factory import make_tiny_checkpoint
from tests.peft_util import make_tiny_peft_adapter
from worker_proc.lora.cpu_tier import CpuTier


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[BaseShapes, Path]:
    top = tmp_path_factory.mktemp("containment")
    base_dir = make_tiny_checkpoint("llama", top / "base")
    base = BaseShapes.from_hf_config(json.loads((top / "base" / "config.json").read_text()))
    return base, Path(make_tiny_peft_adapter(base_dir, top / "good", target_modules=["q_proj", "v_proj"]))


def _tier(root: Path, base: BaseShapes) -> CpuTier:
    return CpuTier(base, 16, (str(root),), torch.float32, pin_memory=False)


def test_links_out_of_the_root_are_refused_inside_followed(setup, tmp_path: Path) -> None:
    base, good = setup
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    escaping = Path(shutil.copytree(good, root / "escaping"))
    os.replace(escaping / WEIGHTS_FILE, outside / WEIGHTS_FILE)
    (escaping / WEIGHTS_FILE).symlink_to(outside / WEIGHTS_FILE)
    with pytest.raises(AdapterError, match="leaves --lora-allowed-dir"):
        _tier(root, base).get_or_load(1, str(escaping))

    linked = Path(shutil.copytree(good, root / "linked"))
    os.replace(linked / WEIGHTS_FILE, root / "blob.safetensors")
    (linked / WEIGHTS_FILE).symlink_to(root / "blob.safetensors")
    adapter = _tier(root, base).get_or_load(2, str(linked))
    reference = load_file(str(good / WEIGHTS_FILE))
    a, b, _ = adapter.tensors[(0, "q_proj")]
    assert torch.equal(a, reference["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    assert torch.equal(b, reference["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"])
