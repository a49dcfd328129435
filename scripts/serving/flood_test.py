"""Flood a ledgerserve server on this machine (loopback only) and report whether its
memory stays flat and the queue bound holds.

    python -m scripts.serving.flood_test --base-url http://127.0.0.1:8000 --pid LAUNCHER_PID \\
        --duration-s 20 --concurrency 64

`--concurrency` clients send small completions back to back for `--duration-s` seconds,
far more than `--max-num-seqs + --max-waiting-requests` can hold, so the server must
answer part of them 503 with Retry-After. Resident memory of the launcher's process tree
is read before the flood, after a warm-up flood (allocator pools and caches settle),
and after the measured flood, once the engine is idle again. Prints one JSON object:
statuses, how many 503s carried Retry-After, and RSS per process in MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import httpx
import psutil

from scripts.common.request_loop import base_model, check_loopback
from scripts.serving import load_test


def rss_mib(launcher_pid: int) -> dict[str, float]:
    """RSS of the launcher and each child, keyed by the child's module (or 'launcher')."""
    root = psutil.Process(launcher_pid)
    out = {"launcher": root.memory_info().rss / 2**20}
    for child in root.children(recursive=True):
        cmd = child.cmdline()
        name = next((arg for arg in cmd if arg.endswith(".main")), str(child.pid))
        out[name] = child.memory_info().rss / 2**20
    return {k: round(v, 1) for k, v in sorted(out.items())}


async def _client(client: httpx.AsyncClient, model: str, deadline: float, counts: dict[str, int]) -> None:
    body = {"model": model, "prompt": "flood", "max_tokens": 4}
    while time.monotonic() < deadline:
        try:
            r = await client.post("/v1/completions", json=body)
            key = str(r.status_code)
            if r.status_code == 503 and "retry-after" in r.headers:
                counts["503_with_retry_after"] = counts.get("503_with_retry_after", 0) + 1
        except httpx.HTTPError as e:
            key = type(e).__name__
        counts[key] = counts.get(key, 0) + 1


async def flood(base_url: str, concurrency: int, duration_s: float) -> dict[str, int]:
    counts: dict[str, int] = {}
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        model = await base_model(client)
        deadline = time.monotonic() + duration_s
        await asyncio.gather(*[_client(client, model, deadline, counts) for _ in range(concurrency)])
    return counts


def wait_idle(base_url: str) -> None:
    _, found = load_test.wait_idle(base_url, timeout_s=60.0)
    if found:
        raise RuntimeError(f"the engine did not go idle after the flood: {found}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--pid", type=int, required=True, help="the launcher's pid")
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args(argv)
    check_loopback(args.base_url)
    if not (0 < args.duration_s <= 600 and 0 < args.concurrency <= 1024):
        raise ValueError("--duration-s must be in (0, 600] and --concurrency in (0, 1024]")
    before = rss_mib(args.pid)
    asyncio.run(flood(args.base_url, args.concurrency, args.warmup_s))
    wait_idle(args.base_url)
    warm = rss_mib(args.pid)
    counts = asyncio.run(flood(args.base_url, args.concurrency, args.duration_s))
    wait_idle(args.base_url)
    after = rss_mib(args.pid)
    growth = {k: round(after[k] - warm[k], 1) for k in after if k in warm}
    return {
        "statuses": counts,
        "rss_mib_before": before,
        "rss_mib_after_warmup": warm,
        "rss_mib_after_flood": after,
        "rss_growth_during_flood_mib": growth,
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
    sys.exit(0)
