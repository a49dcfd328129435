"""Expert LoRA in PEFT's target_parameters form (shared/expert_adapters.py), read by the one bounded
reader: PEFT's own files pass every check (and are then refused, as the engine cannot serve them
yet, saying so); PEFT 0.18's transposed form, an ambiguous one without a recorded version, a
misshapen, truncated or non-finite tensor and a parameter the base lacks are refused with the reason."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from ledgerserve.shared.adapter_format import AdapterError, BaseShapes, read_manifest

E, H, INTER, R = 4, 24, 10, 2  # experts, hidden, expert intermediate, rank
BASE = BaseShapes(2, H, 40, H, 8, 50, sparse_layers=(0, 1), num_experts=E, expert_intermediate_size=INTER)
SQUARE = BaseShapes(2, H, 40, H, 8, 50, sparse_layers=(1,), num_experts=E, expert_intermediate_size=H // 2)
NOT_SERVED = "well formed, but expert adapters cannot be served yet"


def _write(tmp_path, base: BaseShapes, params: list[str], version: str | None = "0.21.2", swap: bool = False, **kw):
    """A target_parameters adapter as PEFT saves one (`swap`: in PEFT 0.18's form, in and out swapped)."""
    tensors = {}
    for layer in base.sparse_layers:
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
        for param in params:
            n_in, n_out = (
                (H, 2 * base.expert_intermediate_size)
                if param == "gate_up_proj"
                else (base.expert_intermediate_size, H)
            )
            if swap:
                n_in, n_out = n_out, n_in
            stem = f"{prefix}.base_layer" if len(params) == 2 and param == "gate_up_proj" else prefix
            tensors[f"{stem}.lora_A.weight"] = torch.randn(R * E, n_in)
            tensors[f"{stem}.lora_B.weight"] = torch.randn(n_out, R * E)
    tensors.update(kw.pop("extra", {}))
    path = tmp_path / "adapter"
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": R, "lora_alpha": 2 * R, "target_modules": [], "bias": "none"}
    config["target_parameters"] = [f"mlp.experts.{p}" for p in reversed(params)]  # PEFT sorts; order is free
    if version is not None:
        config["peft_version"] = version
    (path / "adapter_config.json").write_text(json.dumps({**config, **kw}))
    return str(path)


@pytest.mark.parametrize("params", [["gate_up_proj", "down_proj"], ["down_proj"], ["gate_up_proj"]])
def test_peft_files_pass_every_check(tmp_path, params) -> None:
    with pytest.raises(AdapterError, match=NOT_SERVED):
        read_manifest(_write(tmp_path, BASE, params), BASE, 16, (str(tmp_path),), check_weights=True)


def test_the_nesting_is_gate_up_inside(tmp_path) -> None:
    path = _write(tmp_path, BASE, ["gate_up_proj", "down_proj"])
    weights = os.path.join(path, "adapter_model.safetensors")
    from safetensors.torch import load_file

    tensors = load_file(weights)
    inner = "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"
    outer = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"
    tensors[inner], tensors[outer] = tensors[outer], tensors[inner]  # down's A where gate_up's goes
    save_file(tensors, weights)
    with pytest.raises(AdapterError, match="layer 0 mlp.experts.gate_up_proj has A"):
        read_manifest(path, BASE, 16, (str(tmp_path),))


def test_peft_0_18_transposed_form_is_refused(tmp_path) -> None:
    path = _write(tmp_path, BASE, ["gate_up_proj", "down_proj"], version="0.18.1", swap=True)
    with pytest.raises(AdapterError, match="written by PEFT 0.18 or earlier.*transposed"):
        read_manifest(path, BASE, 16, (str(tmp_path),))


def test_equal_in_and_out_needs_the_recorded_version(tmp_path) -> None:
    """2I == H: the shapes cannot tell the forms apart."""
    params = ["gate_up_proj"]
    with pytest.raises(AdapterError, match="ambiguous.*records none"):
        read_manifest(_write(tmp_path, SQUARE, params, version=None), SQUARE, 16, (str(tmp_path),))
    with pytest.raises(AdapterError, match="written by PEFT 0.18"):
        read_manifest(_write(tmp_path, SQUARE, params, version="0.18.0"), SQUARE, 16, (str(tmp_path),))
    with pytest.raises(AdapterError, match=NOT_SERVED):
        read_manifest(_write(tmp_path, SQUARE, params, version="0.19.0"), SQUARE, 16, (str(tmp_path),))


def test_current_shapes_with_an_old_version_are_refused(tmp_path) -> None:
    with pytest.raises(AdapterError, match="records peft_version '0.17.0'"):
        read_manifest(_write(tmp_path, BASE, ["down_proj"], version="0.17.0"), BASE, 16, (str(tmp_path),))


def test_misshapen_missing_and_foreign_tensors(tmp_path) -> None:
    path = _write(tmp_path, BASE, ["down_proj"])
    weights = os.path.join(path, "adapter_model.safetensors")
    from safetensors.torch import load_file

    tensors = load_file(weights)
    key = "base_model.model.model.layers.1.mlp.experts.lora_B.weight"
    tensors[key] = tensors[key][:, :-1].contiguous()  # one expert's column short
    save_file(tensors, weights)
    with pytest.raises(AdapterError, match=r"layer 1 mlp.experts.down_proj has A \[8, 10\] and B \[24, 7\]"):
        read_manifest(path, BASE, 16, (str(tmp_path),))
    del tensors[key]
    save_file(tensors, weights)
    with pytest.raises(AdapterError, match="lack tensor"):
        read_manifest(path, BASE, 16, (str(tmp_path),))


@pytest.mark.parametrize(("bad", "dtype"), [(float("nan"), "float32"), (float("inf"), "float32"), (7e4, "float16")])
def test_an_expert_tensor_that_is_not_finite_in_the_model_dtype_is_refused(tmp_path, bad, dtype) -> None:
    """The same value checks as a dense module's: NaN, infinity, and a value past the range of the
    dtype the workers cast it to (7e4: finite in float32, not in float16)."""
    path = _write(tmp_path, BASE, ["gate_up_proj", "down_proj"])
    weights = os.path.join(path, "adapter_model.safetensors")
    from safetensors.torch import load_file

    tensors = load_file(weights)
    key = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"
    tensors[key][3, 5] = bad
    save_file(tensors, weights)
    with pytest.raises(AdapterError, match=f"Tensor {key} holds"):
        read_manifest(path, BASE, 16, (str(tmp_path),), check_weights=True, model_dtype=dtype)


def test_a_truncated_expert_tensor_is_a_400(tmp_path) -> None:
    path = _write(tmp_path, BASE, ["gate_up_proj", "down_proj"])
    weights = os.path.join(path, "adapter_model.safetensors")
    os.truncate(weights, os.path.getsize(weights) - 5)  # the last tensor's bytes cut short
    with pytest.raises(AdapterError) as info:
        read_manifest(path, BASE, 16, (str(tmp_path),), check_weights=True)
    assert info.value.code == 400 and NOT_SERVED not in info.value.message


def test_parameters_the_base_lacks_are_refused(tmp_path) -> None:
    path = _write(tmp_path, BASE, ["down_proj"], target_parameters=["mlp.router.weight"])
    with pytest.raises(AdapterError, match="not an expert parameter"):
        read_manifest(path, BASE, 16, (str(tmp_path),))
    dense = BaseShapes(2, H, 40, H, 8, 50)
    with pytest.raises(AdapterError, match="no experts"):
        read_manifest(_write(tmp_path, BASE, ["down_proj"]), dense, 16, (str(tmp_path),))


def test_an_adapter_peft_saved_passes_every_check(tiny_moe_checkpoint: str, tmp_path) -> None:
    from peft import LoraConfig, get_peft_model

    from tests.model_factory import load_reference

    with open(os.path.join(tiny_moe_checkpoint, "config.json"), encoding="utf-8") as f:
        base = BaseShapes.from_hf_config(json.load(f))
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    config = LoraConfig(r=3, lora_alpha=9, target_modules=["q_proj"], target_parameters=targets)
    get_peft_model(load_reference(tiny_moe_checkpoint), config).save_pretrained(str(tmp_path / "saved"))
    with pytest.raises(AdapterError, match=NOT_SERVED):
        read_manifest(str(tmp_path / "saved"), base, 16, (str(tmp_path),), check_weights=True)


QWEN_NAMES, MIXTRAL_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj"), ("block_sparse_moe", "w1", "w3", "w2")


def _write_per_expert(tmp_path, base: BaseShapes, experts=range(E), rank: int = R, **config):
    """A per-expert 2-D adapter (transformers 4's expert modules) on every expert projection."""
    block, *names = base.per_expert_names
    tensors = {}
    for layer in base.sparse_layers:
        for e in experts:
            for name in names:
                n_in, n_out = (INTER, H) if name == names[2] else (H, INTER)
                stem = f"base_model.model.model.layers.{layer}.{block}.experts.{e}.{name}"
                tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, n_in)
                tensors[f"{stem}.lora_B.weight"] = torch.randn(n_out, rank)
    path = tmp_path / "per-expert"
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    body = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": names, **config}
    (path / "adapter_config.json").write_text(json.dumps(body))
    return str(path)


