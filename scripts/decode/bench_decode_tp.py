"""bench_decode's sweep with the model split over N tensor-parallel ranks: one process per rank,
started with subprocess (never multiprocessing), each joining the group through a private run
directory and building its ModelRunner for it; every rank runs the same plans (a forward's
collectives need them all), and rank 0 times the steps and writes the rows. Beside each step
time: the all-reduce time of one step (the Megatron split's 2 per layer plus the embedding's,
of a [batch, hidden] activation, timed alone) and the bandwidth floor of one rank (its own
weights, and its share of the adapters and the KV cache, over the copy bandwidth). With
--profile-steps K, each row also holds rank 0's per-kernel table of K more steps (kernel, calls
and µs a step; PDL off, so kernel times add up), TP 1 beside TP N with --compare-tp1. With
--async-scheduling each step is launched before the one ahead of it is read back, as the engine
runs with that flag (rank 0's tokens reach the others as scripts/decode/tp_steps.py says).

    python -m scripts.decode.bench_decode --tensor-parallel-size 2 --compare-tp1 --batch-sizes 1,32 --adapters 0,4
    python -m scripts.decode.bench_decode --tensor-parallel-size 2 --compare-tp1 --batch-sizes 1 --adapters 0 \\
        --profile-steps 8
    python -m scripts.decode.bench_decode --tensor-parallel-size 2 --compare-tp1 --async-scheduling --batch-sizes 1,32
    python -m scripts.decode.bench_decode --tensor-parallel-size 2 --device cpu --model-dir DIR \\
        --batch-sizes 2 --adapters 1
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from ledgerserve.shared import env
from ledgerserve.shared.adapter_format import BaseShapes
from ledgerserve.shared.events import AdapterSlotAssigned
from ledgerserve.shared.tp_layout import tp_layout
from ledgerserve.worker_proc.parallel import TpGroup, close_group, init_group, rank_device, share_cpu_cores
from ledgerserve.worker_proc.runner import ModelRunner
from scripts.common.bench_fixtures import (
    adapter_bytes,
    copy_bandwidth,
    kv_bytes,
    weight_bytes,
    write_adapter,
    write_model_dir,
)
from scripts.decode.decode_args import engine_config, parse_args, use_gemv_configs
from scripts.decode.decode_bench import NoClock
from scripts.decode.profile_decode import kernel_table, last_step_timeline, timed_host_parts
from scripts.decode.tp_steps import SharingBench, cpu_group, timed_steps

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
RESULT_FILE = "result.json"
GROUP_TIMEOUT_S = 600.0  # a rank building a large model waits this long for the others
POLL_S = 0.2
NUM_TIMED_ALL_REDUCE_STEPS = 20
PRINTED_KERNELS = 12  # of each --profile-steps table, on rank 0's output


def compare(args: argparse.Namespace, argv: list[str]) -> dict:
    """The sweep at TP N (and at TP 1 first, with --compare-tp1), each in its own rank processes;
    `argv`: bench_decode's command line, passed on to every rank."""
    sizes = [1, args.tensor_parallel_size] if args.compare_tp1 else [args.tensor_parallel_size]
    run_env = {env.PDL: "0"} if args.profile_steps and not args.timeline else {}  # a kernel's time excludes its wait
    runs = {f"tp{n}": run_ranks([*argv, "--tensor-parallel-size", str(n)], n, run_env) for n in sizes}
    report: dict = dict(torch=torch.__version__, **runs)
    if args.compare_tp1:
        tp1, tpn = runs["tp1"]["results"], runs[f"tp{args.tensor_parallel_size}"]["results"]
        report["speedup"] = [round(a["step_ms"] / b["step_ms"], 2) for a, b in zip(tp1, tpn, strict=True)]
    return report


