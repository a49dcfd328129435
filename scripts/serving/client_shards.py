"""A benchmark client spread over processes, so the client is never what a pass measures.

One Python process parsing every streamed event of 128 streams (~12,000 events a second at
~12k output tok/s) uses a whole core on a slow host, and then the server waits on the client:
requests start late and their time to first token includes the client's own queue. Here the
plan is dealt out by index to `num_shards` processes (`python -m scripts.serving.client_shards`),
each with an equal share of the requests in flight; they send at the plan's arrival times from
one shared start instant (time.perf_counter is CLOCK_MONOTONIC, one clock for every process
on the host), and each writes its results as JSON lines that the caller merges.

The child reads one JSON job from stdin after it prints "ready" (its imports done), so the start
instant is not spent importing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from scripts.serving.bench_serving import run_plan
from scripts.serving.serving_report import RequestResult
from scripts.serving.serving_workload import PlannedRequest

START_DELAY_S = 0.2  # from sending the jobs to the shared start instant


def default_num_shards(max_concurrency: int | None) -> int:
    """One client process per 32 requests in flight (4 for the 128 of a burst), at least one."""
    return max(1, math.ceil((max_concurrency or 32) / 32))


def deal(plan: Sequence[PlannedRequest], num_shards: int) -> list[list[PlannedRequest]]:
    """Shard i takes requests i, i + num_shards, ...: each sees the same mix of arrivals."""
    return [list(plan[i::num_shards]) for i in range(num_shards)]


def shard_concurrency(max_concurrency: int | None, num_shards: int, shard: int) -> int | None:
    """Shares of max_concurrency that add up to it (None: unbounded)."""
    if not max_concurrency:
        return None
    return max_concurrency // num_shards + (1 if shard < max_concurrency % num_shards else 0)


async def run_sharded(
    base_url: str,
    plan: Sequence[PlannedRequest],
    models: Sequence[str],
    base_model: str,
    output_len: int,
    max_concurrency: int | None,
    num_shards: int,
) -> list[RequestResult]:
    """Run `plan` from `num_shards` client processes; results in plan order."""
    num_shards = max(1, min(num_shards, len(plan), max_concurrency or len(plan)))
    parts = deal(plan, num_shards)
    procs = [await _spawn() for _ in parts]
    try:
        start_s = time.perf_counter() + START_DELAY_S
        for i, (proc, part) in enumerate(zip(procs, parts)):
            job = {"base_url": base_url, "models": list(models), "base_model": base_model, "output_len": output_len}
            job |= {"max_concurrency": shard_concurrency(max_concurrency, num_shards, i), "start_s": start_s}
            job["plan"] = [dataclasses.asdict(p) for p in part]
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(job).encode() + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
        outputs = await asyncio.gather(*(_results(proc) for proc in procs))
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()
    return sorted((r for out in outputs for r in out), key=lambda r: r.index)


async def _spawn() -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "scripts.serving.client_shards",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    if (await proc.stdout.readline()).strip() != b"ready":
        raise RuntimeError("a client shard did not start")
    return proc


async def _results(proc: asyncio.subprocess.Process) -> list[RequestResult]:
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"a client shard exited with {proc.returncode}")
    return [RequestResult(**json.loads(line)) for line in out.decode().splitlines() if line.strip()]


async def _serve_job(job: dict[str, Any]) -> list[RequestResult]:
    plan = [PlannedRequest(**p) for p in job["plan"]]
    limits = httpx.Limits(max_connections=len(plan) + 8)
    async with httpx.AsyncClient(base_url=job["base_url"], timeout=600.0, limits=limits) as client:
        return await run_plan(
            client, plan, job["models"], job["base_model"], job["output_len"], job["max_concurrency"],
            start_s=job["start_s"],
        )  # fmt: skip


def main() -> int:
    print("ready", flush=True)
    job = json.loads(sys.stdin.readline())
    for result in asyncio.run(_serve_job(job)):
        print(json.dumps(dataclasses.asdict(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