@pytest.mark.parametrize("names", [QWEN_NAMES, MIXTRAL_NAMES])
def test_per_expert_files_pass_every_check(tmp_path, names) -> None:
    base = BaseShapes(2, H, 40, H, 8, 50, (0, 1), E, INTER, per_expert_names=names)
    with pytest.raises(AdapterError, match=f"per-expert modules, 6 projections over 2 layers.*{NOT_SERVED}"):
        read_manifest(_write_per_expert(tmp_path, base), base, 16, (str(tmp_path),), check_weights=True)


def test_a_per_expert_adapter_missing_one_expert_or_misshapen_is_refused(tmp_path) -> None:
    path = _write_per_expert(tmp_path, BASE)
    weights = os.path.join(path, "adapter_model.safetensors")
    from safetensors.torch import load_file

    tensors = load_file(weights)
    key = "base_model.model.model.layers.1.mlp.experts.2.up_proj.lora_B.weight"
    tensors[key] = tensors[key][:-1].contiguous()
    save_file(tensors, weights)
    with pytest.raises(AdapterError, match=rf"{key} has shape \[9, 2\], the base model's expert needs \[10, 2\]"):
        read_manifest(path, BASE, 16, (str(tmp_path),))
    del tensors[key]  # one expert of many: never read as a zero delta
    save_file(tensors, weights)
    with pytest.raises(AdapterError, match=f"lack tensor {key}"):
        read_manifest(path, BASE, 16, (str(tmp_path),))


