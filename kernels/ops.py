"""One import for the model's hot ops: Triton on half-precision CUDA tensors, the torch references
otherwise (CPU, and float32 anywhere: exact checks). The model calls these ops only; this is the
one place that chooses between the two.

Each op has the same signature on both paths (see kernels/attention_ref.py and
kernels/fused_ref.py for the semantics). Triton is imported only if installed, so this
module loads on CPU-only machines without it.
"""

from __future__ import annotations

import torch

from ledgerserve.kernels import gemm_tuning as _gemm_tuning
from ledgerserve.kernels import lora_ref
from ledgerserve.kernels.attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv
from ledgerserve.kernels.embedding_ref import vocab_embedding_ref
from ledgerserve.kernels.fused_ref import (
    apply_rope_ref,
    fused_add_rms_norm_ref,
    rms_norm_ref,
    rope_and_write_kv_ref,
    silu_and_mul_ref,
)
from ledgerserve.kernels.lora_types import LoraDelta, LoraLayout, Segments, SlotWeights, Tiles
from ledgerserve.kernels.moe_ref import fused_moe_ref, route
from ledgerserve.kernels.peer_buffers import PeerBuffers, RowSend

__all__ = [
    "all_reduce_add_rms_norm",
    "apply_rope",
    "argmax",
    "fused_add_rms_norm",
    "fuses_all_reduce_norm",
    "fused_moe",
    "linear",
    "lora_expand",
    "lora_expand_stacked",
    "lora_shrink",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rope_and_write_kv",
    "rope_cos_sin_cache",
    "row_send",
    "silu_and_mul",
    "vocab_embedding",
    "write_kv",
]

try:
    from ledgerserve.kernels import all_reduce_norm as _all_reduce_norm
    from ledgerserve.kernels import argmax as _argmax
    from ledgerserve.kernels import embedding as _embedding
    from ledgerserve.kernels import fused as _fused
    from ledgerserve.kernels import fused_moe as _fused_moe
    from ledgerserve.kernels import gemv as _gemv
    from ledgerserve.kernels import lora as _lora
    from ledgerserve.kernels import lora_delta as _lora_delta
    from ledgerserve.kernels import moe_route as _moe_route
    from ledgerserve.kernels import paged_attention as _decode
    from ledgerserve.kernels import prefill_attention as _prefill

    HAS_TRITON = True
except ImportError:  # no triton on this machine: the references serve every call
    HAS_TRITON = False


TRITON_DTYPES = (torch.bfloat16, torch.float16)  # the model's dtypes that run the Triton kernels


def use_triton(x: torch.Tensor) -> bool:
    return HAS_TRITON and x.is_cuda and x.dtype in TRITON_DTYPES


def paged_decode_attention(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    fn = _decode.paged_decode_attention if use_triton(q) else paged_decode_attention_ref
    return fn(q, k_cache, v_cache, block_tables, seq_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    scale: float,
    max_query_len: int | None = None,
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,  # kernels/attention_tiles.py's table, on the device
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    fn = _prefill.paged_prefill_attention if use_triton(q) else paged_prefill_attention_ref
    return fn(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len, tiles)


GEMV_MAX_N = 65536  # lm_head-sized GEMVs stay on cuBLAS, which streams them at full bandwidth


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, row_send: RowSend | None = None
) -> torch.Tensor:
    """F.linear; one half-precision CUDA row (batch-1 decode) goes through the Triton GEMV, more
    rows through the cuBLASLt algorithm kernels/gemm_tuning.py chose for the shape, if any.
    `row_send`: the GEMV also sends the row to the peers (only what ops.row_send gave for x and weight)."""
    if _takes_gemv(x, weight):
        return _gemv.gemv(x, weight, bias, row_send=row_send)
    assert row_send is None
    if (
        x.is_cuda
        and bias is None
        and x.dim() == 2
        and x.dtype in TRITON_DTYPES
        and x.is_contiguous()
        and weight.is_contiguous()
        and _gemm_tuning.enabled()
    ):
        return _gemm_tuning.linear(x, weight)  # the algorithm timed fastest for this shape (decode graphs)
    return torch.nn.functional.linear(x, weight, bias)


def vocab_embedding(ids: torch.Tensor, weight: torch.Tensor, first_row: int) -> torch.Tensor:
    """ids [num_tokens] -> [num_tokens, hidden]: a vocabulary-parallel shard's rows
    (weight [num_rows, hidden] holds rows first_row ..), zeros for the ids another shard holds."""
    fn = _embedding.vocab_embedding if use_triton(weight) and ids.is_cuda else vocab_embedding_ref
    return fn(ids, weight, first_row)


def _takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        use_triton(x)
        and x.dim() == 2
        and x.shape[0] == 1
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and weight.shape[0] <= GEMV_MAX_N
    )


