#!/usr/bin/env python3
"""Prefix-cache benchmark: time to first token (TTFT) of a long prompt sent cold, then
repeated, against a running ledgerserve (or any vLLM-compatible) server on loopback.

    python -m scripts.serving.bench_prefix_cache --base-url http://127.0.0.1:8000 --model m \
        --prompt-tokens 1000 --repeats 5

TTFT is the time from sending a streaming /v1/completions request to its first SSE
chunk. The prompt is a list of token ids, fresh for each run (salted with --seed), so the
first send is a cache miss and the repeats can hit. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
import urllib.parse
from typing import Any

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=2)
    parser.add_argument("--max-token-id", type=int, default=1000, help="prompt ids are drawn below this (vocab bound)")
    parser.add_argument(
        "--seed", type=int, default=None, help="prompt salt; default: the clock, so each run starts cold"
    )
    parser.add_argument("--timeout-s", type=float, default=120.0)
    args = parser.parse_args(argv)
    if args.prompt_tokens <= 0 or args.repeats <= 0 or args.max_tokens <= 0 or args.max_token_id <= 2:
        parser.error("--prompt-tokens, --repeats, --max-tokens must be > 0 and --max-token-id > 2")
    return args


def loopback_target(base_url: str) -> tuple[str, int, str]:
    """(host, port, path prefix) of a plain-http loopback URL; raises otherwise."""
    url = urllib.parse.urlsplit(base_url)
    if url.scheme != "http" or url.hostname not in LOOPBACK_HOSTS:
        raise ValueError(f"--base-url must be http:// on loopback ({', '.join(LOOPBACK_HOSTS)}), got {base_url!r}")
    return url.hostname, url.port or 80, url.path.rstrip("/")


def make_prompt(num_tokens: int, max_token_id: int, salt: int) -> list[int]:
    """Deterministic ids in [1, max_token_id), different for each salt."""
    return [1 + (salt * 1_000_003 + i * 7919) % (max_token_id - 1) for i in range(num_tokens)]


def stream_ttft_s(target: tuple[str, int, str], body: dict[str, Any], timeout_s: float) -> tuple[float, int | None]:
    """Send one streaming completion; returns (TTFT seconds, cached prompt tokens if the
    server reports usage). Reads the stream to its end so the request finishes."""
    host, port, prefix = target
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        start = time.perf_counter()
        conn.request("POST", f"{prefix}/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read().decode(errors='replace')[:500]}")
        ttft_s = None
        cached = None
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            if ttft_s is None:
                ttft_s = time.perf_counter() - start
            cached = _cached_tokens(line[5:].strip(), cached)
        if ttft_s is None:
            raise RuntimeError("the stream ended without a chunk")
        return ttft_s, cached
    finally:
        conn.close()


def _cached_tokens(data: str, previous: int | None) -> int | None:
    if data == "[DONE]":
        return previous
    usage = json.loads(data).get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return details.get("cached_tokens", previous)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    target = loopback_target(args.base_url)
    salt = args.seed if args.seed is not None else time.time_ns() % 1_000_000_007
    body = {
        "model": args.model,
        "prompt": make_prompt(args.prompt_tokens, args.max_token_id, salt),
        "max_tokens": args.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first_s, first_cached = stream_ttft_s(target, body, args.timeout_s)
    repeats = [stream_ttft_s(target, body, args.timeout_s) for _ in range(args.repeats)]
    repeat_s = [ttft for ttft, _ in repeats]
    median_s = statistics.median(repeat_s)
    return {
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "repeats": args.repeats,
        "ttft_first_ms": round(first_s * 1e3, 3),
        "ttft_repeat_ms": [round(s * 1e3, 3) for s in repeat_s],
        "ttft_repeat_median_ms": round(median_s * 1e3, 3),
        "ratio_first_over_repeat": round(first_s / median_s, 3) if median_s > 0 else None,
        "cached_tokens_first": first_cached,
        "cached_tokens_repeat": [cached for _, cached in repeats],
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=2))
