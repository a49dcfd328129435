"""Where a decode step's time goes: per-kernel GPU time (torch.profiler over graph replays)
and the host's share of `ModelRunner.execute` (plan, inputs, of which the upload, and
the graph launch, queuing the sampling, the digest while the GPU runs, reading the tokens back,
which waits for the GPU).
Same runner and workload as bench_decode.py. Prints a table per point and JSON with --out.
Kernels run without programmatic dependent launch unless --pdl: with it a kernel's time
includes its wait for the one before, so the per-kernel times overlap and sum past the step.

    python -m scripts.decode.profile_decode --points 1:0,32:0,32:4,32:32
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import math
import os
import tempfile
import time
from collections.abc import Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from ledgerserve.shared.adapter_format import BaseShapes
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import AdapterSlotAssigned
from ledgerserve.worker_proc.pinned_staging import PinnedStaging
from ledgerserve.worker_proc.requests import Requests
from ledgerserve.worker_proc.runner import ModelRunner
from ledgerserve.worker_proc.sampler import Sampler
from ledgerserve.worker_proc.step_inputs import StepInputBuilder
from scripts.common.bench_fixtures import MODEL_SHAPES, write_adapter, write_model_dir
from scripts.common.report_files import write_json
from scripts.decode.decode_bench import BLOCK, Bench

STEP_GAP_US = 100.0  # an idle GPU this long between two kernels: a new step
HOST_PARTS = [
    (Requests, "apply"),
    (StepInputBuilder, "build"),
    (PinnedStaging, "upload_into"),
    (torch.cuda.CUDAGraph, "replay"),
    (Sampler, "launch"),
    (Sampler, "finish"),
    (ModelRunner, "digest"),
]


@contextlib.contextmanager
def timed_host_parts(totals: dict[str, float]) -> Iterator[None]:
    """Within: each call of a HOST_PARTS method adds its wall seconds to totals[name]."""
    originals = [(cls, name, getattr(cls, name)) for cls, name in HOST_PARTS]
    for cls, name, fn in originals:

        @functools.wraps(fn)
        def timed(*args, _fn=fn, _name=f"{cls.__name__}.{name}", **kw):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kw)
            finally:
                totals[_name] += time.perf_counter() - t0

        setattr(cls, name, timed)
    try:
        yield
    finally:
        for cls, name, fn in originals:
            setattr(cls, name, fn)


def kernel_table(prof, num_steps: int, device_type: str = "cuda") -> list[dict]:
    """Per kernel name: calls and GPU µs per step, largest first; with device_type "cpu", per op
    and its self time (ops nest on the CPU: self times add up to the step, totals would not)."""
    rows = collections.defaultdict(lambda: [0, 0.0])
    for evt in prof.events():
        if device_type == "cuda" and evt.device_type == torch.autograd.DeviceType.CUDA:
            rows[evt.name][0] += 1
            rows[evt.name][1] += evt.device_time_total
        elif device_type == "cpu" and evt.device_type == torch.autograd.DeviceType.CPU:
            rows[evt.name][0] += 1
            rows[evt.name][1] += evt.self_cpu_time_total
    table = [
        dict(kernel=name[:90], calls=round(n / num_steps, 1), us=round(us / num_steps, 1))
        for name, (n, us) in rows.items()
    ]
    return sorted(table, key=lambda r: -r["us"])


def last_step_timeline(prof, device_type: str = "cuda", gap_us: float = STEP_GAP_US) -> list[list]:
    """The GPU's work of the last profiled step in order: [name, start, duration] (µs from the
    step's first kernel). Steps are told apart by the host's gap between them (over `gap_us`
    with nothing on the GPU), and the step is the last of the stretches with the most kernels
    (a bench's own work between steps, such as handing tokens to the other ranks, has fewer); []
    without CUDA."""
    if device_type != "cuda":
        return []
    spans = sorted(
        (evt.time_range.start, evt.time_range.end, evt.name)
        for evt in prof.events()
        if evt.device_type == torch.autograd.DeviceType.CUDA
    )
    stretches: list[list[tuple]] = []
    latest_end = -math.inf
    for span in spans:
        if span[0] - latest_end >= gap_us:
            stretches.append([])
        stretches[-1].append(span)
        latest_end = max(latest_end, span[1])
    if not stretches:
        return []
    step = max(reversed(stretches), key=len)  # max keeps the first of equals: the last stretch
    t0 = step[0][0]
    return [[name[:48], round(start - t0, 1), round(end - start, 1)] for start, end, name in step]


def profile_point(bench: Bench, batch: int, num_adapters: int, steps: int, host: dict[str, float]) -> dict:
    last = bench.start(batch, num_adapters)
    for _ in range(3):
        last, _ = bench.decode(last)
    host.clear()
    walls = []
    for _ in range(steps):
        last, wall = bench.decode(last)
        walls.append(wall)
    host_ms = {k: round(v / steps * 1e3, 3) for k, v in host.items()}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            last, _ = bench.decode(last)
        torch.cuda.synchronize()
    kernels = kernel_table(prof, steps)
    return dict(
        batch=batch,
        adapters=num_adapters,
        step_ms=round(sorted(walls)[len(walls) // 2] * 1e3, 3),
        host_ms=host_ms,
        kernel_us_total=round(sum(k["us"] for k in kernels), 1),
        kernel_calls=round(sum(k["calls"] for k in kernels)),
        kernels=kernels,
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default="1:0,32:0,32:4,32:32", help="batch:adapters,...")
    ap.add_argument("--max-loras", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODEL_SHAPES), help="the dummy model's shapes")
    ap.add_argument("--pdl", action="store_true", help="keep PDL on (kernel times then include waits)")
    ap.add_argument("--out", default="")
    return ap.parse_args()


def build_runner(args: argparse.Namespace, root: str, max_batch: int, num_adapters: int) -> ModelRunner:
    """A runner of the dummy model (`--model`'s shapes) with `num_adapters` random adapters in its slots."""
    blocks_per_req = -(-(128 + 8 * args.steps + 2) // BLOCK)  # as Bench sizes them
    config = EngineConfig(
        model_dir=write_model_dir(root, MODEL_SHAPES[args.model]),
        served_model_name="bench",
        max_model_len=128 + 8 * args.steps + 64,
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=max_batch,
        block_size=BLOCK,
        load_format="dummy",
        num_kv_blocks=max_batch * blocks_per_req,
        enable_lora=True,
        max_loras=args.max_loras,
        max_lora_rank=args.rank,
        max_cpu_loras=args.max_loras,
        enforce_eager=args.eager,
    )
    runner = ModelRunner(config)
    base = BaseShapes.from_hf_config(MODEL_SHAPES[args.model])
    for i in range(num_adapters):
        runner.adapters.load(AdapterSlotAssigned(i, i, write_adapter(root, i, base, args.rank, "cuda")))
    return runner


def main() -> None:
    args = parse_args()
    if not args.pdl:
        os.environ["LEDGERSERVE_PDL"] = "0"
    points = [tuple(int(v) for v in p.split(":")) for p in args.points.split(",")]
    root = tempfile.mkdtemp(prefix="profile_decode_")
    runner = build_runner(args, root, max(b for b, _ in points), max(a for _, a in points))
    host: dict[str, float] = collections.defaultdict(float)
    bench = Bench(runner, 128, 0, 8 * args.steps)
    report = []
    for batch, num_adapters in points:
        with timed_host_parts(host):
            row = profile_point(bench, batch, num_adapters, args.steps, host)
        report.append(row)
        print(
            f"\n== batch {batch}, {num_adapters} adapters: step {row['step_ms']} ms, kernels "
            f"{row['kernel_us_total']} us in {row['kernel_calls']} launches; host ms {row['host_ms']}"
        )
        for k in row["kernels"][: args.top]:
            print(f"{k['us']:9.1f} us {k['calls']:6.1f}x  {k['kernel']}")
    if args.out:
        write_json(args.out, dict(device=torch.cuda.get_device_name(), points=report), indent=1)


if __name__ == "__main__":
    main()
