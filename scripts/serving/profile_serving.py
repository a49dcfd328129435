"""The serving-path profile: where a request's time goes between the client, the HTTP process, the
scheduler and the worker. One command starts a server with `--profile-dir` (every process writes
timing spans, shared/spans.py), runs the workloads twice (the first pass after "ready", then warm,
with fresh prompts), then each burst once more with the warm pass's prompts ("repeat"), stops the
server, checks its event log with `replay --verify`, and reports per pass:

    python -m scripts.serving.profile_serving --out profile.json --plot timeline.png   # one GPU
    python -m scripts.serving.profile_serving --no-spans --out plain.json              # no profile
    python -m scripts.serving.profile_serving --quick                                  # CPU, demo model

Writing spans costs every process some time, so the throughput and latency to set beside
another server's come from a `--no-spans` run (the same passes, no per-step profile).

The GPU workload: Llama-3-8B shapes (`--load-format dummy`, bf16), the demo model's tokenizer,
64 rank-16 PEFT adapters on all seven projections registered with `--lora-modules` (8 distinct
weight files, hard-linked into 64 versions), `--max-loras 8 --max-cpu-loras 128`; 256 random
prompt tokens, 128 output tokens (ignore_eos), streaming /v1/completions. Bursts: 384 requests,
128 in flight; Poisson: 10 req/s, 200 requests. A pass's "first" is the first time this server
serves that workload (the first workload of the first pass is the first traffic after ready).
"repeat" sends the prompts the server has just served, so they hit the prefix cache: what
`vllm bench serve` measures when run twice with its fixed seed on a server with prefix caching.

The client runs in one process per 32 requests in flight (scripts/serving/client_shards.py), so
the server is what a pass measures. Per pass: the client's figures (bench_serving's summary:
output tok/s, TTFT, TPOT), each process's CPU time over the pass (from /proc; "client" is one
client process's mean), and scripts/serving/profile_report.py's figures: device busy
and idle, host time per step and process, IPC latency, log write and fsync time, prefill and decode
tokens per step, each step's hops, and where each request's time to first token went.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from ledgerserve.demo_model import ensure_demo_model
from ledgerserve.shared import spans
from ledgerserve.shared.eventlog import EventLogReader, newest_log
from scripts.common.report_files import write_json
from scripts.common.server_process import Server
from scripts.serving import profile_plot, profile_report
from scripts.serving.client_shards import default_num_shards, run_sharded
from scripts.serving.serving_report import summarize
from scripts.serving.serving_workload import AdapterSpec, adapter_specs, parse_config, plan_workload, read_model_config

FULL_FLAGS = "--load-format dummy --dtype bfloat16 --device cuda --max-model-len 1024"
QUICK_FLAGS = "--device cpu --max-model-len 512 --num-kv-blocks 512 --max-num-seqs 16 --max-num-batched-tokens 512"
LORA_FLAGS = "--enable-lora --max-loras 8 --max-cpu-loras 128"


@dataclass(frozen=True)
class Workload:
    name: str
    num_adapters: int  # 0: the base model
    arrival: str  # burst or poisson
    num_requests: int
    max_concurrency: int = 0  # bursts: requests in flight
    rate: float = 0.0  # poisson: requests per second


FULL = (
    Workload("base burst", 0, "burst", 384, max_concurrency=128),
    Workload("1a burst", 1, "burst", 384, max_concurrency=128),
    Workload("8a burst", 8, "burst", 384, max_concurrency=128),
    Workload("8a poisson", 8, "poisson", 200, rate=10.0),
    Workload("64a poisson", 64, "poisson", 200, rate=10.0),
)
QUICK = (Workload("base burst", 0, "burst", 24, max_concurrency=8), Workload("4a poisson", 4, "poisson", 16, rate=4.0))


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_processes(pid: int) -> dict[str, int]:
    """The launcher's children by role (http, scheduler, worker-N), from their command lines."""
    roles = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if ppid != pid:
            continue
        text = " ".join(cmd)
        if "tokenizer_proc" in text:
            roles["http"] = int(entry)
        elif "scheduler_proc" in text:
            roles["scheduler"] = int(entry)
        elif "worker_proc" in text:
            roles[f"worker-{cmd[cmd.index('--rank') + 1] if '--rank' in cmd else 0}"] = int(entry)
    return roles


