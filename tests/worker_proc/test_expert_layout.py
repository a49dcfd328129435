"""Expert LoRA in the per-expert layout (worker_proc/lora/expert_layout.py). PEFT's target_parameters
form, split per expert: the base model with every expert's delta merged in gives PEFT's own logits;
the same merge with B split as if expert-major (the scramble peers shipped) does not. The per-expert
2-D form, stacked: the reference forward equals transformers loading a checkpoint with the deltas
merged into its own per-expert weights (so Mixtral's w1 is the gate and w3 the up)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ledgerserve.kernels.moe_lora_ref import ExpertLora, ExpertLoras, fused_moe_lora_ref
from ledgerserve.kernels.moe_ref import route
from ledgerserve.shared.adapter_types import BaseShapes
from ledgerserve.shared.expert_adapters import PROJS, per_expert_module_names, per_expert_modules
from ledgerserve.worker_proc.lora.expert_layout import expert_deltas, split_experts, stack_experts
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


def _first_sparse_block_io(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    seen = {}
    hook = block.register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    with torch.no_grad():
        model(ids)
    hook.remove()
    return seen["x"].reshape(-1, seen["x"].shape[-1]), seen["y"].reshape(-1, seen["y"].shape[-1])


def test_per_expert_modules_stack_into_the_layout_transformers_loads(tiny_moe_checkpoint: str, tmp_path) -> None:
    base = BaseShapes.from_hf_config(json.loads(Path(tiny_moe_checkpoint, "config.json").read_text()))
    rank, scaling, layer = 2, 1.5, base.sparse_layers[0]
    modules = {m.proj: m for m in per_expert_modules(base, lambda name: True, lambda name: (rank, scaling))}
    gen = torch.Generator().manual_seed(3)
    h, inter = base.hidden_size, base.expert_intermediate_size
    pairs: dict[str, list] = {}
    state = load_file(str(Path(tiny_moe_checkpoint, "model.safetensors")))
    for proj in PROJS:
        n_in, n_out = (inter, h) if proj == "down" else (h, inter)
        pairs[proj] = [  # deltas about the size of the weights (0.1): fp32 sums of like terms
            None
            if e == 1
            else (0.1 * torch.randn(rank, n_in, generator=gen), 0.1 * torch.randn(n_out, rank, generator=gen))
            for e in range(base.num_experts)
        ]  # expert 1 left alone
        for name, pair in zip(per_expert_module_names(base, layer, proj), pairs[proj]):
            if pair is not None:  # into the checkpoint's own per-expert weight of that name
                state[f"{name}.weight"] = state[f"{name}.weight"] + scaling * pair[1] @ pair[0]
    merged_dir = tmp_path / "merged"
    shutil.copytree(tiny_moe_checkpoint, merged_dir)
    save_file(state, str(merged_dir / "model.safetensors"), metadata={"format": "pt"})
    assert set(modules) == set(PROJS)

    ids = torch.randint(3, 200, (1, 11), generator=torch.Generator().manual_seed(5))
    model = load_reference(tiny_moe_checkpoint)
    x, y_base = _first_sparse_block_io(model, ids)
    x_merged, want = _first_sparse_block_io(load_reference(merged_dir), ids)
    torch.testing.assert_close(x_merged, x)  # the first sparse block sees the same input
    block = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    renormalize = bool(getattr(model.config, "norm_topk_prob", True))
    weights, experts = route(x @ block.gate.weight.T, model.config.num_experts_per_tok, renormalize)
    banks = {}
    for proj in PROJS:
        n_in, n_out = (inter, h) if proj == "down" else (h, inter)
        a, b = stack_experts(pairs[proj], rank, n_in, n_out)  # [E, r, in], [E, out, r]
        banks[proj] = ExpertLora(a[None], b[None], torch.tensor([scaling]))
    loras = ExpertLoras(banks["gate"], banks["up"], banks["down"])
    w13, w2 = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    got = fused_moe_lora_ref(x, w13, w2, weights, experts, torch.zeros(len(x), dtype=torch.long), loras)
    assert not torch.allclose(want, y_base, atol=1e-4)  # the deltas change the block
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
