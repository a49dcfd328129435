"""bench_adapter_churn's workloads on one server: the probe, the serving table's rows and the
Zipf run, each registering its adapters, running with bench_serving's code, unloading them and
checking that the engine went idle holding nothing."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from scripts.adapters import churn_report
from scripts.adapters.churn_plan import ARRIVALS, ChurnSettings, ServerGroup, TableSetup
from scripts.adapters.churn_probe import Prompts, run_probe
from scripts.common import request_loop
from scripts.common.report_files import write_json
from scripts.common.server_process import Server
from scripts.serving.bench_serving import load_adapters, run_plan, unload_adapters
from scripts.serving.serving_report import summarize
from scripts.serving.serving_workload import AdapterSpec, adapter_specs, parse_config, plan_workload, special_token_ids


@dataclass
class Bench:
    settings: ChurnSettings
    seed: int
    work_dir: str
    model_dir: str
    model_args: list[str]  # the server flags that depend on the device and model
    prompt_config: dict[str, Any]  # the tokenizer's vocabulary and special ids: what prompts may hold
    report: dict[str, Any]
    out: str
    groups: tuple[int, ...] | None  # the server groups to run (None: all)
    capacity_rps: float | None  # the single-adapter capacity, when group 0 does not run here
    arrivals: tuple[str, ...] = ARRIVALS  # the table's arrival patterns to run

    def dir(self, name: str) -> str:
        return os.path.join(self.work_dir, "adapters", name)

    def save(self) -> None:
        write_json(self.out, self.report, indent=1)


async def serve_group(bench: Bench, group: ServerGroup, server: Server, mode: dict[str, Any], overlap: str) -> None:
    s = bench.settings
    limits = httpx.Limits(max_connections=max(s.burst_requests, s.zipf_requests, s.poisson_requests) + 8)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=600.0, limits=limits) as client:
        base_model = await request_loop.base_model(client)
        if group.runs_probe:
            prompts = Prompts(bench.seed, bench.prompt_config["vocab_size"], special_token_ids(bench.prompt_config))
            fresh = adapter_specs(s.probe_reps, [s.probe_rank], bench.dir("probe"), "probe-fresh-")
            others = adapter_specs(group.max_cpu_loras, s.ranks, bench.dir("pool"), "probe-other-")
            mode["probe"] = await run_probe(
                client, base_model, fresh, others, group.max_loras, prompts, s.input_len, s.touch_input_len
            )
            _check_idle(server, mode, "probe")
        for setup in group.setups:
            for arrival in bench.arrivals:
                row = await table_workload(bench, client, base_model, setup, group, arrival, len(mode["table"]))
                mode["table"].append({**row, "mode": overlap})
                _check_idle(server, mode, row["workload"])
                bench.save()
        if group.runs_zipf:
            mode["zipf"] = [{**await zipf_workload(bench, client, base_model, mode), "mode": overlap}]
            _check_idle(server, mode, "zipf")


async def table_workload(
    bench: Bench,
    client: httpx.AsyncClient,
    base_model: str,
    setup: TableSetup,
    group: ServerGroup,
    arrival: str,
    index: int,
) -> dict[str, Any]:
    s = bench.settings
    flags: dict[str, Any] = {"adapter_dir": bench.dir("pool"), "num_adapters": setup.num_adapters}
    flags |= {"ranks": ",".join(map(str, s.ranks)), "popularity": "uniform", "arrival": arrival}
    if arrival == "burst":
        flags |= {"num_requests": s.burst_requests, "max_concurrency": s.burst_in_flight}
    else:
        flags |= {"rate": s.poisson_rate, "num_requests": s.poisson_requests}
    extra = {
        "label": setup.label,
        "arrival": arrival,
        "num_adapters": setup.num_adapters,
        "max_loras": group.max_loras,
        "max_cpu_loras": group.max_cpu_loras,
    }
    return await workload(bench, client, base_model, f"{setup.label} {arrival}", flags, index, extra)


async def zipf_workload(
    bench: Bench, client: httpx.AsyncClient, base_model: str, mode: dict[str, Any]
) -> dict[str, Any]:
    """Poisson at zipf_load of the single-adapter burst's completed requests per second."""
    s = bench.settings
    measured = [r["requests_per_s"] for r in mode["table"] if r["num_adapters"] == 1 and r["arrival"] == "burst"]
    capacity = measured[0] if measured else bench.capacity_rps
    if capacity is None:
        raise ValueError("the Zipf run needs the single-adapter capacity: run group 0 too, or pass --capacity-rps")
    mode["capacity_requests_per_s"] = capacity
    rate = round(s.zipf_load * capacity, 3)
    flags = {"adapter_dir": bench.dir("zipf"), "num_adapters": s.zipf_adapters, "ranks": s.zipf_rank}
    flags |= {"popularity": "zipf", "zipf_s": s.zipf_s, "arrival": "poisson", "rate": rate}
    flags["num_requests"] = s.zipf_requests
    extra = {
        "label": f"zipf {s.zipf_adapters}a/{s.zipf_max_loras}s",
        "arrival": "zipf poisson",
        "num_adapters": s.zipf_adapters,
        "max_loras": s.zipf_max_loras,
        "max_cpu_loras": s.zipf_max_cpu_loras,
        "rate": rate,
    }
    return await workload(bench, client, base_model, extra["label"], flags, 1000, extra)


