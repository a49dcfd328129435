"""Build a model from a HF checkpoint directory: safetensors weights, or dummy random ones. A
checkpoint load shows its progress over the files' tensor bytes and logs its end (shared/progress.py)."""

from __future__ import annotations

import glob
import logging
import math
import os
import time
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from ledgerserve.shared.progress import Progress, format_bytes, format_seconds, weights_end_line
from ledgerserve.worker_proc.models import moe
from ledgerserve.worker_proc.models.config import ModelConfig
from ledgerserve.worker_proc.models.layers import RMSNorm, SlotLinear, VocabEmbedding
from ledgerserve.worker_proc.models.llama import LlamaForCausalLM
from ledgerserve.worker_proc.parallel import TpGroup

# HF module name suffix -> (our fused module suffix, shard index)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_ITEMSIZE = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_ITEMSIZE |= {"F8_E4M3": 1, "F8_E5M2": 1}  # of safetensors dtype names, for the load's progress
logger = logging.getLogger(__name__)

WeightKey = tuple[str, str, int]  # (module name, 'weight' | 'bias' | 'expert', shard | expert * 3 + part)


def build_model(
    cfg: ModelConfig,
    model_dir: str,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    rank: int = 0,
    group: TpGroup | None = None,
) -> LlamaForCausalLM:
    """`rank`: the worker rank this model is for; its progress is shown as shared/progress.py says.
    `group`: the tensor-parallel group; the model holds the shard of rank `group.rank` (models/shard.py)."""
    group = group or TpGroup()
    with torch.device(device):
        model = LlamaForCausalLM(cfg.shard(group.rank, group.size), group)
    model.to(dtype=dtype)
    if load_format == "dummy":
        start_s = time.monotonic()
        init_dummy_weights(model, seed)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the draws are queued: time them to their end
        num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        elapsed_s = time.monotonic() - start_s
        logger.info("initialized dummy weights: %s in %s", format_bytes(num_bytes), format_seconds(elapsed_s))
    elif load_format in ("auto", "safetensors"):
        load_safetensors(model, model_dir, rank)
    else:
        raise ValueError(f"unknown load format {load_format!r}")
    return model.eval()


def init_dummy_weights(model: LlamaForCausalLM, seed: int) -> None:
    """Random weights of the shard's shapes: N(0, 0.02) matrices, unit norms, zero bias. Every rank
    draws the same sequence (its shapes are the same), so the replicated parts agree; rows past the
    vocabulary stay zero."""
    device = next(model.parameters()).device  # CUDA draws on the GPU: seconds, not minutes, for 8B
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.data.fill_(1.0)
        elif isinstance(module, moe.SparseMoeBlock):  # its router (its experts come next)
            _draw(module.gate.weight, gen)
        elif isinstance(module, moe.Experts):
            _draw(module.w13, gen)
            _draw(module.w2, gen)
        elif isinstance(module, (SlotLinear, VocabEmbedding)):
            if isinstance(module, SlotLinear) and module.bias is not None:
                module.bias.data.zero_()
            w = torch.randn(module.weight.shape, generator=gen, device=device) * 0.02
            module.weight.data.copy_(w)
            _zero_padding(module)


def _draw(param: torch.Tensor, gen: torch.Generator) -> None:
    param.data.copy_(torch.randn(param.shape, generator=gen, device=param.device) * 0.02)


def _zero_padding(module: SlotLinear | VocabEmbedding) -> None:
    """Zero the rows of each output slice past those the checkpoint has (the padded vocabulary)."""
    sizes = module.output_sizes if isinstance(module, SlotLinear) else [module.weight.shape[0]]
    start = 0
    for (lo, hi), size in zip(module.shard.rows, sizes):
        module.weight.data[start + hi - lo : start + size].zero_()
        start += size


def load_safetensors(model: LlamaForCausalLM, model_dir: str, rank: int = 0) -> None:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir!r}")
    modules = dict(model.named_modules())
    loaded: set[WeightKey] = set()
    total_bytes = checkpoint_bytes(files)
    progress = Progress("weights", total_bytes, rank, logger)
    progress.announce(f"{format_bytes(total_bytes)} in {len(files)} file{'s' if len(files) > 1 else ''}")
    try:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    loaded.update(_load_one(model, modules, name, f))
                    progress.advance(_num_bytes(f.get_slice(name)))
    finally:
        elapsed_s = progress.close()
    missing = sorted(expected_weight_keys(model) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} lacks weights: {missing[:8]}")
    logger.info("%s", weights_end_line(progress.done, elapsed_s))


def checkpoint_bytes(paths: list[str]) -> int:
    """Bytes of tensor data in the safetensors files: each file less its 8-byte length and header."""
    total = 0
    for path in paths:
        with open(path, "rb") as f:
            head = f.read(8)
        header_len = int.from_bytes(head, "little") if len(head) == 8 else 0
        total += max(0, os.path.getsize(path) - 8 - header_len)
    return total