def run_ranks(
    argv: list[str],
    num_ranks: int,
    run_env: dict[str, str] | None = None,
    module: str = "scripts.decode.bench_decode_tp",
) -> dict:
    """Start the ranks, `python -m module --run-dir D --tp-rank R *argv` (with `run_env` added to
    their environment), wait for all of them (one failing stops the others), return the report
    rank 0 wrote to D/RESULT_FILE."""
    run_dir = tempfile.mkdtemp(prefix="bench_tp_")
    os.chmod(run_dir, 0o700)
    child_env = {
        **os.environ,
        **env.TP_WORKER_ENV,
        **(run_env or {}),
        "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [sys.executable, "-m", module, "--run-dir", run_dir]
    procs = [subprocess.Popen([*cmd, "--tp-rank", str(r), *argv], cwd=ROOT, env=child_env) for r in range(num_ranks)]
    try:
        _wait_all(procs)
        with open(os.path.join(run_dir, RESULT_FILE), encoding="utf-8") as f:
            return json.load(f)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        shutil.rmtree(run_dir, ignore_errors=True)


def _wait_all(procs: list[subprocess.Popen]) -> None:
    while any(proc.poll() is None for proc in procs):
        failed = [(rank, proc.returncode) for rank, proc in enumerate(procs) if proc.poll() not in (None, 0)]
        if failed:
            raise RuntimeError(f"bench rank {failed[0][0]} exited with code {failed[0][1]}")
        time.sleep(POLL_S)
    failed = [(rank, proc.returncode) for rank, proc in enumerate(procs) if proc.returncode != 0]
    if failed:
        raise RuntimeError(f"bench rank {failed[0][0]} exited with code {failed[0][1]}")


def start_rank(
    parse: Callable[[list[str]], argparse.Namespace],
) -> tuple[argparse.Namespace, argparse.Namespace, torch.device, TpGroup]:
    """A rank process started by run_ranks: `--run-dir D --tp-rank R` (own) then the script's flags
    (args, by `parse`: they name the device and the tensor-parallel size); its device made current,
    the group joined, its share of the CPU cores taken."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--tp-rank", type=int, required=True)
    own, rest = ap.parse_known_args()
    args = parse(rest)
    device = rank_device(args.device, own.tp_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = init_group(own.tp_rank, args.tensor_parallel_size, own.run_dir, device, GROUP_TIMEOUT_S)
    share_cpu_cores(group, device)
    return own, args, device, group


def rank_main() -> None:
    """One rank: `--run-dir D --tp-rank R` then bench_decode's own flags."""
    own, args, device, group = start_rank(parse_args)
    use_gemv_configs(args)
    try:
        report = sweep_rank(args, group, device, os.path.join(own.run_dir, f"rank{own.tp_rank}"))
    finally:
        close_group(group)
    if own.tp_rank == 0:
        with open(os.path.join(own.run_dir, RESULT_FILE), "w", encoding="utf-8") as f:
            json.dump(report, f)


def sweep_rank(args: argparse.Namespace, group: TpGroup, device: torch.device, root: str) -> dict:
    """Build this rank's runner and adapters (in its own `root`), then time every row."""
    os.makedirs(root, exist_ok=True)
    model_dir = args.model_dir or write_model_dir(root)
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        hf_config = json.load(f)
    base = BaseShapes.from_hf_config(hf_config)
    config = engine_config(args, model_dir)
    layout = tp_layout(hf_config, group.size)
    config = dataclasses.replace(config, load_format="dummy", tensor_parallel_size=group.size, tp_layout=layout)
    runner = ModelRunner(config, group.rank, group)
    try:
        for i in range(max(args.adapter_counts)):
            runner.adapters.load(AdapterSlotAssigned(i, i, write_adapter(root, i, base, args.rank, args.device)))
        bw = copy_bandwidth(device)
        num_steps = args.steps + 2 * args.profile_steps + 1  # blocks for them all (ahead: one more in flight)
        token_group = cpu_group(group.size)  # rank 0's sampled tokens to the others
        bench = SharingBench(token_group, runner, args.prompt_len, args.warmup, num_steps, args.async_scheduling)
        bench.clock = NoClock()
        rows = [_row(bench, group, base, args, bw, b, n) for n in args.adapter_counts for b in args.batches]
    finally:
        runner.close()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return dict(
        device=name, tensor_parallel_size=group.size, tp_layout=layout, copy_bw_GBps=round(bw / 1e9, 1), results=rows
    )


def _row(
    bench: SharingBench,
    group: TpGroup,
    base: BaseShapes,
    args: argparse.Namespace,
    bw: float,
    batch: int,
    num_adapters: int,
) -> dict:
    last, walls = timed_steps(bench, bench.share(bench.start(batch, num_adapters)), args.warmup, args.steps)
    step_ms = statistics.median(walls) * 1e3
    runner = bench.runner
    elem_bytes = runner.dtype.itemsize
    distinct = min(num_adapters, batch)
    lens = [round(statistics.mean(bench.lengths.values()))] * batch
    shared = distinct * adapter_bytes(base, args.rank, elem_bytes) + kv_bytes(base, base.num_layers, lens, elem_bytes)
    floor_ms = (weight_bytes(runner.model, batch) + shared / group.size) / bw * 1e3
    all_reduce_ms = all_reduce_step_ms(runner.group, batch, base, runner.dtype, runner.device)
    row = dict(batch=batch, adapters=distinct, step_ms=round(step_ms, 3), tok_s=round(batch / step_ms * 1e3, 1))
    if runner.device.type == "cuda":  # every rank runs it: the step's collectives need them all
        meet = functools.partial(group.all_reduce, torch.zeros(1, device=runner.device))
        row["gpu_ms"] = round(bench.gpu_step(meet)[0], 3)
    row.update(shard_floor_ms=round(floor_ms, 3), all_reduce_ms=round(all_reduce_ms, 3))
    if group.rank == 0:
        print(json.dumps({"tp": group.size, **row}), flush=True)
    if args.profile_steps:
        row["host_ms"], row["kernels"], timeline = profile_steps(bench, group, last, args.profile_steps)
        if args.timeline:
            row["timeline"] = timeline
    return row


def profile_steps(
    bench: SharingBench, group: TpGroup, last: dict[str, int], num_steps: int
) -> tuple[dict[str, float], list[dict], list[list]]:
    """`num_steps` more decode steps, every rank running them (they share collectives): first
    timing the host's parts of a step (scripts/decode/profile_decode.py's HOST_PARTS, ms a step), then
    under torch.profiler on rank 0 for its per-kernel table and the last step's kernel timeline;
    ({}, [], []) on the other ranks."""
    device = bench.runner.device
    host: dict[str, float] = collections.defaultdict(float)
    with timed_host_parts(host):
        for _ in range(num_steps):
            sampled, _ = bench.decode(last)
            last = bench.share(sampled)
    host_ms = {name: round(s / num_steps * 1e3, 3) for name, s in host.items()}
    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    _sync(device)
    with profile(activities=[activity]) if group.rank == 0 else contextlib.nullcontext() as prof:
        for _ in range(num_steps):
            sampled, _ = bench.decode(last)
            last = bench.share(sampled)
        _sync(device)
    if group.rank != 0:
        return {}, [], []
    print(f"tp {group.size}: host ms a step {host_ms}", flush=True)
    table = kernel_table(prof, num_steps, device.type)
    print(f"tp {group.size}: {sum(k['us'] for k in table):.1f} us of kernels a step, the largest:", flush=True)
    for k in table[:PRINTED_KERNELS]:
        print(f"{k['us']:9.1f} us {k['calls']:6.1f}x  {k['kernel']}", flush=True)
    return host_ms, table, last_step_timeline(prof, device.type)


def all_reduce_step_ms(group: TpGroup, batch: int, base: BaseShapes, dtype: torch.dtype, device: torch.device) -> float:
    """One decode step's all-reduces (2 per layer and the embedding's) of a [batch, hidden] activation,
    timed alone, through the path the model takes (one-shot or NCCL), on CUDA replayed from one
    CUDA graph as in the decode graphs; 0 with one rank."""
    if group.size == 1:
        return 0.0
    x = torch.ones(batch, base.hidden_size, dtype=dtype, device=device)  # [batch, hidden]
    return time_all_reduces(group, x, 2 * base.num_layers + 1) * 1e3


def time_all_reduces(group: TpGroup, x: torch.Tensor, num_calls: int) -> float:
    """Seconds for `num_calls` all-reduces of x back to back through `group`'s path, on CUDA
    replayed from one CUDA graph: the mean of NUM_TIMED_ALL_REDUCE_STEPS runs after three untimed."""
    device = x.device
    step = _graphed_step(group, x, num_calls) if device.type == "cuda" else lambda: _reduce_n(group, x, num_calls)
    for _ in range(3):
        step()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(NUM_TIMED_ALL_REDUCE_STEPS):
        step()
    _sync(device)
    return (time.perf_counter() - t0) / NUM_TIMED_ALL_REDUCE_STEPS


def _reduce_n(group: TpGroup, x: torch.Tensor, num_calls: int) -> None:
    for _ in range(num_calls):
        x = group.all_reduce(x)  # the values grow (to inf): only the time is read


def _graphed_step(group: TpGroup, x: torch.Tensor, num_calls: int):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _reduce_n(group, x, num_calls)  # warm-up outside the capture (NCCL's first call sets up)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _reduce_n(group, x, num_calls)
    return graph.replay


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    rank_main()