async def run_pass(
    server: Server, args: argparse.Namespace, workload: Workload, adapters: list[AdapterSpec], seed: int
) -> dict[str, Any]:
    argv = ["--base-url", server.base_url, "--model-dir", args.model_dir, "--adapter-dir", args.adapter_dir]
    argv += ["--num-adapters", str(max(1, workload.num_adapters)), "--arrival", workload.arrival]
    argv += ["--num-requests", str(workload.num_requests), "--input-len", str(args.input_len)]
    argv += ["--output-len", str(args.output_len), "--seed", str(seed)]
    argv += ["--base-share", "1.0" if workload.num_adapters == 0 else "0.0"]
    if workload.arrival == "poisson":
        argv += ["--rate", str(workload.rate)]
    if workload.max_concurrency:
        argv += ["--max-concurrency", str(workload.max_concurrency)]
    config = parse_config(argv)
    plan, weights = plan_workload(config, read_model_config(args.demo_dir))  # prompts within the tokenizer's vocabulary
    used = adapters[: max(1, workload.num_adapters)]
    models = [spec.name for spec in used]
    pids = child_processes(server.proc.pid)
    cpu_before = {role: proc_cpu_s(pid) for role, pid in pids.items()}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60.0) as client:
        base = (await client.get("/v1/models")).json()["data"][0]["id"]
    num_shards = args.client_processes or default_num_shards(workload.max_concurrency or None)
    start_ns, wall_start, children_before = spans.now_ns(), time.perf_counter(), os.times()
    results = await run_sharded(
        server.base_url, plan, models, base, args.output_len, workload.max_concurrency or None, num_shards
    )
    end_ns, wall_s, children = spans.now_ns(), time.perf_counter() - wall_start, os.times()
    cpu = {role: round((proc_cpu_s(pid) - cpu_before[role]) / wall_s, 3) for role, pid in pids.items()}
    client_cpu_s = children.children_user + children.children_system
    client_cpu_s -= children_before.children_user + children_before.children_system
    cpu["client"] = round(client_cpu_s / wall_s / num_shards, 3)  # per client process
    summary = summarize(vars(config), plan, weights, results, used, base)
    return {
        "window_ns": [start_ns, end_ns],
        "num_errors": summary["num_errors"],
        "errors": summary["errors"],
        "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
        "ttft_ms": summary["ttft_ms"],
        "tpot_ms": summary["tpot_ms"],
        "cpu_share": cpu,  # CPU seconds per second of the pass, per process
        "num_client_processes": num_shards,
    }


def write_adapters(args: argparse.Namespace, num_files: int, num_versions: int, rank: int) -> list[AdapterSpec]:
    """`num_versions` adapter directories over `num_files` distinct weight files."""
    from ledgerserve.shared.adapter_format import BaseShapes
    from scripts.common.bench_fixtures import link_adapter, write_adapter

    base = BaseShapes.from_hf_config(read_model_config(args.model_dir))
    device = "cuda" if not args.quick else "cpu"
    files = [write_adapter(os.path.join(args.work_dir, "files"), i, base, rank, device) for i in range(num_files)]
    specs = adapter_specs(num_versions, [rank], args.adapter_dir, "a")
    for i, spec in enumerate(specs):
        link_adapter(files[i % num_files], spec.path, alpha=2.0 * rank + i)
    return specs


async def serve_passes(server: Server, args: argparse.Namespace, adapters: list[AdapterSpec]) -> list[dict[str, Any]]:
    rows = []
    for pass_name, seed_base in (("first", 1000), ("warm", 2000)):
        for index, workload in enumerate(args.workloads):
            names = [pass_name, "repeat"] if pass_name == "warm" and workload.arrival == "burst" else [pass_name]
            for name in names:  # "repeat": the warm pass's prompts again, now in the prefix cache
                row = await run_pass(server, args, workload, adapters, seed_base + index)
                rows.append({"workload": workload.name, "pass": name, **row})
                print(
                    f"{workload.name} ({name}): {row['output_tokens_per_s']} out tok/s, "
                    f"TTFT p50 {row['ttft_ms']['p50']} ms, TPOT p50 {row['tpot_ms']['p50']} ms"
                    + (f", {row['num_errors']} errors: {row['errors']}" if row["num_errors"] else ""),
                    file=sys.stderr,
                )
                server.wait_idle(timeout_s=120)
    return rows


