"""A serving benchmark: drives a running ledgerserve (or vLLM-compatible) server on loopback
with a multi-LoRA workload and reports throughput, latency percentiles and fairness.

    python -m scripts.serving.bench_serving --base-url http://127.0.0.1:8000 --model-dir /models/base \\
        --adapter-dir /adapters/bench --num-adapters 8 --ranks 8,16,32 --popularity zipf \\
        --zipf-s 1.1 --base-share 0.2 --arrival poisson --rate 4 --num-requests 200 \\
        --input-len 256 --output-len 64 --out report.json --plot report.png

Adapters: --num-adapters random PEFT LoRA adapters shaped for the base model (its
config.json in --model-dir) are written to --adapter-dir/adapter-<i> (inside the server's
--lora-allowed-dir), adapter i of rank ranks[i % len(ranks)] on --target-modules. They are
loaded by POST /v1/load_lora_adapter as <--adapter-prefix><i> and unloaded at the end,
also when the run fails.

Workload (all drawn from --seed, one random stream per aspect):
- base share: round(base_share * num_requests) requests, at shuffled positions, go to the
  base model; the rest pick an adapter by popularity.
- popularity: uniform, or Zipf: the adapter at popularity rank k (1..N) has weight 1/k^s.
  Which adapter gets which popularity rank is a seeded shuffle, so popularity is not tied
  to adapter rank. The share of adapter requests that the top 1 and top 10 adapters got is
  reported (and printed, with the expected shares from the weights).
- arrivals: poisson (exponential gaps of mean 1/rate, the first at t=0), or burst (all at
  t=0, or groups of --burst-size every --burst-interval-s).
- prompts: --input-len random token ids (the config's bos/eos/pad ids left out), sent as a
  list of ints to streaming /v1/completions; the output length is forced: max_tokens =
  min_tokens = output_len with ignore_eos, greedy. `return_token_ids` is set so that every
  token arrives in a chunk even when its text is empty.

Per request: TTFT = send to the first chunk that carries a token; TPOT = (last token chunk
- first token chunk) / (output tokens - 1), for outputs of 2 tokens or more; E2E = send to
[DONE]; output tokens from the usage chunk. A non-200 status, an error event, a transport
error or a stream without [DONE] is an error: counted by status, left out of the latency
and throughput figures. Percentiles interpolate linearly between order statistics (as
numpy's default). Throughputs are over the wall time from the first send to the last reply.

Fairness: Jain's index (sum x)^2 / (n * sum x^2) over x = each adapter's mean TPOT, for the
adapters with a completed request (the base model is left out): 1 when all adapters decode
equally fast, towards 1/n when one is much slower. Also the max/min ratio of those means.
TPOT rather than throughput normalised by demand, because with the output length forced
every completed request gets exactly its demand: that ratio would always be 1.

A workload file (--workload FILE) is a JSON object whose keys are the long flag names
(dashes or underscores), e.g. {"num_adapters": 8, "ranks": [8, 16, 32], "popularity":
"zipf"}. Flags given on the command line override the file; the file overrides defaults.

`main(argv) -> dict` is the importable entry: it returns the report (and writes --out and
--plot; the plot needs matplotlib, `pip install 'ledgerserve[plot]'`, and without it the
report is written all the same). Run as a module, it prints the popularity line, then the report as JSON,
and tells its progress on stderr: each set-up stage as it starts (writing, loading and unloading the
adapters) and, while the requests run, how many were sent and answered every few seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from ledgerserve.shared.adapter_format import BaseShapes
from scripts.common import request_loop
from scripts.common.plot import write_png
from scripts.common.report_files import write_json
from scripts.serving.serving_report import RequestResult, StreamTally, plot_panels, result_of, summarize
from scripts.serving.serving_workload import (
    AdapterSpec,
    PlannedRequest,
    adapter_specs,
    parse_config,
    plan_workload,
    popularity_line,
    popularity_shares,
    read_model_config,
    request_body,
)

PROGRESS_EVERY_S = 5.0
Say = Callable[[str], None]


def quiet(_: str) -> None:
    """Progress nobody reads (the importable main's default)."""


def to_stderr(message: str) -> None:
    print(f"bench_serving: {message}", file=sys.stderr, flush=True)


# ---- IO ------------------------------------------------------------------------------


def write_adapters(specs: Sequence[AdapterSpec], hf_config: dict[str, Any], targets: list[str]) -> None:
    from scripts.common.bench_fixtures import write_adapter  # torch: only when adapters are written

    base = BaseShapes.from_hf_config(hf_config)
    for i, spec in enumerate(specs):
        path = write_adapter(os.path.dirname(spec.path), i, base, spec.rank, "cpu", targets)
        assert os.path.abspath(path) == spec.path, (path, spec.path)


async def _model_ids(client: httpx.AsyncClient) -> set[str]:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return {card["id"] for card in r.json()["data"]}


async def check_names_free(client: httpx.AsyncClient, specs: Sequence[AdapterSpec]) -> None:
    taken = sorted(await _model_ids(client) & {s.name for s in specs})
    if taken:
        raise RuntimeError(f"the server already has models named {taken}; unload them or pass another --adapter-prefix")


async def load_adapters(
    client: httpx.AsyncClient, specs: Sequence[AdapterSpec], loaded: list[str], say: Say = quiet
) -> None:
    """Load each adapter, appending its name to `loaded` once the server has it."""
    for spec in specs:
        say(f"loading adapter {len(loaded) + 1}/{len(specs)}: {spec.name} (rank {spec.rank})")
        status, detail = await request_loop.post(
            client, "/v1/load_lora_adapter", {"lora_name": spec.name, "lora_path": spec.path}
        )
        if status != 200:
            raise RuntimeError(f"loading adapter {spec.name} from {spec.path} failed: HTTP {status}: {detail[:500]}")
        loaded.append(spec.name)


async def unload_adapters(client: httpx.AsyncClient, names: Sequence[str]) -> list[str]:
    """Unload every name; returns what failed (also told on stderr)."""
    failures = []
    for name in names:
        try:
            status, detail = await request_loop.post(client, "/v1/unload_lora_adapter", {"lora_name": name})
        except httpx.HTTPError as e:
            status, detail = 0, f"{type(e).__name__}: {e}"
        if status != 200:
            failures.append(f"{name}: HTTP {status}: {detail[:200]}")
            print(f"bench_serving: unloading {name} failed: HTTP {status}: {detail[:200]}", file=sys.stderr)
    return failures


async def send_request(client: httpx.AsyncClient, planned: PlannedRequest, body: dict[str, Any]) -> RequestResult:
    tally = StreamTally()
    start_s = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:200]
                return RequestResult(
                    planned.index, planned.adapter, r.status_code, start_s, time.perf_counter(), detail
                )
            async for line in r.aiter_lines():
                tally.feed(line, time.perf_counter())
                if tally.done:
                    break
    except httpx.HTTPError as e:
        return RequestResult(
            planned.index, planned.adapter, 0, start_s, time.perf_counter(), f"{type(e).__name__}: {e}"[:200]
        )
    return result_of(planned, tally, start_s, time.perf_counter())


