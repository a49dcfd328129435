"""Triton: the lookup of a vocabulary-parallel embedding shard, one launch for what the torch
reference (kernels/embedding_ref.py) does in eight: one program per token copies its row where this
shard holds the id and writes zeros where another rank's shard does (the all-reduce that follows
sums the one rank that holds it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ledgerserve.kernels.pdl import enabled as pdl_enabled
from ledgerserve.kernels.pdl import wait_for_previous


@triton.jit
def _vocab_embedding_kernel(
    ids_ptr, w_ptr, out_ptr, first_row, num_rows, n_cols, stride_w, stride_out,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    wait_for_previous(PDL)  # the ids are the step's input, copied in by the kernel before
    local = tl.load(ids_ptr + token) - first_row
    held = (local >= 0) & (local < num_rows)
    row = tl.load(w_ptr + tl.where(held, local, 0) * stride_w + cols, mask=mask, other=0.0)  # [BLOCK]
    tl.store(out_ptr + token.to(tl.int64) * stride_out + cols, tl.where(held, row, 0.0), mask=mask)


def vocab_embedding(ids: torch.Tensor, weight: torch.Tensor, first_row: int) -> torch.Tensor:
    """ids: [num_tokens] int64, weight: [num_rows, hidden] (rows first_row ..) -> [num_tokens, hidden]."""
    assert ids.dim() == 1 and weight.dim() == 2 and weight.stride(-1) == 1
    num_rows, hidden = weight.shape
    out = torch.empty(ids.shape[0], hidden, dtype=weight.dtype, device=weight.device)
    if ids.shape[0] > 0:
        block, pdl = triton.next_power_of_2(hidden), pdl_enabled(weight.device)
        _vocab_embedding_kernel[(ids.shape[0],)](
            ids, weight, out, first_row, num_rows, hidden, weight.stride(0), out.stride(0),
            BLOCK=block, PDL=pdl, num_warps=min(16, max(1, block // 256)), launch_pdl=pdl,
        )  # fmt: skip
    return out