async def workload(
    bench: Bench,
    client: httpx.AsyncClient,
    base_model: str,
    name: str,
    flags: dict[str, Any],
    index: int,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """Plan with bench_serving's flags, register the adapters, run, unload; one table row."""
    s = bench.settings
    fields = {"base_url": client.base_url, "model_dir": bench.model_dir, "adapter_prefix": f"w{index}-"}
    fields |= {"input_len": s.input_len, "output_len": s.output_len, "seed": bench.seed * 10_000 + index}
    args = parse_config(_argv({**fields, "timeout_s": 600, **flags}))
    plan, weights = plan_workload(args, bench.prompt_config)
    specs = adapter_specs(args.num_adapters, args.ranks, args.adapter_dir, args.adapter_prefix)
    loaded: list[str] = []
    try:
        await register(client, specs, loaded, s.load_concurrency)
        results = await run_plan(
            client, plan, [a.name for a in specs], base_model, args.output_len, args.max_concurrency
        )
    finally:
        failures = await unload_adapters(client, loaded)
    summary = summarize(vars(args), plan, weights, results, specs, base_model)
    row = churn_report.workload_row(name, summary, results, extra)
    row["unload_failures"] = failures
    print(
        f"{name}: {row['num_errors']} errors, {row['output_tokens_per_s']} out tok/s, "
        f"TTFT p50 {row['ttft_ms']['p50']} ms p99 {row['ttft_ms']['p99']} ms",
        file=sys.stderr,
    )
    return row


async def register(
    client: httpx.AsyncClient, specs: Sequence[AdapterSpec], loaded: list[str], concurrency: int
) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(spec: AdapterSpec) -> None:
        async with gate:
            await load_adapters(client, [spec], loaded)

    await asyncio.gather(*(one(spec) for spec in specs))


def _argv(fields: dict[str, Any]) -> list[str]:
    """bench_serving's command line for these fields (named as its flags' destinations)."""
    return [part for key, value in fields.items() for part in ("--" + key.replace("_", "-"), str(value))]


def _check_idle(server: Server, mode: dict[str, Any], after: str) -> None:
    """The engine must go idle holding no request, block, pin or deferral; a leak is recorded."""
    try:
        server.wait_idle(timeout_s=60)
    except TimeoutError as e:
        mode.setdefault("leaks", []).append({"after": after, "found": str(e)[:500]})
