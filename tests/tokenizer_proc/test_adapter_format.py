"""read_manifest against real PEFT adapters and hand-broken copies of them."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from ledgerserve.shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, AdapterError, BaseShapes, read_manifest
from tests.peft_util import build_peft_model, make_tiny_peft_adapter, peft_ranks_scalings

MAX_RANK = 16


@pytest.fixture(scope="module")
def good(base_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_peft_adapter(base_dir, tmp_path_factory.mktemp("good") / "a", target_modules=["q_proj", "v_proj"])


@pytest.fixture
def copy(good: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "copy"))


def _refused(path: str | Path, base: BaseShapes, fragment: str, code: int = 400) -> None:
    with pytest.raises(AdapterError) as info:
        read_manifest(str(path), base, MAX_RANK)
    assert info.value.code == code
    assert fragment.lower() in info.value.message.lower(), info.value.message


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / CONFIG_FILE).read_text())
    config.update(changes)
    (path / CONFIG_FILE).write_text(json.dumps(config))


def test_accepts_a_peft_adapter(good: str, base: BaseShapes) -> None:
    manifest = read_manifest(good, base, MAX_RANK)
    assert manifest.path == os.path.realpath(good)
    assert manifest.kinds == ("q_proj", "v_proj") and manifest.max_rank == 4
    assert len(manifest.modules) == 2 * base.num_layers
    assert manifest.num_bytes == os.path.getsize(os.path.join(good, WEIGHTS_FILE))


def test_missing_path_is_404(tmp_path: Path, base: BaseShapes) -> None:
    _refused(tmp_path / "nothing-here", base, "No adapter directory", code=404)


def test_pickle_weights_refused(copy: Path, base: BaseShapes) -> None:
    (copy / WEIGHTS_FILE).unlink()
    (copy / "adapter_model.bin").write_bytes(b"not unpickled, only named")
    _refused(copy, base, "pickle")


def test_no_weights_refused(copy: Path, base: BaseShapes) -> None:
    (copy / WEIGHTS_FILE).unlink()
    _refused(copy, base, f"no {WEIGHTS_FILE}")


@pytest.mark.parametrize(("kwargs", "fragment"), [({"use_dora": True}, "DoRA"), ({"bias": "lora_only"}, "bias")])
def test_real_peft_variants_refused(
    base_dir: str, base: BaseShapes, tmp_path: Path, kwargs: dict, fragment: str
) -> None:
    _refused(make_tiny_peft_adapter(base_dir, tmp_path / "a", **kwargs), base, fragment)


def test_rank_above_max_refused(base_dir: str, base: BaseShapes, tmp_path: Path) -> None:
    _refused(make_tiny_peft_adapter(base_dir, tmp_path / "a", r=MAX_RANK * 2), base, "--max-lora-rank")


def test_rank_pattern_above_max_refused(base_dir: str, base: BaseShapes, tmp_path: Path) -> None:
    path = make_tiny_peft_adapter(base_dir, tmp_path / "a", r=4, rank_pattern={"v_proj": MAX_RANK + 1})
    _refused(path, base, "exceeds --max-lora-rank")


def test_unknown_target_module_refused(copy: Path, base: BaseShapes) -> None:
    _edit_config(copy, target_modules=["q_proj", "qkv_proj"])
    _refused(copy, base, "qkv_proj")


def test_target_regex_matching_nothing_refused(copy: Path, base: BaseShapes) -> None:
    _edit_config(copy, target_modules=r".*\.c_attn")
    _refused(copy, base, "match no module")


def test_shape_mismatch_refused(demo_model_dir: str, base: BaseShapes, tmp_path: Path) -> None:
    other = make_tiny_peft_adapter(demo_model_dir, tmp_path / "a")  # hidden 128, not 64
    _refused(other, base, "shape")


def test_truncated_weights_refused(copy: Path, base: BaseShapes) -> None:
    weights = copy / WEIGHTS_FILE
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 16])
    _refused(copy, base, "truncated")
    weights.write_bytes(data[:5])
    _refused(copy, base, "truncated")


def test_malformed_header_refused(copy: Path, base: BaseShapes) -> None:
    weights = copy / WEIGHTS_FILE
    data = weights.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    weights.write_bytes(data[:8] + b"{" * header_len + data[8 + header_len :])
    _refused(copy, base, "malformed header")


def test_huge_header_length_refused(copy: Path, base: BaseShapes) -> None:
    weights = copy / WEIGHTS_FILE
    weights.write_bytes(struct.pack("<Q", 2**62) + weights.read_bytes()[8:])
    _refused(copy, base, "bad header length")


def test_added_vocabulary_refused(copy: Path, base: BaseShapes) -> None:
    tensors = load_file(str(copy / WEIGHTS_FILE))
    import torch

    tensors["base_model.model.model.embed_tokens.weight"] = torch.zeros(base.vocab_size + 8, base.hidden_size)
    save_file(tensors, str(copy / WEIGHTS_FILE))
    _refused(copy, base, "vocabulary")


def test_extra_tensor_refused(copy: Path, base: BaseShapes) -> None:
    tensors = load_file(str(copy / WEIGHTS_FILE))
    import torch

    tensors["base_model.model.model.norm.weight"] = torch.ones(base.hidden_size)
    save_file(tensors, str(copy / WEIGHTS_FILE))
    _refused(copy, base, "does not explain")


def test_no_config_refused(copy: Path, base: BaseShapes) -> None:
    (copy / CONFIG_FILE).unlink()
    _refused(copy, base, f"no {CONFIG_FILE}")


def test_bad_json_refused(copy: Path, base: BaseShapes) -> None:
    (copy / CONFIG_FILE).write_text('{"r": 4,')
    _refused(copy, base, "not valid JSON")
    (copy / CONFIG_FILE).write_text("[1, 2]")
    _refused(copy, base, "JSON object")


@pytest.mark.parametrize("peft_type", ["PREFIX_TUNING", "IA3", "LOHA"])
def test_other_peft_types_refused(copy: Path, base: BaseShapes, peft_type: str) -> None:
    _edit_config(copy, peft_type=peft_type)
    _refused(copy, base, "Only LoRA")


def test_modules_to_save_refused(copy: Path, base: BaseShapes) -> None:
    _edit_config(copy, modules_to_save=["lm_head"])
    _refused(copy, base, "modules_to_save")


def test_full_paths_suffixes_and_lm_head_accepted(base_dir: str, base: BaseShapes, tmp_path: Path) -> None:
    targets = ["model.layers.0.self_attn.q_proj", "mlp.down_proj", "lm_head"]
    manifest = read_manifest(make_tiny_peft_adapter(base_dir, tmp_path / "a", target_modules=targets), base, MAX_RANK)
    names = {m.name for m in manifest.modules}
    assert names == {
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.mlp.down_proj",
        "lm_head",
    }


@pytest.mark.parametrize("use_rslora", [False, True])
def test_ranks_and_scalings_equal_peft(base_dir: str, base: BaseShapes, tmp_path: Path, use_rslora: bool) -> None:
    kwargs = dict(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "up_proj"],
        use_rslora=use_rslora,
        rank_pattern={"q_proj": 8, "model.layers.1.mlp.up_proj": 2},
        alpha_pattern={"v_proj": 32},
    )
    model = build_peft_model(base_dir, **kwargs)
    model.save_pretrained(str(tmp_path / "a"), safe_serialization=True)
    manifest = read_manifest(str(tmp_path / "a"), base, MAX_RANK)
    ours = {m.name: (m.rank, m.scaling) for m in manifest.modules}
    theirs = peft_ranks_scalings(model)
    assert ours.keys() == theirs.keys()
    for name, (rank, scaling) in theirs.items():
        assert ours[name][0] == rank, name
        assert ours[name][1] == pytest.approx(scaling, rel=1e-12), name
    assert manifest.max_rank == 8