async def run_plan(
    client: httpx.AsyncClient,
    plan: Sequence[PlannedRequest],
    models: Sequence[str],
    base_model: str,
    output_len: int,
    max_concurrency: int | None,
    say: Say = quiet,
    start_s: float | None = None,
) -> list[RequestResult]:
    """Send each request at its arrival time after `start_s` (time.perf_counter; default now), at
    most `max_concurrency` in flight."""
    gate = asyncio.Semaphore(max_concurrency or len(plan))
    start_s = time.perf_counter() if start_s is None else start_s
    done: list[RequestResult] = []

    async def one(planned: PlannedRequest) -> RequestResult:
        await asyncio.sleep(max(0.0, start_s + planned.arrival_s - time.perf_counter()))
        model = base_model if planned.adapter is None else models[planned.adapter]
        async with gate:
            result = await send_request(client, planned, request_body(model, planned.prompt, output_len))
        done.append(result)
        return result

    say(f"sending {len(plan)} requests")
    ticker = asyncio.create_task(_tell_progress(done, len(plan), start_s, say))
    try:
        return list(await asyncio.gather(*(one(p) for p in plan)))
    finally:
        ticker.cancel()
        say(_progress_line(done, len(plan), start_s))


async def _tell_progress(done: list[RequestResult], num_requests: int, start_s: float, say: Say) -> None:
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        say(_progress_line(done, num_requests, start_s))


