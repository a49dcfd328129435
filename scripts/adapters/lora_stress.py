"""A bounded live stress run of multi-LoRA serving against a server on this machine.

    python -m scripts.adapters.lora_stress --base-url http://127.0.0.1:8000 --adapters a=/loras/a b=/loras/b

Each round, for every adapter in parallel, one admin task runs: a group of 1-2 concurrent
plain loads, an in-place reload, a pause, an unload. Meanwhile `--concurrency` workers
send `--requests` completions (plain and chat, streaming and not) to the base model, to
an adapter by `model`, or by the `lora_path` extension (its name or its path).

Status rules (anything else is unexpected; the exit status is 1 if there is any):
- base-model request: 200.
- adapter request over [sent, done]: 200 if the adapter may have been loaded at some
  instant of that window, 404 if it may have been unloaded at some instant of it. An
  adapter is "loaded" from the reply of its successful load to the sending of its
  unload, "unloaded" from the reply of its unload to the sending of its next load, and
  either in between (while an op is in flight). An in-place reload keeps it loaded.
  A stream counts with the code of its error event if it has one. A `lora_path` request
  by the adapter's path may also get 200 while it is unloaded: a server with
  `--lora-allowed-dir` loads it on demand (under its real path as its name).
- plain load: 200; 400 only when another load of the same adapter raced it (a group of
  two); each group must have exactly one 200.
- in-place reload: 200. unload: 200. The set-up unloads before round 1: 200 or 404.
Prints a JSON summary; `run_stress(args) -> dict` is the importable entry.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

import httpx

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

ADMIN_KINDS = {"setup_unload": {200, 404}, "reload": {200}, "unload": {200}}


async def _round(run: Run, client: httpx.AsyncClient) -> None:
    """Every adapter's admin cycle, while `--concurrency` workers share `--requests` completions."""
    args, adapters = run.args, parse_adapters(run.args.adapters)

    async def worker(num_requests: int) -> None:
        for _ in range(num_requests):
            await send_one(run, client, adapters, "stress")

    shares = [
        args.requests // args.concurrency + (i < args.requests % args.concurrency) for i in range(args.concurrency)
    ]
    await asyncio.gather(
        *(admin_cycle(run, client, name, path, run.rng.uniform(0.0, 0.2)) for name, path in adapters.items()),
        *(worker(n) for n in shares),
    )


async def _rounds(run: Run, client: httpx.AsyncClient) -> None:
    for _ in range(run.args.rounds):
        await _round(run, client)


def _transitions(outcomes: list[Outcome], adapter: str) -> list[tuple[float, str]]:
    """(time, state from then on) for one adapter; states: loaded | unloaded | either."""
    marks: list[tuple[float, str]] = []
    groups: dict[int, list[Outcome]] = {}
    for o in outcomes:
        if o.adapter == adapter and o.kind == "load":
            groups.setdefault(o.group, []).append(o)
    for loads in groups.values():
        marks.append((min(o.start_s for o in loads), "either"))
        marks += [(o.end_s, "loaded") for o in loads if o.status == 200]
    for o in outcomes:
        if o.adapter == adapter and o.kind == "unload":
            marks += [(o.start_s, "either"), (o.end_s, "unloaded" if o.status == 200 else "either")]
    return sorted(marks)


def _states_in(marks: list[tuple[float, str]], start_s: float, end_s: float) -> set[str]:
    before = [state for t, state in marks if t <= start_s]
    states = {before[-1] if before else "unloaded"}
    states.update(state for t, state in marks if start_s < t <= end_s)
    return states


def expected_statuses(o: Outcome, marks: dict[str, list[tuple[float, str]]]) -> set[int]:
    if o.kind in ADMIN_KINDS:
        return ADMIN_KINDS[o.kind]
    if o.kind == "load":
        return {200, 400} if o.group_size > 1 else {200}
    if o.kind == "base" or o.adapter is None:
        return {200}
    states = _states_in(marks[o.adapter], o.start_s, o.end_s)
    loaded = o.by_path or bool(states & {"loaded", "either"})  # by path: loaded on demand when unloaded
    return ({200} if loaded else set()) | ({404} if states & {"unloaded", "either"} else set())


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    names = sorted({o.adapter for o in outcomes if o.adapter is not None})
    marks = {name: _transitions(outcomes, name) for name in names}
    counts: dict[str, dict[str, int]] = {}
    unexpected = []
    for o in outcomes:
        kind_counts = counts.setdefault(o.kind, {})
        kind_counts[str(o.status)] = kind_counts.get(str(o.status), 0) + 1
        if o.status not in expected_statuses(o, marks):
            unexpected.append({"kind": o.kind, "adapter": o.adapter, "status": o.status, "detail": o.detail})
    unexpected += _group_violations(outcomes)
    latencies = sorted((o.end_s - o.start_s) * 1000 for o in outcomes if o.kind in REQUEST_KINDS)
    return {
        "num_requests": len(outcomes),
        "counts": counts,
        "unexpected": unexpected,
        "latency_ms": {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99)},
    }


def _group_violations(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    groups: dict[int, list[Outcome]] = {}
    for o in outcomes:
        if o.kind == "load":
            groups.setdefault(o.group, []).append(o)
    bad = []
    for loads in groups.values():
        num_ok = sum(o.status == 200 for o in loads)
        if num_ok != 1:
            bad.append(
                {
                    "kind": "load_group",
                    "adapter": loads[0].adapter,
                    "status": num_ok,
                    "detail": f"{num_ok} of {len(loads)} racing loads succeeded; exactly 1 should",
                }
            )
    return bad


def run_stress(args: argparse.Namespace) -> dict[str, Any]:
    check_loop_args(args)
    if args.concurrency < 1 or args.rounds < 1 or args.requests < 0:
        raise ValueError("--concurrency and --rounds must be >= 1, --requests >= 0")
    return summarize(asyncio.run(run_loop(args, _rounds)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = loop_parser(__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=24, help="completions per round")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        summary = run_stress(args)
    except ValueError as e:
        print(f"lora_stress: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 1 if summary["unexpected"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
