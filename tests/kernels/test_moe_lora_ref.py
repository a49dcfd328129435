"""The expert-LoRA reference (kernels/moe_lora_ref.py) against PEFT: a tiny Qwen3-MoE / Mixtral with
a `target_parameters` adapter on both expert tensors. One batch mixes adapter and base tokens:
each row equals its own model's sparse MLP output (PEFT's for the adapter rows, the base model's
for the others); without the adapter the reference is kernels/moe_ref.fused_moe_ref."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels.moe_lora_ref import ExpertLora, ExpertLoras, fused_moe_lora_ref
from ledgerserve.kernels.moe_ref import fused_moe_ref, route
from ledgerserve.worker_proc.lora.expert_layout import split_experts
from tests.model_factory import load_reference

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
RANK, ALPHA = 3, 9


def _sparse_block(model):
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PeftModel's own
    return next(layer.mlp for layer in inner.model.layers if hasattr(layer.mlp, "experts"))


def _io(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first sparse MLP's input and output rows, [tokens, hidden] each."""
    seen = {}
    hook = _sparse_block(model).register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    with torch.no_grad():
        model(ids)
    hook.remove()
    hidden = seen["x"].shape[-1]
    return seen["x"].reshape(-1, hidden), seen["y"].reshape(-1, hidden)


def _banks(peft_model, num_slots: int, slot: int) -> ExpertLoras:
    """The PEFT adapter's first sparse layer, split per expert into `slot` of empty banks."""
    state = {n: p.detach() for n, p in peft_model.named_parameters() if "lora_" in n}
    prefix = next(n for n in state if ".experts.base_layer.lora_A" in n).split(".base_layer.")[0]
    parts = []
    for wrapper in (".base_layer", ""):  # gate_up, then down (PEFT nests them in that order)
        a = state[f"{prefix}{wrapper}.lora_A.default.weight"]
        b = state[f"{prefix}{wrapper}.lora_B.default.weight"]
        num_experts = _sparse_block(peft_model).experts.num_experts
        per_a, per_b = split_experts(a, b, num_experts)  # [E, r, in], [E, out, r]
        bank_a = torch.zeros(num_slots, *per_a.shape)
        bank_b = torch.zeros(num_slots, *per_b.shape)
        bank_a[slot], bank_b[slot] = per_a, per_b
        scaling = torch.zeros(num_slots)
        scaling[slot] = ALPHA / RANK
        parts.append(ExpertLora(bank_a, bank_b, scaling))
    return ExpertLoras.from_fused_gate_up(*parts)


def test_a_mixed_batch_matches_peft_and_the_base(tiny_moe_checkpoint: str) -> None:
    from peft import LoraConfig, get_peft_model

    base = load_reference(tiny_moe_checkpoint).eval()
    torch.manual_seed(11)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=[], target_parameters=TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(load_reference(tiny_moe_checkpoint), config).eval()
    ids = torch.randint(3, 200, (1, 13), generator=torch.Generator().manual_seed(5))
    x_lora, want_lora = _io(peft_model, ids)
    x_base, want_base = _io(base, ids)
    assert not torch.allclose(want_lora, want_base, atol=1e-4)  # the adapter changes the block
    block = _sparse_block(base)
    x = torch.cat([x_lora, x_base])
    slots = torch.tensor([2] * len(x_lora) + [-1] * len(x_base))
    weights, experts = route(x @ block.gate.weight.T, base.config.num_experts_per_tok, _renormalize(base))
    w13, w2 = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    got = fused_moe_lora_ref(x, w13, w2, weights, experts, slots, _banks(peft_model, 3, slot=2))
    torch.testing.assert_close(got, torch.cat([want_lora, want_base]), atol=1e-5, rtol=1e-5)
    no_lora = fused_moe_lora_ref(x, w13, w2, weights, experts, torch.full_like(slots, -1), _banks(peft_model, 3, 2))
    torch.testing.assert_close(no_lora, fused_moe_ref(x, w13, w2, weights, experts), atol=1e-6, rtol=1e-6)


def _renormalize(model) -> bool:
    return bool(getattr(model.config, "norm_topk_prob", True))  # Mixtral renormalises its top-k softmax


@pytest.mark.parametrize("num_slots", [1, 4])
def test_slots_read_their_own_banks(num_slots: int) -> None:
    gen = torch.Generator().manual_seed(0)
    num_experts, hidden, inter, rank = 5, 12, 7, 2
    x = torch.randn(6, hidden, generator=gen)
    w13, w2 = (
        torch.randn(num_experts, 2 * inter, hidden, generator=gen),
        torch.randn(num_experts, hidden, inter, generator=gen),
    )
    weights, ids = route(torch.randn(6, num_experts, generator=gen), 2, True)

    def bank(n_in: int, n_out: int) -> ExpertLora:
        a = torch.randn(num_slots, num_experts, rank, n_in, generator=gen)
        b = torch.randn(num_slots, num_experts, n_out, rank, generator=gen)
        return ExpertLora(a, b, torch.rand(num_slots, generator=gen) + 0.5)

    loras = ExpertLoras(bank(hidden, inter), bank(hidden, inter), bank(inter, hidden))
    slots = torch.tensor([s % (num_slots + 1) - 1 for s in range(6)])  # -1, 0, .. cycling
    got = fused_moe_lora_ref(x, w13, w2, weights, ids, slots, loras)
    for t in range(6):  # each token alone, its slot's deltas merged into the expert weights
        s = int(slots[t])
        m13, m2 = w13.clone(), w2.clone()
        if s >= 0:
            for p, rows in ((loras.gate, slice(0, inter)), (loras.up, slice(inter, 2 * inter))):
                m13[:, rows] += p.scaling[s] * torch.bmm(p.b[s], p.a[s])
            m2 += loras.down.scaling[s] * torch.bmm(loras.down.b[s], loras.down.a[s])
        want = fused_moe_ref(x[t : t + 1], m13, m2, weights[t : t + 1], ids[t : t + 1])
        torch.testing.assert_close(got[t : t + 1], want, atol=1e-4, rtol=1e-4)