def row_send(
    x: torch.Tensor,  # [num_tokens, in]
    weight: torch.Tensor,  # [out (+ stacked A rows), in]
    num_cols: int,  # the row's columns: hidden
    lora: SlotWeights | None,  # the stacked slots' weights, whose delta the fused norm will add
    peers: PeerBuffers | None,
    part: int,
) -> RowSend | None:
    """Where linear(x, weight) sends its output row for the fused all-reduce norm of `part` to
    consume, if both can: linear takes the GEMV, whose programs cover the row's packets, and that
    norm takes the row (its shapes alone); None otherwise, and the norm's own program sends it."""
    if peers is None or not _takes_gemv(x, weight) or not _gemv.sends_row(*weight.shape, num_cols):
        return None
    r_pad, num_slices = (0, 1) if lora is None else (_lora_delta.weights_rank_pad(lora), len(lora.output_sizes))
    takes = _all_reduce_norm.takes(peers, 1, num_cols, x.dtype, r_pad, num_slices)
    return RowSend(peers, part, num_cols) if takes else None


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [num_rows, n_cols] float32 -> [num_rows] int64, the first index of each row's max."""
    if HAS_TRITON and x.is_cuda and x.dim() == 2 and x.dtype == torch.float32 and x.stride(-1) == 1 and x.shape[1] > 0:
        return _argmax.argmax(x)
    return x.argmax(dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., hidden]
    return (_fused.rms_norm if use_triton(x) else rms_norm_ref)(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, delta: LoraDelta | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # normed, new_residual: [num_tokens, hidden]
    """`delta`: x's pending LoRA delta (kernels/lora_types.LoraDelta), added to x first."""
    return (_fused.fused_add_rms_norm if use_triton(x) else fused_add_rms_norm_ref)(x, residual, weight, eps, delta)


def fuses_all_reduce_norm(x: torch.Tensor, delta: LoraDelta | None, peers: PeerBuffers) -> bool:
    """Whether all_reduce_add_rms_norm takes this rank's partial x [num_tokens, hidden] (+ delta)."""
    return use_triton(x) and _all_reduce_norm.fits(peers, x, delta)


def all_reduce_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    delta: LoraDelta | None,
    peers: PeerBuffers,
    part: int,
    x_sent: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed, new_residual: [num_tokens, hidden]
    """fused_add_rms_norm of x and its delta's h summed over the ranks, in one kernel that is the
    all-reduce too (kernels/all_reduce_norm.py); only where fuses_all_reduce_norm holds. Without a
    residual, the new residual is x's sum. `part`: which part of the peers' buffer; consecutive
    calls take different parts. `x_sent`: x's GEMV sent it already (under row_send's RowSend)."""
    return _all_reduce_norm.all_reduce_add_rms_norm(x, residual, weight, eps, delta, peers, part, x_sent)


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """In place; cos_sin_cache from rope_cos_sin_cache."""
    (_fused.apply_rope if use_triton(q) else apply_rope_ref)(q, k, positions, cos_sin_cache)


def rope_cos_sin_cache(
    inv_freq: torch.Tensor,  # [head_dim // 2] float32
    max_position: int,
) -> torch.Tensor:  # [max_position, head_dim] float32: cos in the first half, sin in the second
    """The rotation angles' float32 cos and sin at every position, as the RoPE ops take them."""
    positions = torch.arange(max_position, device=inv_freq.device).float()
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def rope_and_write_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    kv_slots: torch.Tensor,  # [num_tokens] int64 flat cache slot of each token
) -> None:
    """apply_rope then write_kv of the rotated k and v, one kernel on CUDA."""
    fn = _fused.rope_and_write_kv if use_triton(q) else rope_and_write_kv_ref
    fn(q, k, v, positions, cos_sin_cache, k_cache, v_cache, kv_slots)


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    top_k: int,
    renormalize: bool,
) -> torch.Tensor:  # [num_tokens, hidden]
    """The sparse MLP: route (softmax, top-k, renormalised where the model does), then the experts."""
    if use_triton(x):
        weights, ids = _moe_route.route(router_logits, top_k, renormalize)
        return _fused_moe.fused_moe(x, w13, w2, weights, ids)
    weights, ids = route(router_logits, top_k, renormalize)
    return fused_moe_ref(x, w13, w2, weights, ids)


def silu_and_mul(x: torch.Tensor, delta: LoraDelta | None = None) -> torch.Tensor:  # [num_tokens, 2 * d] -> [.., d]
    """`delta`: x's pending LoRA delta over the slices gate and up."""
    return (_fused.silu_and_mul if use_triton(x) else silu_and_mul_ref)(x, delta)


# Multi-LoRA (kernels/lora_ref.py has the contract): Triton for half-precision CUDA tensors, which
# wants its Segments on the device; the references read ranks from the host tables. The layout
# struct names the kernels; worker_proc/lora/layout.py decides which one a layer runs.


def use_triton_lora(x: torch.Tensor) -> bool:
    return use_triton(x) and x.dtype in (torch.bfloat16, torch.float16)


def lora_shrink(x: torch.Tensor, weights: SlotWeights, layout: LoraLayout) -> torch.Tensor:
    """x [num_tokens, in] -> buf [num_slices, num_tokens, max_rank], x A^T of each token's slot."""
    impl = _lora if use_triton_lora(x) else lora_ref
    if isinstance(layout, Segments):
        return impl.lora_shrink_segments(x, weights, layout)
    if isinstance(layout, Tiles):
        return impl.lora_shrink_grouped(x, weights, layout)
    return impl.lora_shrink_tokens(x, weights, layout)


def lora_expand(y: torch.Tensor, buf: torch.Tensor, weights: SlotWeights, layout: LoraLayout) -> None:
    """y [num_tokens, sum(output_sizes)] += buf B^T * scaling of each token's slot, in place."""
    impl = _lora if use_triton_lora(y) else lora_ref
    if isinstance(layout, Segments):
        impl.lora_expand_segments(y, buf, weights, layout)
    elif isinstance(layout, Tiles):
        impl.lora_expand_grouped(y, buf, weights, layout)
    else:
        impl.lora_expand_tokens(y, buf, weights, layout)


def lora_expand_stacked(y: torch.Tensor, h: torch.Tensor, weights: SlotWeights, tiles: Tiles) -> None:
    """lora_expand from the shrink of every slot, h [num_tokens, max_loras, num_slices, max_rank]."""
    (_lora.lora_expand_stacked if use_triton_lora(y) else lora_ref.lora_expand_stacked)(y, h, weights, tiles)