def _num_bytes(view: Any) -> int:
    """The bytes of a checkpoint tensor (a safetensors slice view), read or not."""
    return math.prod(view.get_shape()) * _ITEMSIZE.get(view.get_dtype(), 4)


def _load_one(model: LlamaForCausalLM, modules: dict[str, nn.Module], name: str, f: Any) -> list[WeightKey]:
    """Read this rank's part of checkpoint tensor `name` from the open file `f` into the model;
    the weight keys it filled."""
    if name.endswith(_IGNORED_SUFFIXES):
        return []
    if name == "lm_head.weight" and model.cfg.tie_word_embeddings:
        return []  # tied: the embedding is the head
    ours = moe.checkpoint_name(name)
    expert = moe.expert_tensor(ours)
    if expert is not None:
        return _load_expert(modules, name, expert, f)
    module_name, _, attr = ours.rpartition(".")
    module_name, shard = _map_module(module_name)
    module = modules.get(module_name)
    if module is None:
        raise ValueError(f"unexpected checkpoint tensor {name!r}")
    if isinstance(module, (SlotLinear, VocabEmbedding)):
        view = f.get_slice(name)
        want = module.shard.checkpoint_shape(attr, shard)
        if tuple(view.get_shape()) != want:
            raise ValueError(f"checkpoint tensor {name!r} {tuple(view.get_shape())} does not fit the model's {want}")
        index = module.shard.checkpoint_index(attr, shard)  # None: this rank keeps zeros there
        if index is not None:
            _load_part(module, attr, shard, view[index])
        return [(module_name, attr, shard)]
    tensor = f.get_tensor(name)
    param = getattr(module, attr, None)
    if not isinstance(param, torch.Tensor) or param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} does not fit the model")
    param.data.copy_(tensor)
    return [(module_name, attr, 0)]


def _load_expert(
    modules: dict[str, nn.Module], name: str, found: tuple[str, int | None, int | str], f: Any
) -> list[WeightKey]:
    """One expert's gate, up or down tensor, or a fused tensor of every expert's."""
    path, expert, part = found
    module = modules.get(path)
    if not isinstance(module, moe.Experts):
        raise ValueError(f"unexpected checkpoint tensor {name!r}: layer has no experts")
    tensor = f.get_tensor(name)
    if expert is None:  # fused: gate_up_proj or down_proj of every expert
        assert isinstance(part, str)
        if tuple(tensor.shape) != module.fused_shape(part):
            raise ValueError(
                f"checkpoint tensor {name!r} {tuple(tensor.shape)} does not fit the model's {module.fused_shape(part)}"
            )
        module.load_fused(part, tensor)
        parts = (moe.DOWN,) if part == "down_proj" else (moe.GATE, moe.UP)
        return [(path, "expert", e * 3 + p) for e in range(module.num_experts) for p in parts]
    assert isinstance(part, int)
    if expert >= module.num_experts or tuple(tensor.shape) != module.checkpoint_shape(part):
        raise ValueError(f"checkpoint tensor {name!r} {tuple(tensor.shape)} does not fit the model's experts")
    module.load_expert(expert, part, tensor)
    return [(path, "expert", expert * 3 + part)]


def _load_part(module: SlotLinear | VocabEmbedding, attr: str, shard: int, tensor: torch.Tensor) -> None:
    if isinstance(module, SlotLinear):
        module.load_shard(attr, shard, tensor)
        return
    rows = module.weight.data[: tensor.shape[0]]  # short of the table at the vocabulary's padded end
    if attr != "weight" or rows.shape != tensor.shape:
        raise ValueError(f"checkpoint embedding {attr} {tuple(tensor.shape)} does not fit {tuple(rows.shape)}")
    rows.copy_(tensor)


def _map_module(module_name: str) -> tuple[str, int]:
    prefix, _, tail = module_name.rpartition(".")
    prefix2, _, tail2 = prefix.rpartition(".")
    fused = _FUSED.get(f"{tail2}.{tail}")
    if fused is None:
        return module_name, 0
    return f"{prefix2}.{fused[0]}", fused[1]


def expected_weight_keys(model: LlamaForCausalLM) -> set[WeightKey]:
    keys: set[WeightKey] = set()
    for module_name, module in model.named_modules():
        if module_name == "lm_head" and model.cfg.tie_word_embeddings:
            continue
        if isinstance(module, moe.Experts):
            keys.update((module_name, "expert", i) for i in range(module.num_experts * 3))
            continue
        for attr, _param in module.named_parameters(recurse=False):
            num_shards = len(module.output_sizes) if isinstance(module, SlotLinear) else 1
            keys.update((module_name, attr, shard) for shard in range(num_shards))
    return keys
