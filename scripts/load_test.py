"""A bounded load test of a ledgerserve server on this machine (loopback only).

    python -m scripts.load_test --base-url http://127.0.0.1:8000 --duration-s 30 \\
        --concurrency 6 --adapters a=/loras/a b=/loras/b

Run it from the repository root (it imports `scripts.lora_stress`). With `--adapters`, the
server needs `--enable-lora` and a `--lora-allowed-dir` that holds those directories: the
test loads and unloads them over the API.

For `--duration-s` seconds, `--concurrency` clients send completions (plain and chat,
streaming and not) to the base model, to an adapter by `model`, or by `lora_path`; a
`--abort-fraction` of them are streams the client closes after the first chunk. Per
adapter, one admin task cycles load (1-2 racing), in-place reload, hold, unload.

Errors are the statuses scripts/lora_stress.py calls unexpected (its rules, reused): a
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
import random
import sys
import time
from typing import Any

import httpx

from scripts.lora_stress import (
    Outcome,
    Run,
    _base_model,
    _percentile,
    _post,
    _stream,
    _timed,
    check_loopback,
    parse_adapters,
    summarize,
)

REQUEST_KINDS = ("base", "adapter", "lora_path")


async def _aborted_stream(client: httpx.AsyncClient, path: str, body: dict) -> tuple[int, str]:
    """Open a stream and close it after its first data line (a client abort)."""
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode(errors="replace")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"error"' in line:
                return int(json.loads(line[len("data: ") :])["error"].get("code") or 500), line
            if line.startswith("data: "):
                return 200, "aborted"
    return -1, "stream ended without data"


def _request_body(run: Run, adapters: dict[str, str]) -> tuple[str, str | None, str, dict[str, Any]]:
    kind = run.rng.choice(REQUEST_KINDS) if adapters else "base"
    name = run.rng.choice(sorted(adapters)) if kind != "base" else None
    body: dict[str, Any] = {"model": name if kind == "adapter" else run.model, "max_tokens": run.args.max_tokens}
    if kind == "lora_path" and name is not None:
        body["lora_path"] = run.rng.choice((name, adapters[name]))
    if run.rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", f"load test prompt {run.rng.randrange(1000)}"
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "load"}]
    return kind, name, path, body


async def _client(run: Run, client: httpx.AsyncClient, deadline: float) -> None:
    adapters = parse_adapters(run.args.adapters)
    while time.monotonic() < deadline:
        kind, name, path, body = _request_body(run, adapters)
        roll = run.rng.random()
        body["stream"] = roll < 0.5
        if roll < run.args.abort_fraction:
            send = lambda: _aborted_stream(client, path, body)  # noqa: E731
        elif body["stream"]:
            send = lambda: _stream(client, path, body)  # noqa: E731
        else:
            send = lambda: _post(client, path, body)  # noqa: E731
        await _timed(run, kind, name, send, by_path=kind == "lora_path" and body["lora_path"] != name)


async def _admin_loop(run: Run, client: httpx.AsyncClient, name: str, path: str, deadline: float) -> None:
    """Cycle: 1-2 racing loads, an in-place reload, hold it loaded a while, unload."""
    body = {"lora_name": name, "lora_path": path}
    while time.monotonic() < deadline:
        group, run.next_group = run.next_group, run.next_group + 1
        size = run.rng.choice((1, 2))
        await asyncio.gather(
            *(
                _timed(
                    run,
                    "load",
                    name,
                    lambda: _post(client, "/v1/load_lora_adapter", body),
                    group=group,
                    group_size=size,
                )
                for _ in range(size)
            )
        )
        await _timed(
            run, "reload", name, lambda: _post(client, "/v1/load_lora_adapter", {**body, "load_inplace": True})
        )
        await asyncio.sleep(run.rng.uniform(0.3, 1.5) * run.args.hold_scale)
        await _timed(run, "unload", name, lambda: _post(client, "/v1/unload_lora_adapter", {"lora_name": name}))
        await asyncio.sleep(run.rng.uniform(0.0, 0.2))


async def _run(args: argparse.Namespace) -> list[Outcome]:
    adapters = parse_adapters(args.adapters)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout_s) as client:
        run = Run(args, await _base_model(client), random.Random(args.seed))
        for name in adapters:
            await _timed(
                run, "setup_unload", name, lambda n=name: _post(client, "/v1/unload_lora_adapter", {"lora_name": n})
            )
        deadline = time.monotonic() + args.duration_s
        await asyncio.gather(
            *(_admin_loop(run, client, name, path, deadline) for name, path in adapters.items()),
            *(_client(run, client, deadline) for _ in range(args.concurrency)),
        )
    return run.outcomes


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
        "latency_ms": {"p50": _percentile(served, 50), "p99": _percentile(served, 99)},  # 200s, not aborted
        "leaks": found,
        "idle_metrics": {k: v for k, v in metrics.items() if k.startswith(("ledgerserve_kv", "ledgerserve_lora"))},
        "ok": not summary["unexpected"] and not found,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--duration-s", type=float, default=30.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--adapters", nargs="*", default=[], metavar="NAME=PATH", help="paths inside the server's allowed dir"
    )
    p.add_argument("--abort-fraction", type=float, default=0.15, help="share of requests closed after the first chunk")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--hold-scale", type=float, default=1.0, help="scales how long each adapter stays loaded per cycle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=60.0, help="per-request timeout")
    p.add_argument("--idle-timeout-s", type=float, default=30.0, help="how long to wait for the engine to go idle")
    return p.parse_args(argv)


def validate(args: argparse.Namespace) -> None:
    check_loopback(args.base_url)
    parse_adapters(args.adapters)
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
    outcomes = asyncio.run(_run(args))
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
