"""PEFT's target_parameters expert LoRA, split per expert (worker_proc/lora/expert_layout.py):
the base model with every expert's delta merged in gives PEFT's own logits; the same merge with B
split as if expert-major (the scramble peers shipped) does not."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.worker_proc.lora.expert_layout import expert_deltas, split_experts
from tests.model_factory import load_reference

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _peft_model(base_dir: str):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(7)
    config = LoraConfig(r=3, lora_alpha=9, target_modules=[], target_parameters=TARGETS, init_lora_weights=False)
    return get_peft_model(load_reference(base_dir), config).eval()


def _merged(base_dir: str, peft_model, split) -> torch.nn.Module:
    """The base model with each layer's expert deltas added to its fused expert parameters."""
    state = {name: p for name, p in peft_model.named_parameters() if "lora_" in name}
    model = load_reference(base_dir)
    scaling = 9 / 3
    for index, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue  # a dense layer
        prefix = f"base_model.model.model.layers.{index}.mlp.experts"
        for param, wrapper in (("gate_up_proj", ".base_layer"), ("down_proj", "")):
            a, b = state[f"{prefix}{wrapper}.lora_A.default.weight"], state[f"{prefix}{wrapper}.lora_B.default.weight"]
            weight = getattr(experts, param)  # [E, out, in]
            with torch.no_grad():
                weight += split(a, b, weight.shape[0], scaling)
    return model.eval()


def _expert_major(a: torch.Tensor, b: torch.Tensor, num_experts: int, scaling: float) -> torch.Tensor:
    rank = a.shape[0] // num_experts
    per_a = a.reshape(num_experts, rank, -1)
    per_b = b.reshape(b.shape[0], num_experts, rank).permute(1, 0, 2)
    return scaling * torch.bmm(per_b, per_a)


def test_split_experts_gives_peft_s_logits(tiny_moe_checkpoint: str) -> None:
    peft_model = _peft_model(tiny_moe_checkpoint)
    ids = torch.randint(3, 200, (1, 19), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = peft_model(ids).logits
        base = load_reference(tiny_moe_checkpoint)(ids).logits
        got = _merged(tiny_moe_checkpoint, peft_model, expert_deltas)(ids).logits
        scrambled = _merged(tiny_moe_checkpoint, peft_model, _expert_major)(ids).logits
    assert not torch.allclose(base, want, atol=1e-3)  # the adapter changes the output
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(scrambled, want, atol=1e-3)


def test_shapes_that_do_not_split_are_refused() -> None:
    a, b = torch.zeros(10, 8), torch.zeros(6, 10)
    assert [t.shape for t in split_experts(a, b, 5)] == [(5, 2, 8), (5, 6, 2)]
    with pytest.raises(ValueError, match="do not split into 3 experts"):
        split_experts(a, b, 3)
    with pytest.raises(ValueError, match="do not split"):
        split_experts(a, torch.zeros(6, 12), 5)
