"""The request loop that scripts/adapters/lora_stress.py and scripts/serving/load_test.py share: pick a request
(base model, adapter by `model`, or by `lora_path`; completion or chat), send it plain,
streaming or as a stream the client closes after its first chunk, time it, and record its
outcome; and one adapter's admin cycle (1-2 racing loads, an in-place reload, a hold, an
unload). Each script keeps its own schedule, checks and report."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

REQUEST_KINDS = ("base", "adapter", "lora_path")


@dataclass
class Outcome:
    kind: str  # base | adapter | lora_path | load | reload | unload | setup_unload
    adapter: str | None
    status: int  # HTTP status, the code of a stream's error event; 0: transport error, -1: cut stream
    start_s: float
    end_s: float
    group: int = 0  # loads sent together share a group id
    group_size: int = 1
    detail: str = ""
    by_path: bool = False  # a lora_path request naming the adapter's directory, not its name


@dataclass
class Run:
    args: argparse.Namespace
    model: str
    rng: random.Random
    outcomes: list[Outcome] = field(default_factory=list)
    next_group: int = 1


def check_loopback(base_url: str) -> None:
    host = urlparse(base_url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise ValueError(f"refusing to stress a non-loopback server: {base_url!r}")


def parse_adapters(specs: list[str]) -> dict[str, str]:
    adapters = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--adapters: {spec!r} is not NAME=PATH")
        adapters[name] = path
    return adapters


def loop_parser(description: str) -> argparse.ArgumentParser:
    """The flags both scripts take: the server, the clients, the adapters and the requests."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument(
        "--adapters", nargs="*", default=[], metavar="NAME=PATH", help="paths inside the server's allowed dir"
    )
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=60.0, help="per-request timeout")
    return p


def check_loop_args(args: argparse.Namespace) -> None:
    """ValueError unless the server is on loopback and every adapter is NAME=PATH."""
    check_loopback(args.base_url)
    parse_adapters(args.adapters)


def percentile(values: list[float], pct: float) -> float | None:
    """The order statistic at `pct` of sorted `values`, rounded; None if empty."""
    if not values:
        return None
    return round(values[min(len(values) - 1, int(len(values) * pct / 100))], 2)


async def base_model(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return next(card["id"] for card in r.json()["data"] if card.get("parent") is None)


async def post(client: httpx.AsyncClient, path: str, body: dict) -> tuple[int, str]:
    r = await client.post(path, json=body)
    return r.status_code, "" if r.status_code == 200 else r.text


async def stream(client: httpx.AsyncClient, path: str, body: dict, abort: bool = False) -> tuple[int, str]:
    """Read a stream to [DONE]; with `abort`, close it after its first data line (a client abort)."""
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode(errors="replace")
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                return 200, ""
            if line.startswith("data: {") and '"error"' in line:
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    return int(event["error"].get("code") or 500), line
            if abort and line.startswith("data: "):
                return 200, "aborted"
    return -1, "stream ended without data" if abort else "stream ended without [DONE]"


async def timed(run: Run, kind: str, adapter: str | None, send: Callable[[], Awaitable], **extra: Any) -> Outcome:
    start = time.monotonic()
    try:
        status, detail = await send()
    except httpx.HTTPError as e:
        status, detail = 0, f"{type(e).__name__}: {e}"
    outcome = Outcome(kind, adapter, status, start, time.monotonic(), detail=detail[:200], **extra)
    run.outcomes.append(outcome)
    return outcome


def pick_request(run: Run, adapters: dict[str, str], text: str) -> tuple[str, str | None, str, dict[str, Any]]:
    """(kind, adapter name, path, body) of one random request; `text` words its prompt."""
    kind = run.rng.choice(REQUEST_KINDS) if adapters else "base"
    name = run.rng.choice(sorted(adapters)) if kind != "base" else None
    body: dict[str, Any] = {"model": name if kind == "adapter" else run.model, "max_tokens": run.args.max_tokens}
    if kind == "lora_path" and name is not None:
        body["lora_path"] = run.rng.choice((name, adapters[name]))
    if run.rng.random() < 0.5:
        path, body["prompt"] = "/v1/completions", f"{text} test prompt {run.rng.randrange(1000)}"
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    return kind, name, path, body


async def send_one(
    run: Run, client: httpx.AsyncClient, adapters: dict[str, str], text: str, abort_fraction: float = 0.0
) -> Outcome:
    """One random request: half streamed, `abort_fraction` of all closed after the first chunk."""
    kind, name, path, body = pick_request(run, adapters, text)
    roll = run.rng.random()
    body["stream"] = roll < 0.5
    if body["stream"]:
        send = lambda: stream(client, path, body, abort=roll < abort_fraction)  # noqa: E731
    else:
        send = lambda: post(client, path, body)  # noqa: E731
    return await timed(run, kind, name, send, by_path=kind == "lora_path" and body["lora_path"] != name)


async def admin_cycle(run: Run, client: httpx.AsyncClient, name: str, path: str, hold_s: float) -> None:
    """1-2 racing loads (one group), an in-place reload, `hold_s` loaded, an unload."""
    group, run.next_group = run.next_group, run.next_group + 1
    size = run.rng.choice((1, 2))
    body = {"lora_name": name, "lora_path": path}

    def load() -> Awaitable:
        return timed(
            run, "load", name, lambda: post(client, "/v1/load_lora_adapter", body), group=group, group_size=size
        )

    await asyncio.gather(*(load() for _ in range(size)))
    reload = {**body, "load_inplace": True}
    await timed(run, "reload", name, lambda: post(client, "/v1/load_lora_adapter", reload))
    await asyncio.sleep(hold_s)
    await timed(run, "unload", name, lambda: post(client, "/v1/unload_lora_adapter", {"lora_name": name}))


async def run_loop(args: argparse.Namespace, loop: Callable[[Run, httpx.AsyncClient], Awaitable]) -> list[Outcome]:
    """Unload every `--adapters` name first (200 or 404), then run `loop`; every outcome."""
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout_s) as client:
        run = Run(args, await base_model(client), random.Random(args.seed))
        for name in parse_adapters(args.adapters):
            body = {"lora_name": name}
            await timed(run, "setup_unload", name, lambda b=body: post(client, "/v1/unload_lora_adapter", b))
        await loop(run, client)
    return run.outcomes
