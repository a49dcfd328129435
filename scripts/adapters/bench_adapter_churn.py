"""Adapter churn: how serving holds up when adapters move between disk, the CPU tier and the
GPU slots. One command, on one GPU, against servers it starts itself:

    python -m scripts.adapters.bench_adapter_churn --out churn.json --plot churn.png
    python -m scripts.adapters.bench_adapter_churn --quick          # tiny settings, CPU, demo model

The base model is Llama-3-8B-shaped with random weights (`--load-format dummy`, bf16) and the
demo model's tokenizer; adapters are random PEFT LoRA adapters on all seven projections.
Servers run with `--async-scheduling`, and with `--lora-overlap-loading` or without it
(`--overlap on|off|both`; both takes every measurement once per mode).

(a) probe (scripts/adapters/churn_probe.py): TTFT of single 256-token requests with nothing else in
    flight: base; an adapter's first use right after its registration; warm; from the CPU
    tier; from disk after its CPU copy was evicted. Medians over the repetitions.
(b) the serving table, with bench_serving's workload and report code: a burst of 384
    requests with 128 in flight, and Poisson arrivals at 10 req/s for 200 requests; 256 in,
    128 out; for 1, 8, 16 and 64 adapters (rank 8 and 16, uniform) through 8 slots, and 64
    adapters with --max-loras 64. Output tok/s, TTFT and TPOT percentiles per workload.
(c) 512 rank-8 adapters, Zipf popularity (s = 1.1), --max-loras 32, --max-cpu-loras 128,
    Poisson at 70% of the single-adapter burst's request rate measured in (b). Its adapter
    directories are distinct versions (each its own config), their weight files hard links
    to 64 distinct files, to bound the disk written.
Workloads are grouped by server flags: three server start-ups per mode (scripts/adapters/churn_plan.py).
Every workload registers its adapters, runs, unloads them and checks that the engine went
idle holding nothing. Also measured: pinned host-to-device and page-cache file-read
bandwidth, and from each server's event log the adapter loads by target and source tier.

The JSON report (--out) is rewritten after every workload, so an interrupted run keeps what
it measured; the PNG (--plot, drawn with matplotlib: `pip install 'ledgerserve[plot]'`) has a
TTFT CDF per arrival pattern and output tok/s bars.
`--groups 1,2 --capacity-rps R` runs only some server groups (R: the capacity measured by an
earlier run's group 0), to split a run that is too long for one sitting.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from ledgerserve.demo_model import ensure_demo_model
from ledgerserve.shared.adapter_format import BaseShapes
from scripts.adapters import churn_report, io_bandwidth
from scripts.adapters.churn_plan import ARRIVALS, FULL, QUICK, ServerGroup, check_settings, server_groups
from scripts.adapters.churn_workloads import Bench, serve_group
from scripts.common.bench_fixtures import link_adapter, write_adapter, write_served_model_dir
from scripts.common.plot import write_png
from scripts.common.server_process import Server
from scripts.serving.serving_workload import read_model_config

OVERLAP_FLAGS = {"on": "--lora-overlap-loading", "off": "--no-lora-overlap-loading"}


# ---- preparing: model dir, adapters, bandwidth ---------------------------------------


QUICK_FLAGS = "--device cpu --max-model-len 256 --num-kv-blocks 256 --max-num-seqs 16 --max-num-batched-tokens 256"
FULL_FLAGS = "--load-format dummy --dtype bfloat16 --device cuda --max-model-len 1024"


def prepare(args: argparse.Namespace, work_dir: str) -> Bench:
    settings = QUICK if args.quick else FULL
    check_settings(settings)
    check_groups(args, server_groups(settings))
    demo_dir = ensure_demo_model()
    if args.quick:
        model_dir, flags = demo_dir, QUICK_FLAGS
    elif not torch.cuda.is_available():
        raise ValueError("the full run needs a CUDA GPU (use --quick on a CPU)")
    else:
        model_dir, flags = write_served_model_dir(work_dir, demo_dir), FULL_FLAGS
    report = {
        "benchmark": "adapter_churn",
        "quick": args.quick,
        "overlap": args.overlap,
        "settings": dataclasses.asdict(settings),
        "device": _device(),
        "modes": {},
    }
    report["tensor_parallel_size"] = args.tensor_parallel_size
    bench = Bench(
        settings,
        args.seed,
        work_dir,
        model_dir,
        model_args(args, model_dir, flags),
        read_model_config(demo_dir),
        report,
        args.out,
        args.groups,
        args.capacity_rps,
        args.arrivals,
    )
    write_adapters(bench, BaseShapes.from_hf_config(read_model_config(model_dir)))
    report["bandwidth"] = {
        "pinned_h2d_gbps": _round(io_bandwidth.pinned_h2d_gbps()),
        "page_cache_read_gbps": _round(io_bandwidth.page_cache_read_gbps(work_dir, settings.read_bandwidth_bytes)),
    }
    return bench


def model_args(args: argparse.Namespace, model_dir: str, flags: str) -> list[str]:
    """The server flags that depend on the device, the model and the rank count."""
    return [model_dir, *flags.split(), "--async-scheduling", "--tensor-parallel-size", str(args.tensor_parallel_size)]


def check_groups(args: argparse.Namespace, groups: Sequence[ServerGroup]) -> None:
    chosen = range(len(groups)) if args.groups is None else args.groups
    if not set(chosen) <= set(range(len(groups))):
        raise ValueError(f"--groups must be among 0..{len(groups) - 1}")
    if any(groups[i].runs_zipf for i in chosen) and 0 not in chosen and args.capacity_rps is None:
        raise ValueError("the Zipf run needs the single-adapter capacity: run group 0 too, or pass --capacity-rps")


def write_adapters(bench: Bench, base: BaseShapes) -> None:
    """The table's pool (rank mix), the probe's fresh adapters, and the Zipf set."""
    s, device = bench.settings, "cuda" if torch.cuda.is_available() else "cpu"
    pool_size = max(setup.num_adapters for setup in s.table)
    for i in range(pool_size):
        write_adapter(bench.dir("pool"), i, base, s.ranks[i % len(s.ranks)], device)
    for i in range(s.probe_reps):
        write_adapter(bench.dir("probe"), i, base, s.probe_rank, device)
    for i in range(s.zipf_distinct_weights):
        write_adapter(bench.dir("zipf"), i, base, s.zipf_rank, device)
    for i in range(s.zipf_distinct_weights, s.zipf_adapters):
        link_adapter(
            os.path.join(bench.dir("zipf"), f"adapter-{i % s.zipf_distinct_weights}"),
            os.path.join(bench.dir("zipf"), f"adapter-{i}"),
            alpha=2.0 * s.zipf_rank + i,
        )
    if device == "cuda":
        torch.cuda.empty_cache()


# ---- one server, its workloads ---------------------------------------------------------


def run_mode(bench: Bench, overlap: str) -> None:
    mode: dict[str, Any] = {"servers": [], "table": []}
    bench.report["modes"][overlap] = mode
    for index, group in enumerate(server_groups(bench.settings)):
        if bench.groups is not None and index not in bench.groups:
            continue
        log_dir = os.path.join(bench.work_dir, "events", f"{overlap}-{index}")
        server = Server(None, log_dir, server_args(bench, group, overlap))
        start_s = time.perf_counter()
        server.start()
        entry = {"args": server.extra_args, "start_s": round(time.perf_counter() - start_s, 1)}
        mode["servers"].append(entry)
        print(f"server {index} ({group.label}, overlap {overlap}) up in {entry['start_s']} s", file=sys.stderr)
        try:
            asyncio.run(serve_group(bench, group, server, mode, overlap))
        finally:
            entry["exit_code"] = server.stop(timeout_s=120)
        entry["adapter_movement"] = churn_report.load_stats(log_dir)
        bench.save()


def server_args(bench: Bench, group: ServerGroup, overlap: str) -> list[str]:
    return [
        *bench.model_args,
        "--enable-lora",
        "--max-lora-rank",
        str(bench.settings.max_rank),
        "--lora-allowed-dir",
        os.path.join(bench.work_dir, "adapters"),
        "--max-loras",
        str(group.max_loras),
        "--max-cpu-loras",
        str(group.max_cpu_loras),
        OVERLAP_FLAGS[overlap],
    ]


# ---- entry -------------------------------------------------------------------------------


def _device() -> dict[str, Any]:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"name": name, "torch": torch.__version__}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_adapter_churn", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny settings on the CPU with the demo model (a smoke test)")
    p.add_argument(
        "--overlap",
        choices=("on", "off", "both"),
        default="on",
        help="serve with --lora-overlap-loading, without it, or take everything in both modes",
    )
    p.add_argument("--work-dir", default=None, help="model dir, adapters and event logs (default: a temporary dir)")
    p.add_argument("--out", default="adapter_churn.json")
    p.add_argument("--plot", default="adapter_churn.png")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="the servers' worker ranks (-tp)")
    p.add_argument(
        "--groups",
        type=lambda text: tuple(int(g) for g in text.split(",")),
        default=None,
        help="run only these server groups (0: probe and the 8-slot table, 1: 64 slots, 2: Zipf), "
        "to split a run over several calls",
    )
    p.add_argument(
        "--arrivals",
        type=_arrivals,
        default=ARRIVALS,
        help="the serving table's arrival patterns, comma-separated (default: burst,poisson)",
    )
    p.add_argument(
        "--capacity-rps",
        type=float,
        default=None,
        help="the single-adapter burst's requests/s from an earlier run, when group 0 does not run",
    )
    return p.parse_args(argv)


def _arrivals(text: str) -> tuple[str, ...]:
    chosen = tuple(text.split(","))
    if not chosen or not set(chosen) <= set(ARRIVALS):
        raise argparse.ArgumentTypeError(f"arrivals must be among {', '.join(ARRIVALS)}")
    return chosen


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="adapter-churn-")
    started = time.perf_counter()
    try:
        bench = prepare(args, work_dir)
        for overlap in ("on", "off") if args.overlap == "both" else (args.overlap,):
            run_mode(bench, overlap)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
    rows = [row for mode in bench.report["modes"].values() for row in (*mode["table"], *mode.get("zipf", []))]
    bench.report["elapsed_s"] = round(time.perf_counter() - started, 1)
    bench.save()
    write_png(args.plot, churn_report.plot_panels(rows))
    print(churn_report.table_text(rows))
    return bench.report


if __name__ == "__main__":
    main()