def test_experts_of_one_projection_share_a_rank(tmp_path) -> None:
    pattern = {"model.layers.0.mlp.experts.1.gate_proj": 4}
    path = _write_per_expert(tmp_path, BASE, rank_pattern=pattern)
    with pytest.raises(AdapterError, match="experts of layer 0 gate differ in rank"):
        read_manifest(path, BASE, 16, (str(tmp_path),))


def test_a_pattern_may_target_some_experts(tmp_path) -> None:
    """The others are left alone (a zero delta): their tensors are absent, as PEFT saves them."""
    path = _write_per_expert(tmp_path, BASE, experts=[0, 3], target_modules=r".*\.experts\.(0|3)\.(gate|up|down)_proj")
    with pytest.raises(AdapterError, match=NOT_SERVED):
        read_manifest(path, BASE, 16, (str(tmp_path),), check_weights=True)


def test_expert_names_matching_no_expert_tensor_leave_a_dense_adapter(tmp_path) -> None:
    """Under transformers 5 `gate_proj` matches only dense MLP layers (experts are 3-D parameters):
    such an adapter, without expert tensors, is a dense one."""
    base = BaseShapes(2, H, 40, H, 8, 50, sparse_layers=(1,), num_experts=E, expert_intermediate_size=INTER)
    path = tmp_path / "dense"
    path.mkdir()
    stem = "base_model.model.model.layers.0.mlp.gate_proj"
    save_file(
        {f"{stem}.lora_A.weight": torch.randn(R, H), f"{stem}.lora_B.weight": torch.randn(40, R)},
        str(path / "adapter_model.safetensors"),
    )
    config = {"peft_type": "LORA", "r": R, "lora_alpha": R, "target_modules": ["gate_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))
    manifest = read_manifest(str(path), base, 16, (str(tmp_path),), check_weights=True)
    assert [m.name for m in manifest.modules] == ["model.layers.0.mlp.gate_proj"]
