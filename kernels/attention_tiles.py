"""The tile table of the prefill attention kernel (kernels/prefill_attention.py), built on the
host: one row per `queries_per_tile(group)` queries of one request. A program packs those queries
for every query head of one kv head (GQA) into its BLOCK_M rows, so the heads that share K/V read
it once, and a decode row fills `group` rows of a tile instead of one of 64. Sized for a CUDA
graph's bucket (`max_attention_tiles`) and padded with request -1, the table fixes the kernel's
grid for every batch that fits the bucket, whatever its mix of prompt chunks and decodes."""

from __future__ import annotations

BLOCK_M = 64  # rows per program: query positions x the query heads of one kv head


def queries_per_tile(group: int) -> int:
    """Query positions per program when `group` query heads share each kv head."""
    if not 1 <= group <= BLOCK_M:
        raise ValueError(f"{group} query heads per kv head do not fit a tile of {BLOCK_M} rows")
    return BLOCK_M // group


def max_attention_tiles(num_tokens: int, num_reqs: int, group: int) -> int:
    """Rows the table needs at most for `num_tokens` queries over `num_reqs` requests:
    sum of ceil(q_len / Q) <= ceil(num_tokens / Q) + num_reqs, Q = queries_per_tile(group)."""
    return -(-num_tokens // queries_per_tile(group)) + num_reqs


def attention_tiles(query_start_loc: list[int], num_tiles: int, group: int) -> tuple[list[int], list[int]]:
    """(request, first query row within the request) of each tile, in request order, padded to
    `num_tiles` rows with (-1, 0). query_start_loc: [num_reqs + 1] offsets of each request's queries."""
    step = queries_per_tile(group)
    reqs: list[int] = []
    starts: list[int] = []
    for req, (a, b) in enumerate(zip(query_start_loc, query_start_loc[1:])):
        for m0 in range(0, b - a, step):
            reqs.append(req)
            starts.append(m0)
    if len(reqs) > num_tiles:
        raise ValueError(f"{len(reqs)} attention tiles do not fit a table of {num_tiles}")
    pad = num_tiles - len(reqs)
    return reqs + [-1] * pad, starts + [0] * pad
