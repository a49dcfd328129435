"""All-reduce time against size at tensor parallel N, through each path the engine can take: the
one-shot all-reduce over CUDA symmetric memory and NCCL's (gloo's on the CPU, where one-shot does
not exist). Each size's calls run back to back as a step's do, on CUDA replayed from one CUDA
graph. The size where one-shot stops beating NCCL is where worker_proc/parallel.ONE_SHOT_MAX_BYTES
belongs; a prefill chunk of T tokens all-reduces T x hidden x 2 bytes (bf16) twice a layer.

    python -m scripts.decode.bench_all_reduce --tensor-parallel-size 2 --out all_reduce.json
    python -m scripts.decode.bench_all_reduce --tensor-parallel-size 2 --device cpu --sizes-kib 16,256
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence

import torch

from ledgerserve.worker_proc.parallel import TpGroup, close_group, with_one_shot
from scripts.decode.bench_decode_tp import RESULT_FILE, run_ranks, start_rank, time_all_reduces

DEFAULT_SIZES_KIB = "16,64,256,1024,2048,4096,8192,16384"
NUM_CALLS = 65  # a Llama-3-8B step's: two a layer and the embedding's


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--sizes-kib", default=DEFAULT_SIZES_KIB, help="bytes of one all-reduce, in KiB, comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    args.sizes = [int(kib) << 10 for kib in args.sizes_kib.split(",")]
    if args.tensor_parallel_size < 2:
        p.error("--tensor-parallel-size must be at least 2")
    return args


def rank_main() -> None:
    """One rank: `--run-dir D --tp-rank R` then this script's own flags."""
    own, args, device, group = start_rank(parse_args)
    try:
        rows = sweep(group, device, getattr(torch, args.dtype), args.sizes)
    finally:
        close_group(group)
    if own.tp_rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        report = dict(device=name, torch=torch.__version__, tensor_parallel_size=group.size, rows=rows)
        with open(os.path.join(own.run_dir, RESULT_FILE), "w", encoding="utf-8") as f:
            json.dump(report, f)


def sweep(group: TpGroup, device: torch.device, dtype: torch.dtype, sizes: list[int]) -> list[dict]:
    """Per size: µs a call through the collective library, and one-shot (None where it is not had)."""
    one_shot = with_one_shot(group, dtype, device, max_bytes=max(sizes))
    library = dataclasses.replace(group, one_shot=None)
    rows = []
    for num_bytes in sizes:
        x = torch.ones(num_bytes // dtype.itemsize, dtype=dtype, device=device)  # [num_bytes / itemsize]
        row = dict(bytes=num_bytes, library_us=_us_a_call(library, x))
        row["one_shot_us"] = _us_a_call(one_shot, x) if one_shot.one_shot is not None else None
        rows.append(row)
        if group.rank == 0:
            print(json.dumps(row), flush=True)
    return rows


def _us_a_call(group: TpGroup, x: torch.Tensor) -> float:
    return round(time_all_reduces(group, x, NUM_CALLS) / NUM_CALLS * 1e6, 2)


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    report = run_ranks(argv, args.tensor_parallel_size, module="scripts.decode.bench_all_reduce")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    if "--tp-rank" in sys.argv:
        rank_main()
    else:
        main()
