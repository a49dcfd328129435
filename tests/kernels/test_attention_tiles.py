"""The prefill attention kernel's tile table: every query row of every request in exactly one
tile, in request order, within the bound a CUDA graph's bucket is sized by."""

from __future__ import annotations

import random

import pytest

from ledgerserve.kernels.attention_tiles import BLOCK_M, attention_tiles, max_attention_tiles, queries_per_tile


def _offsets(q_lens: list[int]) -> list[int]:
    out = [0]
    for n in q_lens:
        out.append(out[-1] + n)
    return out


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("seed", range(10))
def test_every_query_row_in_one_tile_within_the_bound(seed: int, group: int) -> None:
    rng = random.Random(seed)
    q_lens = [rng.choice([0, 1, 1, 15, 16, 17, 63, 64, 65, rng.randint(1, 700)]) for _ in range(rng.randint(1, 40))]
    starts = _offsets(q_lens)
    num_tiles = max_attention_tiles(starts[-1], len(q_lens), group)
    reqs, firsts = attention_tiles(starts, num_tiles, group)
    assert len(reqs) == len(firsts) == num_tiles
    per_tile = queries_per_tile(group)
    assert per_tile * group <= BLOCK_M < (per_tile + 1) * group  # the group's heads fill the rows
    covered = [(req, m0 + i) for req, m0 in zip(reqs, firsts) if req >= 0 for i in range(per_tile)]
    rows = [(req, i) for req, n in enumerate(q_lens) for i in range(n)]
    assert sorted(r for r in covered if r[1] < q_lens[r[0]]) == rows  # each row once
    real = [r for r in reqs if r >= 0]
    assert real == sorted(real)  # request order
    assert all(req == -1 and m0 == 0 for req, m0 in zip(reqs[len(real) :], firsts[len(real) :]))


def test_a_table_too_small_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        attention_tiles([0, 65, 66], 2, 1)  # 2 tiles for the first request, 1 for the second
    assert attention_tiles([0, 65, 66], 3, 1) == ([0, 0, 1], [0, BLOCK_M, 0])
    assert attention_tiles([0, 17, 18], 3, 4) == ([0, 0, 1], [0, 16, 0])  # 16 queries x 4 heads a tile
    with pytest.raises(ValueError, match="do not fit a tile"):
        queries_per_tile(BLOCK_M + 1)
