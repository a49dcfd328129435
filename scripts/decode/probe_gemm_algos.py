"""Time F.linear and every cuBLASLt heuristic candidate at Llama-3-8B's decode GEMM shapes.

Each shape runs as a CUDA graph of a chain of distinct random weights (so weights stream from
HBM, as in a step), the same timing kernels/gemm_tuning.py does at startup over the model's
own weights. Prints and writes JSON: per shape, F.linear's time, the heuristic's first pick
and every candidate's (null: it failed or its output strayed from F.linear's).
"""

from __future__ import annotations

import argparse
import json

import torch

from ledgerserve.kernels import cublaslt
from ledgerserve.kernels.gemm_tuning import time_shape
from scripts.common.report_files import write_json

# name: (n, k, slices) of Llama-3-8B's decode projections; stacked LoRA adds slots * slices * rank rows of A
PROJ = {"qkv": (6144, 4096, 3), "o": (4096, 4096, 1), "gate_up": (28672, 4096, 2), "down": (4096, 14336, 1)}


def probe(m: int, n: int, k: int, chain: int) -> dict:
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(chain)]
    shape = cublaslt.GemmShape(m, n, k, n, torch.bfloat16)
    linear_us, candidate_us = time_shape(shape, weights, cublaslt.candidates(shape, 0))
    del weights
    torch.cuda.empty_cache()
    return dict(
        m=m,
        n=n,
        k=k,
        linear_us=round(linear_us, 2),
        candidates_us=[None if us is None else round(us, 2) for us in candidate_us],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="32")
    p.add_argument("--slots", default="0,4,32")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--chain", type=int, default=32)
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    for m in [int(v) for v in args.m.split(",")]:
        for slots in [int(v) for v in args.slots.split(",")]:
            for name, (n, k, slices) in PROJ.items():
                row = dict(proj=name, slots=slots, **probe(m, n + slots * slices * args.rank, k, args.chain))
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        write_json(args.out, {"device": torch.cuda.get_device_name(), "rows": rows}, indent=1)


if __name__ == "__main__":
    main()