def analyse(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each row's profile (None without spans), and `replay --verify` of the event log."""
    from ledgerserve.scheduler_proc.replay.verify import replay

    log_path = newest_log(args.log_dir)
    sp = None
    if not args.no_spans:
        files = [os.path.join(args.profile_dir, name) for name in sorted(os.listdir(args.profile_dir))]
        sp = profile_report.Spans.of(record for path in files for record in spans.read_spans(path))
        facts = profile_report.LogFacts.of(EventLogReader(log_path))
    for row in rows:
        row["profile"] = None if sp is None else profile_report.window_report(sp, facts, *row["window_ns"])
    verified = replay(log_path)
    return {"log": log_path, "replay_verified": verified.ok, "spans": sp}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    args.work_dir = tempfile.mkdtemp(prefix="profile_serving_")
    args.profile_dir, args.log_dir = os.path.join(args.work_dir, "spans"), os.path.join(args.work_dir, "events")
    args.adapter_dir = os.path.join(args.work_dir, "adapters")
    args.demo_dir = ensure_demo_model()
    if args.quick:
        args.model_dir, flags, rank, shape = args.demo_dir, QUICK_FLAGS, 8, (2, 8)
    else:
        from scripts.common.bench_fixtures import MODEL_SHAPES, write_served_model_dir

        model_dir = write_served_model_dir(args.work_dir, args.demo_dir, MODEL_SHAPES[args.model])
        args.model_dir, flags, rank, shape = model_dir, FULL_FLAGS, 16, (8, 64)
    args.workloads = [w for w in (QUICK if args.quick else FULL) if not args.workloads or w.name in args.workloads]
    adapters = write_adapters(args, *shape, rank)
    modules = [f"{spec.name}={spec.path}" for spec in adapters]
    server_args = [*shlex.split(flags), *shlex.split(LORA_FLAGS), "--max-lora-rank", str(rank)]
    server_args += [] if args.no_spans else ["--profile-dir", args.profile_dir]
    server_args += [*shlex.split(args.server_args), "--lora-modules", *modules]
    started = time.perf_counter()
    server = Server(args.model_dir, args.log_dir, server_args, start_timeout_s=900).start()
    start_s = round(time.perf_counter() - started, 1)  # to a healthy /health: start-up, warm-up, staging
    try:
        rows = asyncio.run(serve_passes(server, args, adapters))
    finally:
        server.stop(signal.SIGTERM, timeout_s=120)
    found = analyse(args, rows)
    report = {"server_args": server_args[: -len(modules)], "start_s": start_s, "log": found["log"], "rows": rows}
    report["replay_verified"] = found["replay_verified"]
    if args.out:
        write_json(args.out, report, indent=1)
    if args.plot:
        warm = [r for r in rows if r["pass"] == "warm"][0]
        profile_plot.timeline(found["spans"], warm["window_ns"], args.plot, f"{warm['workload']}, warm")
    return report


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny settings on the CPU with the demo model")
    p.add_argument("--server-args", default="--async-scheduling", help="more serve flags (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 256; quick 64)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens (default 128; quick 16)")
    p.add_argument(
        "--client-processes", type=int, default=0, help="client processes per pass (default: one per 32 in flight)"
    )
    p.add_argument("--model", default="llama3-8b", help="the dummy model's shapes: llama3-8b or qwen3-30b-a3b")
    p.add_argument("--workloads", type=lambda v: v.split(","), default=[], help="names to run (default: all)")
    p.add_argument("--out", default="", help="the JSON report")
    p.add_argument("--plot", default="", help="a PNG timeline of 40 ms of the first workload's warm pass")
    p.add_argument(
        "--no-spans",
        action="store_true",
        help="serve without --profile-dir: the figures of a server as users run it (writing spans\n"
        "costs every process some time), without the per-step profile",
    )
    args = p.parse_args(argv)
    if args.no_spans and args.plot:
        p.error("--plot draws the spans: it cannot go with --no-spans")
    args.input_len = args.input_len or (64 if args.quick else 256)
    args.output_len = args.output_len or (16 if args.quick else 128)
    return args


def cli(argv: Sequence[str] | None = None) -> int:
    report = main(argv)
    for row in report["rows"]:
        profiled = ""
        if row["profile"] is not None:
            device, ttft = row["profile"]["device"], row["profile"]["ttft_parts_ms"]
            profiled = f", device idle {device.get('idle_share')}, server TTFT p50 {ttft['ttft']['p50']} ms"
        print(
            f"{row['workload']:>12} {row['pass']:>6}: {row['output_tokens_per_s']} tok/s, "
            f"TTFT p50 {row['ttft_ms']['p50']} ms{profiled}, cpu {row['cpu_share']}"
        )
    print(f"started in {report['start_s']} s; replay --verify: {'ok' if report['replay_verified'] else 'DIVERGED'}")
    return 0 if report["replay_verified"] else 1


if __name__ == "__main__":
    raise SystemExit(cli())
