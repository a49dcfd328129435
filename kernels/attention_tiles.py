"""The tile table of the prefill attention kernel (kernels/prefill_attention.py), built on the
host: one row per BLOCK_M queries of one request. Sized for a CUDA graph's bucket
(`max_attention_tiles`) and padded with request -1, it fixes the kernel's grid for every batch
that fits the bucket, whatever its mix of prompt chunks and decodes."""

from __future__ import annotations

BLOCK_M = 64  # queries per program of the prefill attention kernel


def max_attention_tiles(num_tokens: int, num_reqs: int) -> int:
    """Rows the table needs at most for `num_tokens` queries over `num_reqs` requests:
    sum of ceil(q_len / BLOCK_M) <= ceil(num_tokens / BLOCK_M) + num_reqs."""
    return -(-num_tokens // BLOCK_M) + num_reqs


def attention_tiles(query_start_loc: list[int], num_tiles: int) -> tuple[list[int], list[int]]:
    """(request, first query row within the request) of each tile, in request order, padded to
    `num_tiles` rows with (-1, 0). query_start_loc: [num_reqs + 1] offsets of each request's queries."""
    reqs: list[int] = []
    starts: list[int] = []
    for req, (a, b) in enumerate(zip(query_start_loc, query_start_loc[1:])):
        for m0 in range(0, b - a, BLOCK_M):
            reqs.append(req)
            starts.append(m0)
    if len(reqs) > num_tiles:
        raise ValueError(f"{len(reqs)} attention tiles do not fit a table of {num_tiles}")
    pad = num_tiles - len(reqs)
    return reqs + [-1] * pad, starts + [0] * pad