def _progress_line(done: Sequence[RequestResult], num_requests: int, start_s: float) -> str:
    num_errors = sum(result.status != 200 for result in done)
    elapsed_s = time.perf_counter() - start_s
    return f"{len(done)}/{num_requests} requests answered ({num_errors} errors) in {elapsed_s:.1f} s"


async def _bench(
    args: argparse.Namespace,
    hf_config: dict[str, Any],
    specs: Sequence[AdapterSpec],
    plan: Sequence[PlannedRequest],
    say: Say = quiet,
) -> tuple[list[RequestResult], str, list[str]]:
    """Check the server, write and load the adapters, run the plan, unload the adapters
    (whatever happened)."""
    limits = httpx.Limits(max_connections=(args.max_concurrency or args.num_requests) + 4)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout_s, limits=limits) as client:
        say(f"asking {args.base_url} for its models")
        base_model = await request_loop.base_model(client)
        await check_names_free(client, specs)
        if specs:
            say(f"writing {len(specs)} random adapters into {os.path.dirname(specs[0].path)}")
        write_adapters(specs, hf_config, args.target_modules)  # blocks the loop: nothing is in flight yet
        loaded: list[str] = []
        try:
            await load_adapters(client, specs, loaded, say)
            models = [s.name for s in specs]
            results = await run_plan(client, plan, models, base_model, args.output_len, args.max_concurrency, say)
        finally:
            if loaded:
                say(f"unloading {len(loaded)} adapters")
            unload_failures = await unload_adapters(client, loaded)
    return results, base_model, unload_failures


def main(
    argv: Sequence[str] | None = None, echo: Callable[[str], None] | None = None, say: Say = quiet
) -> dict[str, Any]:
    """Run the benchmark; return the report. Raises ValueError on bad arguments and
    RuntimeError when the server refuses an adapter. `echo` gets the popularity line, `say`
    the progress."""
    args = parse_config(argv)
    hf_config = read_model_config(args.model_dir)
    specs = adapter_specs(args.num_adapters, args.ranks, args.adapter_dir or ".", args.adapter_prefix)
    say(f"planning {args.num_requests} requests of {args.input_len} prompt tokens")
    plan, weights = plan_workload(args, hf_config)
    if echo is not None:
        echo(popularity_line(popularity_shares([p.adapter for p in plan], weights)))
    results, base_model, unload_failures = asyncio.run(_bench(args, hf_config, specs, plan, say))
    report = summarize(vars(args), plan, weights, results, specs, base_model)
    report["unload_failures"] = unload_failures
    if args.plot and write_png(args.plot, plot_panels(results, report["per_adapter"])):
        report["plot"] = args.plot
    if args.out:
        write_json(args.out, report)
    return report


def cli(argv: Sequence[str] | None = None) -> int:
    try:
        report = main(argv, echo=print, say=to_stderr)
    except (ValueError, RuntimeError, httpx.HTTPError) as e:
        print(
            f"bench_serving: {type(e).__name__}: {e}" if isinstance(e, httpx.HTTPError) else f"bench_serving: {e}",
            file=sys.stderr,
        )
        return 2
    print(json.dumps(report, indent=2))
    return 0 if report["num_errors"] == 0 and not report["unload_failures"] else 1


if __name__ == "__main__":
    raise SystemExit(cli())
