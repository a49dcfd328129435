"""How the model is split over the tensor-parallel ranks, as one line: what the event-log header
records (EngineConfig.tp_layout) beside tensor_parallel_size, and what the launcher checks the
checkpoint against before any process starts. The split is Megatron-LM's, as vLLM does it:
column-parallel q/k/v and gate/up, row-parallel o and down, the vocabulary (embedding and
lm_head) in contiguous row blocks; each rank holds heads / N query heads, and KV heads / N KV
heads when N divides them, else one KV head held by N / KV heads ranks."""

from __future__ import annotations

SPLIT_RULE = "megatron: column q,k,v,gate,up; row o,down; vocab rows embed,lm_head"


def tp_layout(hf_config: dict, num_ranks: int) -> str:
    """The layout line for `num_ranks` ranks of the checkpoint whose config.json is `hf_config`
    ("" for one rank: nothing is split); ValueError naming the dimension when the ranks cannot split it."""
    if num_ranks < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {num_ranks}")
    if num_ranks == 1:
        return ""
    missing = [key for key in ("num_attention_heads", "intermediate_size") if key not in hf_config]
    if missing:
        raise ValueError(f"--tensor-parallel-size {num_ranks}: the model's config.json has no {', '.join(missing)}")
    num_heads = int(hf_config["num_attention_heads"])
    num_kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
    intermediate = int(hf_config["intermediate_size"])
    for what, n in (("num_attention_heads", num_heads), ("intermediate_size", intermediate)):
        if n % num_ranks:
            raise ValueError(f"--tensor-parallel-size {num_ranks} does not divide the model's {what} ({n})")
    if num_kv_heads % num_ranks and num_ranks % num_kv_heads:
        raise ValueError(
            f"--tensor-parallel-size {num_ranks} and the model's num_key_value_heads ({num_kv_heads}): "
            "one must divide the other"
        )
    return f"tp={num_ranks} {SPLIT_RULE}; {_heads(num_heads, num_kv_heads, num_ranks)}"


def _heads(num_heads: int, num_kv_heads: int, num_ranks: int) -> str:
    per_rank = f"heads {num_heads} -> {num_heads // num_ranks}/rank"
    if num_kv_heads % num_ranks == 0:
        return f"{per_rank}; kv heads {num_kv_heads} -> {num_kv_heads // num_ranks}/rank (split)"
    return f"{per_rank}; kv heads {num_kv_heads} -> 1/rank (each on {num_ranks // num_kv_heads} ranks: replicated)"
