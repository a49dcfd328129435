"""Time the Triton GEMV (kernels/gemv.py) over a grid of its configurations at Llama-3-8B's
batch-1 decode shapes, whole and split over tensor-parallel ranks.

Each (shape, configuration) runs as a CUDA graph of a chain of distinct random weights, so the
weights stream from HBM as in a step (kernels/gemm_tuning.py times cuBLAS the same way), with
PDL as the model launches it. Prints, per shape, the configuration gemv_config picks and the
fastest few, with their bandwidth; writes each shape's default and fastest eight as JSON with --out.

    python -m scripts.decode.probe_gemv_configs --tp 1,2 --out gemv_configs.json
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F

from ledgerserve.kernels import gemv
from ledgerserve.kernels.gemm_tuning import graph_us
from scripts.common.report_files import write_json

# name: (n, k) of Llama-3-8B's projections at TP 1; column-parallel ones split n, row-parallel ones k
# (lm_head: TP 1's is past ops.GEMV_MAX_N and runs on cuBLAS; it is timed here all the same)
PROJ = {
    "qkv": (6144, 4096, "n"),
    "o": (4096, 4096, "k"),
    "gate_up": (28672, 4096, "n"),
    "down": (4096, 14336, "k"),
    "lm_head": (128256, 4096, "n"),
}
BLOCK_N = (2, 4, 8, 16)
BLOCK_K = (512, 1024, 2048, 4096)  # a program loads its first BLOCK_K of W before the previous kernel ends (PDL)
NUM_WARPS = (4, 8)
NUM_STAGES = (1, 2)
CHAIN_BYTES = 1 << 30  # weights per timed graph, far past L2


def shapes(tp_sizes: list[int]) -> list[tuple[str, int, int]]:
    out = []
    for tp, (name, (n, k, split)) in itertools.product(tp_sizes, PROJ.items()):
        out.append((f"{name}/tp{tp}", n // tp if split == "n" else n, k // tp if split == "k" else k))
    return out


def time_config(x: torch.Tensor, chain: list[torch.Tensor], config: tuple[int, int, int, int] | None) -> float:
    """us per GEMV of the chain, captured in one CUDA graph (gemm_tuning's timing)."""

    def run() -> None:
        for w in chain:
            gemv.gemv(x, w, None, config)

    return graph_us(run, len(chain))


def probe(name: str, n: int, k: int, configs: list[tuple[int, int, int, int]]) -> dict:
    num_weights = max(4, CHAIN_BYTES // (2 * n * k))
    chain = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(num_weights)]
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    ref = F.linear(x, chain[0]).float()
    tol = 0.02 * max(1.0, ref.abs().max().item())
    timings = {}
    for config in configs:
        try:
            if (gemv.gemv(x, chain[0], None, config).float() - ref).abs().max().item() > tol:
                continue
            timings[config] = time_config(x, chain, config)
        except Exception as e:  # noqa: BLE001 -- a configuration Triton cannot build is skipped
            print(f"  {name} {config}: {type(e).__name__}")
    default = gemv.gemv_config(n, k)
    gbps = {c: 2 * n * k / (us * 1e-6) / 1e9 for c, us in timings.items()}
    best = sorted(timings, key=timings.get)
    print(f"{name} ({n} x {k}): default {default} {timings.get(default, math.nan):.2f} us")
    for c in best[:4]:
        print(f"   {c}: {timings[c]:.2f} us, {gbps[c]:.0f} GB/s")
    del chain
    torch.cuda.empty_cache()
    return dict(
        shape=name,
        n=n,
        k=k,
        default=list(default),
        default_us=round(timings.get(default, math.nan), 2),
        best=[dict(config=list(c), us=round(timings[c], 2)) for c in best[:8]],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", default="1,2", help="tensor-parallel sizes whose shards to time")
    p.add_argument("--out", default="")
    args = p.parse_args()
    configs = list(itertools.product(BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES))
    rows = [probe(name, n, k, configs) for name, n, k in shapes([int(t) for t in args.tp.split(",")])]
    if args.out:
        write_json(args.out, dict(device=torch.cuda.get_device_name(), rows=rows), indent=1)


if __name__ == "__main__":
    main()
