"""Tensor parallelism on the CPU (gloo, fp32): two real rank processes, each holding its shard of a
tiny checkpoint and of three LoRA adapters (read from disk into its CPU tier, which keeps only its
shard, then copied into its slots), give the logits of the unsharded model (one rank) for a batch
of base and adapter requests mixed over chunked prefill and decode (tests/worker_proc/tp_rank.py
runs each rank); each rank holds half of the weights and of the KV heads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from ledgerserve.worker_proc.models.config import load_model_config
from tests.adapter_factory import make_peft_adapter
from tests.model_factory import MOE_ARCHS, make_tiny_checkpoint
from tests.worker_proc.lora_setup import ALL_SEVEN

ADAPTERS = [
    dict(r=4, alpha=8, targets=ALL_SEVEN + ["lm_head"], seed=11),
    dict(r=16, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"], use_rslora=True, seed=12),
    dict(r=32, alpha=48, targets=ALL_SEVEN, rank_pattern={"k_proj": 8}, alpha_pattern={"down_proj": 16}, seed=13),
]
# the experts take no adapter yet (PEFT turns MLP targets on a MoE model into target_parameters)
MOE_ADAPTERS = [
    dict(r=4, alpha=8, targets=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"], seed=11),
    dict(r=16, alpha=16, targets=["q_proj", "v_proj"], use_rslora=True, seed=12),
]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_ranks(size: int, spec_path: str, run_dir: str) -> None:
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": ROOT}
    script = [sys.executable, "-m", "tests.worker_proc.tp_rank"]
    procs = [
        subprocess.Popen(
            [*script, str(rank), str(size), run_dir, spec_path], env=env, stderr=subprocess.PIPE, text=True
        )
        for rank in range(size)
    ]
    errors = [proc.communicate(timeout=300)[1] for proc in procs]
    for rank, (proc, err) in enumerate(zip(procs, errors)):
        assert proc.returncode == 0, f"rank {rank} of {size} failed:\n{err[-4000:]}"


# llama: GQA with 2 KV heads; qwen3: per-head q/k norm, tied embeddings, and a vocabulary of 251 that
# pads to 252 (rank 1 holds 125 rows of the embedding, lm_head and its adapters' B, and a zero row);
# qwen3_moe: every expert cut along its intermediate size, the router replicated, one dense layer
# (the adapters' MLP targets), the one all-reduce per layer of a dense MLP
@pytest.mark.parametrize("arch, vocab_size", [("llama", 256), ("qwen3", 251), ("qwen3_moe", 256)])
def test_two_ranks_give_the_unsharded_logits(arch: str, vocab_size: int, tmp_path) -> None:
    base_dir = make_tiny_checkpoint(arch, tmp_path / "base", vocab_size=vocab_size)
    adapters = MOE_ADAPTERS if arch in MOE_ARCHS else ADAPTERS
    adapter_dirs = [make_peft_adapter(base_dir, tmp_path / f"adapter{i}", **kw) for i, kw in enumerate(adapters)]
    spec_path = str(tmp_path / "spec.json")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump({"base_dir": base_dir, "adapter_dirs": adapter_dirs, "out_dir": str(tmp_path)}, f)
    for size in (1, 2):
        run_dir = tmp_path / f"run{size}"
        run_dir.mkdir()
        _run_ranks(size, spec_path, str(run_dir))
    want = load_file(str(tmp_path / "tp1-rank0.safetensors"))
    ranks = [load_file(str(tmp_path / f"tp2-rank{rank}.safetensors")) for rank in range(2)]
    for step in ("prefill", "mixed", "decode"):
        torch.testing.assert_close(ranks[0][step], want[step], atol=2e-5, rtol=1e-5, msg=f"{arch} {step}")
        assert torch.equal(ranks[0][step], ranks[1][step]), f"{arch} {step}: the ranks' logits differ"
    assert want["decode"].shape[1] == vocab_size
    cfg = load_model_config(base_dir)
    _check_held_bytes(tmp_path, cfg.num_kv_heads, (vocab_size % 2) * cfg.hidden_size * 4, len(adapters))


def _check_held_bytes(out_dir, num_kv_heads: int, padding_bytes: int, num_adapters: int) -> None:
    """Each rank holds half of every sharded weight (with the padded vocabulary's zero row) and all
    of the replicated norms, and half the KV heads; its CPU tier keeps its shard of each adapter,
    less than the whole, the two shards together at least the whole."""
    with open(out_dir / "tp1-rank0.json", encoding="utf-8") as f:
        whole = json.load(f)
    assert whole["num_kv_heads"] == num_kv_heads
    sharded_bytes = whole["weight_bytes"] - whole["norm_bytes"] + padding_bytes
    num_shard_bytes = 0
    for rank in range(2):
        with open(out_dir / f"tp2-rank{rank}.json", encoding="utf-8") as f:
            held = json.load(f)
        assert held["norm_bytes"] == whole["norm_bytes"] > 0
        assert held["weight_bytes"] == sharded_bytes // 2 + whole["norm_bytes"]
        assert held["num_kv_heads"] == num_kv_heads // 2
        assert held["num_adapters"] == whole["num_adapters"] == num_adapters
        assert 0 < held["adapter_bytes"] < whole["adapter_bytes"]
        num_shard_bytes += held["adapter_bytes"]
    assert num_shard_bytes >= whole["adapter_bytes"]
