"""Which captured-graph edges pdl.launch_after_block_start moves: plain data, no GPU."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from ledgerserve.kernels.pdl import edges_to_move  # noqa: E402

DEFAULT, PROGRAMMATIC, LAUNCH_COMPLETION = 0, 1, 2  # dependency types / source ports


def test_only_edges_out_of_kernels_that_never_trigger_move() -> None:
    # gemm (1) -> norm (2) -> gemm (3) -> silu (4) -> attention (5), the norm, SiLU and attention
    # launched with PDL; the GEMMs plain (a full edge into each)
    edges = [
        (1, 2, PROGRAMMATIC, PROGRAMMATIC),  # out of a cuBLAS GEMM: moves
        (2, 3, DEFAULT, DEFAULT),  # into a GEMM: a plain edge
        (3, 4, PROGRAMMATIC, PROGRAMMATIC),  # out of a GEMM: moves
        (4, 5, PROGRAMMATIC, PROGRAMMATIC),  # out of a PDL kernel, which triggers its dependents itself
    ]
    assert edges_to_move(edges) == [0, 2]


def test_an_edge_already_moved_stays() -> None:
    assert edges_to_move([(1, 2, PROGRAMMATIC, LAUNCH_COMPLETION)]) == []
