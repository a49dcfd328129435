"""The decode GEMMs' cuBLASLt algorithm, chosen per shape by timing it in the model's own chain.

cuBLAS's heuristic picks one kernel per shape from a model of the GPU, and at decode shapes
it often misses: on an H200 at 32 rows, gate_up stacked with 4 adapters' A (28800 x 4096) ran
61.2 us a layer with its pick and 56.7 us with its second candidate, the base weight's speed
(scripts/decode/probe_gemm_algos.py times any shape). So before the decode
graphs are captured, each GEMM shape the warm-up forward ran is timed: F.linear and each of
cuBLASLt's heuristic candidates, as a CUDA graph over the very weights the model multiplies at
that shape (a chain of distinct layers, streaming from HBM as in a step). The fastest wins if
it beats F.linear by 1%; a candidate whose output strays from F.linear's is never chosen.
ops.linear then dispatches.

LEDGERSERVE_GEMM_TUNING=0 turns it off (every GEMM is F.linear).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from ledgerserve.kernels import cublaslt
from ledgerserve.kernels.cublaslt import GemmShape
from ledgerserve.shared import env

log = logging.getLogger(__name__)

MIN_CHAIN = 8  # GEMMs per timed graph: a shape seen on fewer weights repeats them
MAX_CHAIN = 32
REPS = 5
MIN_GAIN = 0.01  # a candidate must beat F.linear by 1% to replace it

_choices: dict[GemmShape, cublaslt.Algo | None] = {}  # None: F.linear
_timings: dict[GemmShape, tuple[float, float, int | None]] = {}  # F.linear us, chosen us, candidate index
_recorded: dict[GemmShape, list[torch.Tensor]] | None = None


def enabled() -> bool:
    return env.gemm_tuning_wanted()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ weight [n, k]^T -> [m, n]: with the shape's chosen algorithm, else F.linear.
    While recording, notes the shape and its weight for `tune`."""
    shape = GemmShape(x.shape[0], weight.shape[0], x.shape[1], weight.shape[0], x.dtype)
    if _recorded is not None and shape not in _choices:
        seen = _recorded.setdefault(shape, [])
        if len(seen) < MAX_CHAIN and all(w.data_ptr() != weight.data_ptr() for w in seen):
            seen.append(weight)
    algo = _choices.get(shape)
    if algo is None:
        return F.linear(x, weight)
    y = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)  # [m, n]
    cublaslt.matmul_into(y, x, weight, algo)
    return y


@contextlib.contextmanager
def recording() -> Iterator[dict[GemmShape, list[torch.Tensor]]]:
    """Within: ops.linear notes each untuned shape and the weights it multiplies."""
    global _recorded
    _recorded = {}
    try:
        yield _recorded
    finally:
        _recorded = None


def fastest(torch_us: float, candidate_us: Sequence[float | None]) -> int | None:
    """The index of the fastest candidate that beats F.linear's time by MIN_GAIN (None: keep
    F.linear): a near tie in the chain is noise, and the model may order them the other way."""
    best, best_us = None, torch_us * (1 - MIN_GAIN)
    for i, us in enumerate(candidate_us):
        if us is not None and us < best_us:
            best, best_us = i, us
    return best


def tune(recorded: dict[GemmShape, list[torch.Tensor]]) -> dict[GemmShape, tuple[float, float, int | None]]:
    """Choose an algorithm for every recorded shape not chosen yet; returns shape -> (F.linear
    us, chosen us per GEMM, the chosen candidate's index or None for F.linear). A shape whose
    candidates cannot be listed keeps F.linear."""
    timings = {}
    for shape, weights in recorded.items():
        if shape in _choices or not weights:
            continue
        try:
            algos = cublaslt.candidates(shape, weights[0].device.index)
        except cublaslt.CublasLtError as e:
            log.warning("GEMM tuning off for %s: %s", shape, e)
            algos = []
        torch_us, candidate_us = time_shape(shape, weights, algos)
        best = fastest(torch_us, candidate_us)
        _choices[shape] = None if best is None else algos[best]
        timings[shape] = (torch_us, torch_us if best is None else candidate_us[best], best)
    _timings.update(timings)
    return timings


def report() -> list[dict]:
    """Every shape tuned so far: m, n, k and us per GEMM with F.linear and with the choice."""
    return [
        dict(m=s.m, n=s.n, k=s.k, linear_us=round(t[0], 2), chosen_us=round(t[1], 2), candidate=t[2])
        for s, t in sorted(_timings.items(), key=lambda kv: (kv[0].m, kv[0].n, kv[0].k))
    ]


def time_shape(
    shape: GemmShape, weights: list[torch.Tensor], algos: list[cublaslt.Algo]
) -> tuple[float, list[float | None]]:
    """us per GEMM of F.linear and of each algorithm (None: failed, or output off F.linear's)."""
    chain = (weights * -(-MIN_CHAIN // len(weights)))[: max(MIN_CHAIN, len(weights))]
    x = torch.randn(shape.m, shape.k, dtype=shape.dtype, device=weights[0].device)
    y = torch.empty(shape.m, shape.n, dtype=shape.dtype, device=x.device)  # [m, n], rewritten by each GEMM

    def run_torch() -> None:
        for w in chain:
            torch.matmul(x, w.t(), out=y)

    ref = F.linear(x, chain[0]).float()
    tol = 0.02 * max(1.0, ref.abs().max().item())  # a few half-precision ulps: split-K sums round differently
    torch_us = graph_us(run_torch, len(chain))
    candidate_us: list[float | None] = []
    for algo in algos:

        def run(algo: cublaslt.Algo = algo) -> None:
            for w in chain:
                cublaslt.matmul_into(y, x, w, algo)

        try:
            us = graph_us(run, len(chain))
        except (cublaslt.CublasLtError, RuntimeError):
            candidate_us.append(None)
            continue
        cublaslt.matmul_into(y, x, chain[0], algo)
        close = (y.float() - ref).abs().max().item() <= tol
        candidate_us.append(us if close else None)
    return torch_us, candidate_us


def graph_us(run: Callable[[], None], num_gemms: int) -> float:
    """us per GEMM of `run` (num_gemms GEMMs) captured in a CUDA graph, over REPS replays."""
    run()  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPS):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / REPS / num_gemms


def reset() -> None:
    """Forget every choice (tests)."""
    _choices.clear()
    _timings.clear()
