"""Benchmark fixtures: a Llama-3-8B-shaped config.json (for --load-format dummy), with a
tokenizer beside it when it is to be served, random PEFT-format rank-r adapters (on all seven
projections by default), and the bytes a decode step reads."""

from __future__ import annotations

import json
import os
import shutil
import time

import torch
from safetensors.torch import save_file

from ledgerserve.shared.adapter_digest import content_sha256
from ledgerserve.shared.adapter_format import CONFIG_FILE, TARGET_KINDS, WEIGHTS_FILE, BaseShapes
from ledgerserve.worker_proc.models.moe import SparseMoeBlock

SEVEN = list(TARGET_KINDS[:7])
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


QWEN3_30B_A3B = {  # 48 layers of 128 experts, 8 routed a token, each of intermediate size 768
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MODEL_SHAPES = {"llama3-8b": LLAMA3_8B, "qwen3-30b-a3b": QWEN3_30B_A3B}


def write_model_dir(root: str, hf_config: dict | None = None) -> str:
    """A checkpoint directory holding only config.json (for --load-format dummy); Llama-3-8B's by default."""
    hf_config = hf_config or LLAMA3_8B
    path = os.path.join(root, f"{hf_config['model_type']}-dummy")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config, f)
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_served_model_dir(root: str, tokenizer_dir: str, hf_config: dict | None = None) -> str:
    """write_model_dir, plus the tokenizer files of `tokenizer_dir` (e.g. the demo model's),
    so that the server can run it with --load-format dummy."""
    path = write_model_dir(root, hf_config)
    for name in TOKENIZER_FILES:
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(path, name))
    return path


def _module_path(kind: str, layer: int) -> str:
    group = "self_attn" if kind in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{group}.{kind}"


def write_adapter(
    root: str, index: int, base: BaseShapes, rank: int, device: str, targets: list[str] | None = None
) -> str:
    """A random PEFT LoRA adapter (rank `rank`, alpha 2*rank) on `targets` (default: all seven
    projections the base has: a mixture-of-experts layer's MLP takes none; lm_head is not supported here)."""
    kinds = {kind for _, kind, _ in base.module_names()}
    targets = [k for k in SEVEN if k in kinds] if targets is None else list(targets)
    if not targets or not set(targets) <= set(SEVEN):
        raise ValueError(f"adapter targets must be a non-empty subset of {SEVEN}, got {targets}")
    path = os.path.join(root, f"adapter-{index}")
    os.makedirs(path, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(1000 + index)
    tensors = {}
    for _, kind, layer in base.module_names():
        if kind in targets:
            in_f, out_f = base.in_out(kind)
            a = torch.randn(rank, in_f, generator=gen, device=device) * in_f**-0.5
            b = torch.randn(out_f, rank, generator=gen, device=device) * 0.01
            tensors[f"{_module_path(kind, layer)}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
            tensors[f"{_module_path(kind, layer)}.lora_B.weight"] = b.to(torch.bfloat16).cpu()
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": targets,
        "bias": "none",
        "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM",
    }
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


def link_adapter(src: str, dst: str, alpha: float) -> None:
    """Another adapter version sharing `src`'s weight file (a hard link), with its own config."""
    os.makedirs(dst, exist_ok=True)
    os.link(os.path.join(src, WEIGHTS_FILE), os.path.join(dst, WEIGHTS_FILE))
    with open(os.path.join(src, CONFIG_FILE), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(dst, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump({**config, "lora_alpha": alpha}, f)


def adapter_bytes(base: BaseShapes, rank: int, elem_bytes: int = 2) -> int:
    """Bytes of one adapter's A and B over all layers and seven projections."""
    per_layer = sum(rank * sum(base.in_out(kind)) for kind in SEVEN)
    return per_layer * base.num_layers * elem_bytes


def weight_bytes(model: torch.nn.Module, batch: int) -> int:
    """Parameter bytes a step reads: all but the embedding table, of which only `batch` rows; of a
    sparse MLP's experts, those `batch` tokens are expected to route to (each choosing top_k of E
    at random: E * (1 - (1 - top_k / E) ** batch) distinct experts)."""
    emb = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            experts = sum(p.numel() * p.element_size() for p in block.experts.parameters())
            total -= round(experts * (1 - block.top_k / block.experts.num_experts) ** batch)
    return total - emb.numel() * emb.element_size() + batch * emb.shape[1] * emb.element_size()


def kv_bytes(base: BaseShapes, num_layers: int, seq_lens: list[int], elem_bytes: int = 2) -> int:
    """K and V bytes attention reads over every layer for these sequence lengths."""
    return 2 * num_layers * base.kv_size * elem_bytes * sum(seq_lens)


def copy_bandwidth(device: torch.device, num_bytes: int = 2 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written
    (host_copy_bandwidth's on the CPU)."""
    if device.type != "cuda":
        return host_copy_bandwidth()
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * num_bytes * iters / (start.elapsed_time(end) / 1e3)


def adapter_digest(path: str) -> str:
    """The content digest the HTTP process would record when registering the adapter at `path`."""
    with open(os.path.join(path, CONFIG_FILE), "rb") as c, open(os.path.join(path, WEIGHTS_FILE), "rb") as w:
        return content_sha256(c.read(), w.read())


def host_copy_bandwidth(num_bytes: int = 64 << 20, iters: int = 5) -> float:
    """CPU memory copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (num_bytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    return 2 * num_bytes * iters / (time.perf_counter() - t0)
