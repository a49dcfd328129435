"""Paged KV cache: per layer one k and one v tensor of `[num_blocks, block_size, num_kv_heads, head_dim]`,
of this rank's KV heads (`ModelConfig.num_local_kv_heads` of the rank's view): a rank of N holds 1/N of
them (one when they are replicated), so the blocks a memory budget holds grow with N."""

from __future__ import annotations

import torch

from ledgerserve.shared.config import EngineConfig
from ledgerserve.worker_proc.models.config import ModelConfig

CPU_KV_BUDGET_BYTES = 2 * 1024**3


class KVCache:
    def __init__(
        self,
        model_cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        scratch_blocks: int = 0,
    ) -> None:
        """`scratch_blocks` extra blocks past `num_blocks` (ids num_blocks...) take the KV writes of
        CUDA-graph padding rows; the scheduler never sees them."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks + scratch_blocks, block_size, model_cfg.num_local_kv_heads, model_cfg.head_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(model_cfg.num_layers)
        ]


def bytes_per_block(model_cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem_bytes = torch.empty((), dtype=dtype).element_size()
    return 2 * model_cfg.num_layers * block_size * model_cfg.num_local_kv_heads * model_cfg.head_dim * elem_bytes


def num_kv_blocks(config: EngineConfig, model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> int:
    """How many blocks to allocate: config.num_kv_blocks if set, else sized from memory.

    CUDA: what is left of `gpu_memory_utilization * total` after what is in use now (call
    it after the weights are loaded). CPU: a 2 GiB budget. Either way no more than
    max_num_seqs full-length requests can use, so a small model does not get millions of
    blocks the scheduler would have to track. Raises if not even one max_model_len request fits.
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = bytes_per_block(model_cfg, config.block_size, dtype)
    blocks_per_seq = -(-config.max_model_len // config.block_size)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # blocks the caching allocator holds but no tensor uses count as free
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        budget = free_bytes - int(total_bytes * (1.0 - config.gpu_memory_utilization))
        num_blocks = min(config.max_num_seqs * blocks_per_seq, max(budget, 0) // per_block)
    else:
        num_blocks = min(config.max_num_seqs * blocks_per_seq, CPU_KV_BUDGET_BYTES // per_block)
    if num_blocks < blocks_per_seq:
        raise ValueError(
            f"KV cache fits {num_blocks} blocks of {config.block_size} tokens, fewer than one "
            f"max_model_len={config.max_model_len} request needs ({blocks_per_seq}); lower max_model_len "
            "or raise the memory budget"
        )
    return int(num_blocks)
