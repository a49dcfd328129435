"""Triton row argmax for the sampler's greedy choice: [num_rows, vocab] float32 -> [num_rows] int64.

torch's argmax gives each row one block, so a 128K-vocabulary row takes ~26 us on an H200
however few rows there are. Here each row is split into CHUNK-column pieces: a first launch
writes each piece's max and its first index, a second picks, per row, the first index of
the largest. Ties resolve to the lowest index, as in torch. As in torch, NaN counts as larger
than any number: a row holding one gives its first NaN's index, so a row of NaN logits (an
adapter's garbage) still gives a token id inside the vocabulary. Reference: torch.argmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # columns per program of the first pass: 32 programs a row at a 128K vocabulary
INDEX_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _first_max(x, idx):
    """(the max of x [N], NaN above all; the lowest of idx [N] where x is it)."""
    is_nan = x != x
    has_nan = tl.max(is_nan.to(tl.int32), axis=0) > 0
    best = tl.max(tl.where(is_nan, float("-inf"), x), axis=0)
    hit = tl.where(has_nan, is_nan, x == best)
    return tl.where(has_nan, float("nan"), best), tl.min(tl.where(hit, idx, INDEX_MAX), axis=0)


@triton.jit
def _chunk_argmax_kernel(x_ptr, val_ptr, idx_ptr, n_cols, stride_x, num_chunks, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < n_cols, other=float("-inf"))
    best, first = _first_max(x, cols)
    tl.store(val_ptr + row * num_chunks + chunk, best)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


@triton.jit
def _merge_argmax_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, CHUNKS_PAD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)  # [CHUNKS_PAD]
    mask = c < num_chunks
    vals = tl.load(val_ptr + row * num_chunks + c, mask=mask, other=float("-inf"))
    idxs = tl.load(idx_ptr + row * num_chunks + c, mask=mask, other=INDEX_MAX)
    _, first = _first_max(vals, idxs)
    tl.store(out_ptr + row, first.to(tl.int64))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [num_rows, n_cols] float32, unit column stride -> [num_rows] int64, the first index of each row's max."""
    num_rows, n_cols = x.shape
    assert x.stride(-1) == 1 and 0 < n_cols < 2**31 - 1
    num_chunks = triton.cdiv(n_cols, CHUNK)
    vals = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=x.device)
    idxs = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=x.device)
    out = torch.empty(num_rows, dtype=torch.long, device=x.device)
    if num_rows:
        _chunk_argmax_kernel[(num_rows, num_chunks)](
            x, vals, idxs, n_cols, x.stride(0), num_chunks, CHUNK=CHUNK, num_warps=8
        )
        _merge_argmax_kernel[(num_rows,)](
            vals, idxs, out, num_chunks, CHUNKS_PAD=triton.next_power_of_2(num_chunks), num_warps=1
        )
    return out
