from __future__ import annotations

import pytest
import torch

from ledgerserve.shared.config import EngineConfig
from ledgerserve.worker_proc.kv_cache import CPU_KV_BUDGET_BYTES, KVCache, bytes_per_block, num_kv_blocks
from ledgerserve.worker_proc.models.config import parse_model_config

RAW = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
CPU = torch.device("cpu")


def _config(**kw) -> EngineConfig:
    return EngineConfig(model_dir="x", served_model_name="x", **{"max_model_len": 100, **kw})


def test_explicit_num_blocks_wins() -> None:
    cfg = parse_model_config(RAW)
    assert num_kv_blocks(_config(num_kv_blocks=7), cfg, torch.float32, CPU) == 7


def test_cpu_default_covers_max_num_seqs() -> None:
    cfg = parse_model_config(RAW)
    # ceil(100 / 16) = 7 blocks per request
    assert num_kv_blocks(_config(max_num_seqs=3), cfg, torch.float32, CPU) == 21


def test_cpu_default_capped_by_budget() -> None:
    cfg = parse_model_config(
        {**RAW, "num_hidden_layers": 64, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 4}
    )
    config = _config(max_model_len=4096, max_num_seqs=512)
    expected = CPU_KV_BUDGET_BYTES // bytes_per_block(cfg, 16, torch.float32)
    assert num_kv_blocks(config, cfg, torch.float32, CPU) == expected


def test_too_small_budget_raises() -> None:
    cfg = parse_model_config({**RAW, "num_hidden_layers": 512, "hidden_size": 8192, "num_key_value_heads": 4})
    with pytest.raises(ValueError, match="fewer than one"):
        num_kv_blocks(_config(max_model_len=32768), cfg, torch.float32, CPU)


def test_cache_shapes() -> None:
    cfg = parse_model_config(RAW)
    cache = KVCache(cfg, num_blocks=5, block_size=8, dtype=torch.float32, device=CPU)
    assert len(cache.layers) == 2
    assert cache.layers[0][0].shape == (5, 8, 2, 16)
