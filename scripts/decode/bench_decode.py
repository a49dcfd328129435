"""Offline decode throughput of the worker: ModelRunner driven directly (no IPC) with
Llama-3-8B shapes, dummy bf16 weights, batch sizes 1..256 and 0 / 1 / 4 / 32 distinct
rank-16 adapters on all seven projections. Beside each step time: the memory-bandwidth
floor (weights + adapters + KV read, over the device copy bandwidth measured here) and
the forward's GPU time alone (queued behind a sleep kernel, timed with events), and the share
of the timed steps in which the GPU sat idle waiting on the host (events around each step's
launch, see scripts/decode/decode_churn.py). `--churn-slots K` also measures every row while K spare slots reload
adapters the whole time (overlapped loading; every other load from the CPU tier, the rest read
from disk), beside the same row without. Prints JSON. `--async-scheduling` drives the
runner as the engine does with that flag: each step's plan is launched before the step ahead
of it is read back, its requests fed the tokens that step samples on the device.
`--e2e` instead runs bench_peft.py's workload end to end (one request per adapter, prefill
`--prompt-len` then `--gen-len` greedy tokens, wall time over it all).
`--tensor-parallel-size N` runs the sweep with the model split over N rank processes
(scripts/decode/bench_decode_tp.py; `--compare-tp1`: TP 1 in the same run), beside each step the
all-reduce time and the bandwidth floor of one rank's shard.

    python -m scripts.decode.bench_decode --out bench.json
    python -m scripts.decode.bench_decode --e2e --batch-sizes 32 --adapters 32 --out ours.json  # 128 + 128 tokens
    python -m scripts.decode.bench_decode --batch-sizes 32 --adapters 4 --churn-slots 2 --async-scheduling
    python -m scripts.decode.bench_decode --tensor-parallel-size 2 --compare-tp1 --batch-sizes 1,32 --adapters 0,4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch

from ledgerserve.kernels import gemm_tuning
from ledgerserve.shared.adapter_format import BaseShapes
from ledgerserve.shared.events import AdapterSlotAssigned
from ledgerserve.worker_proc.runner import ModelRunner
from scripts.common.bench_fixtures import (
    MODEL_SHAPES,
    adapter_bytes,
    copy_bandwidth,
    kv_bytes,
    weight_bytes,
    write_adapter,
    write_model_dir,
)
from scripts.decode.bench_decode_tp import compare
from scripts.decode.decode_args import engine_config, parse_args, use_gemv_configs
from scripts.decode.decode_bench import Bench
from scripts.decode.decode_churn import LoadChurn


def end_to_end(
    runner: ModelRunner, batch: int, num_adapters: int, prompt_len: int, gen_len: int, ahead: bool = False
) -> dict:
    """Prefill `batch` prompts then decode to `gen_len` output tokens each; tokens/s over the wall time.
    Each step returns its sampled tokens to the host, so the clock stops on finished work."""
    bench = Bench(runner, prompt_len, 0, gen_len, ahead)
    bench.start(batch, num_adapters)  # warm-up: prefill of this shape
    t0 = time.perf_counter()
    last = bench.start(batch, num_adapters)  # the first output token
    if ahead:
        bench.decode_ahead(last, gen_len - 1)
    else:
        for _ in range(gen_len - 1):
            last, _ = bench.decode(last)
    wall = time.perf_counter() - t0
    return dict(
        device=torch.cuda.get_device_name(),
        batch=batch,
        adapters=num_adapters,
        prompt_len=prompt_len,
        async_scheduling=ahead,
        gen_len=gen_len,
        output_tokens=batch * gen_len,
        wall_s=round(wall, 3),
        tok_s=round(batch * gen_len / wall, 1),
    )


def sweep(
    bench: Bench, base: BaseShapes, args: argparse.Namespace, bw: float, churn: LoadChurn | None = None
) -> list[dict]:
    """One row per (adapter count, batch size): step time beside its bandwidth floor; with `churn`,
    each row once more with the churning loads beside the steps."""
    results = []
    for num_adapters in args.adapter_counts:
        for batch in args.batches:
            for row_churn in [None, churn] if churn is not None else [None]:
                row = _row(bench, base, args, bw, batch, num_adapters, row_churn)
                results.append(row)
                print(json.dumps(row), flush=True)
    return results


def _row(
    bench: Bench,
    base: BaseShapes,
    args: argparse.Namespace,
    bw: float,
    batch: int,
    num_adapters: int,
    churn: LoadChurn | None = None,
) -> dict:
    step_ms, gpu_ms, enqueue_ms, mean_len, idle = bench.run(batch, num_adapters, churn)
    distinct = min(num_adapters, batch)
    read = (
        weight_bytes(bench.runner.model, batch)
        + distinct * adapter_bytes(base, args.rank)
        + kv_bytes(base, base.num_layers, [round(mean_len)] * batch)
    )
    floor_ms = read / bw * 1e3
    row = dict(
        batch=batch,
        adapters=distinct,
        step_ms=round(step_ms, 3),
        tok_s=round(batch / step_ms * 1e3, 1),
        floor_ms=round(floor_ms, 3),
        x_floor=round(step_ms / floor_ms, 2),
        gpu_ms=round(gpu_ms, 3),
        gpu_idle=round(idle, 3),
        enqueue_ms=round(enqueue_ms, 2),
    )
    if churn is not None:
        row.update(churn_slots=len(churn.slots), churn_loads=churn.num_loads, churn_sources=churn.sources)
    return row


def main() -> None:
    args = parse_args()
    if args.tensor_parallel_size > 1:
        _report(compare(args, sys.argv[1:]), args.out)
        return
    use_gemv_configs(args)
    root = tempfile.mkdtemp(prefix="bench_decode_")
    shapes = MODEL_SHAPES[args.model]
    base = BaseShapes.from_hf_config(shapes)
    t0 = time.perf_counter()
    runner = ModelRunner(engine_config(args, write_model_dir(root, shapes)))  # decode graphs unless --eager
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(max(args.adapter_counts)):
        path = write_adapter(root, i, base, args.rank, "cuda")
        runner.adapters.load(AdapterSlotAssigned(i, i, path))
    adapters_s = time.perf_counter() - t0
    if args.e2e:
        _report(
            end_to_end(
                runner, args.batches[0], args.adapter_counts[0], args.prompt_len, args.gen_len, args.async_scheduling
            ),
            args.out,
        )
        return
    bw = copy_bandwidth(runner.device)
    churn = None
    if args.churn_slots:
        paths = [write_adapter(root, 1000 + i, base, args.rank, "cuda") for i in range(4)]
        churn = LoadChurn(runner, max(args.adapter_counts), args.churn_slots, paths)
    bench = Bench(runner, args.prompt_len, args.warmup, args.steps, args.async_scheduling)
    results = sweep(bench, base, args, bw, churn)
    report = dict(
        device=torch.cuda.get_device_name(),
        model=args.model,
        torch=torch.__version__,
        copy_bw_GBps=round(bw / 1e9, 1),
        model_load_s=round(load_s, 1),
        adapters_load_s=round(adapters_s, 1),
        graphs=not args.eager,
        max_loras=args.max_loras,
        prompt_len=args.prompt_len,
        rank=args.rank,
        async_scheduling=args.async_scheduling,
        churn_slots=args.churn_slots,
        results=results,
        gemm_tuning=gemm_tuning.report(),
    )
    _report(report, args.out)


def _report(report: dict, out: str) -> None:
    text = json.dumps(report, indent=1)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
