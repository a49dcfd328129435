"""A bounded load test of a ledgerserve server on this machine (loopback only).

    python -m scripts.serving.load_test --base-url http://127.0.0.1:8000 --duration-s 30 \\
        --concurrency 6 --adapters a=/loras/a b=/loras/b

Run it from the repository root (it imports `scripts.common.request_loop`, the request loop it
shares with scripts/adapters/lora_stress.py). With `--adapters`, the server needs `--enable-lora` and
a `--lora-allowed-dir` that holds those directories: the test loads and unloads them over
the API.

For `--duration-s` seconds, `--concurrency` clients send completions (plain and chat,
streaming and not) to the base model, to an adapter by `model`, or by `lora_path`; a
`--abort-fraction` of them are streams the client closes after the first chunk. Per
adapter, one admin task cycles load (1-2 racing), in-place reload, hold, unload.

Errors are the statuses scripts/adapters/lora_stress.py calls unexpected (its rules, reused): a
base request must get 200; an adapter request 200 while the adapter may be loaded and
404 while it may be unloaded (racing its own unload is expected; by its path, 200 also
while unloaded: the server loads it on demand); a load group exactly
one 200 (a racing duplicate gets 400); reloads and unloads 200. A transport error (0) or
a stream cut without [DONE] (-1) is always an error; a client abort is not.

Afterwards it waits until the engine is idle and checks /metrics: every KV block free or
cached, no adapter slot pinned, no eviction deferred. Prints a JSON report and exits 1 on
any error or leak. `main(argv) -> dict` is the importable entry (it does not print).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import httpx

from scripts.adapters.lora_stress import summarize
from scripts.common.request_loop import (
    REQUEST_KINDS,
    Outcome,
    Run,
    admin_cycle,
    check_loop_args,
    loop_parser,
    parse_adapters,
    percentile,
    run_loop,
    send_one,
)


async def _until_deadline(run: Run, client: httpx.AsyncClient) -> None:
    """Clients send back to back and each adapter cycles through its admin ops until the deadline."""
    args, adapters = run.args, parse_adapters(run.args.adapters)
    deadline = time.monotonic() + args.duration_s

    async def requests() -> None:
        while time.monotonic() < deadline:
            await send_one(run, client, adapters, "load", args.abort_fraction)

    async def admin(name: str, path: str) -> None:
        while time.monotonic() < deadline:
            await admin_cycle(run, client, name, path, run.rng.uniform(0.3, 1.5) * args.hold_scale)
            await asyncio.sleep(run.rng.uniform(0.0, 0.2))

    await asyncio.gather(
        *(admin(name, path) for name, path in adapters.items()), *(requests() for _ in range(args.concurrency))
    )


def read_metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=5.0).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def leaks(m: dict[str, float]) -> list[str]:
    """What an idle engine still holds, by name (empty: nothing)."""
    found = []
    if m.get("ledgerserve_num_requests_running", -1) != 0 or m.get("ledgerserve_num_requests_waiting", -1) != 0:
        found.append("requests still running or waiting")
    reclaimable = m.get("ledgerserve_kv_blocks_free", 0) + m.get("ledgerserve_kv_blocks_cached", 0)
    if reclaimable != m.get("ledgerserve_kv_blocks_total"):
        found.append(f"KV blocks leaked: {reclaimable} free or cached of {m.get('ledgerserve_kv_blocks_total')}")
    if m.get("ledgerserve_lora_pinned_slots", -1) != 0:
        found.append("adapter slots still pinned")
    if m.get("ledgerserve_lora_deferred_evictions", -1) != 0:
        found.append("adapter evictions still deferred")
    return found


def wait_idle(base_url: str, timeout_s: float) -> tuple[dict[str, float], list[str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = read_metrics(base_url)
        found = leaks(m)
        if not found or time.monotonic() > deadline:
            return m, found
        time.sleep(0.1)


def report(outcomes: list[Outcome], metrics: dict[str, float], found: list[str], duration_s: float) -> dict[str, Any]:
    summary = summarize(outcomes)
    requests = [o for o in outcomes if o.kind in REQUEST_KINDS]
    served = sorted((o.end_s - o.start_s) * 1000 for o in requests if o.status == 200 and o.detail != "aborted")
    return {
        "duration_s": duration_s,
        "num_requests": len(requests),
        "num_aborted": sum(o.detail == "aborted" for o in requests),
        "num_admin_ops": len(outcomes) - len(requests),
        "counts": summary["counts"],
        "errors": len(summary["unexpected"]),
        "unexpected": summary["unexpected"][:20],
        "latency_ms": {"p50": percentile(served, 50), "p99": percentile(served, 99)},  # 200s, not aborted
        "leaks": found,
        "idle_metrics": {k: v for k, v in metrics.items() if k.startswith(("ledgerserve_kv", "ledgerserve_lora"))},
        "ok": not summary["unexpected"] and not found,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = loop_parser(__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--abort-fraction", type=float, default=0.15, help="share of requests closed after the first chunk")
    p.add_argument("--hold-scale", type=float, default=1.0, help="scales how long each adapter stays loaded per cycle")
    p.add_argument("--idle-timeout-s", type=float, default=30.0, help="how long to wait for the engine to go idle")
    return p.parse_args(argv)


def validate(args: argparse.Namespace) -> None:
    check_loop_args(args)
    if not 0 < args.duration_s <= 3600:
        raise ValueError("--duration-s must be in (0, 3600]")
    if not 1 <= args.concurrency <= 256:
        raise ValueError("--concurrency must be in [1, 256]")
    if not 0.0 <= args.hold_scale <= 60.0:
        raise ValueError("--hold-scale must be in [0, 60]")
    if not 0.0 <= args.abort_fraction <= 0.5:
        raise ValueError("--abort-fraction must be in [0, 0.5] (aborts are streams, half of all requests)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the load test; return the report. Raises ValueError on bad arguments."""
    args = parse_args(argv)
    validate(args)
    started = time.monotonic()
    outcomes = asyncio.run(run_loop(args, _until_deadline))
    metrics, found = wait_idle(args.base_url, args.idle_timeout_s)
    return report(outcomes, metrics, found, round(time.monotonic() - started, 1))


def cli(argv: list[str] | None = None) -> int:
    try:
        result = main(argv)
    except ValueError as e:
        print(f"load_test: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(cli())
