"""A serving benchmark: drives a running ledgerserve (or vLLM-compatible) server on loopback
with a multi-LoRA workload and reports throughput, latency percentiles and fairness.

    python -m scripts.bench_serving --base-url http://127.0.0.1:8000 --model-dir /models/base \\
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
--plot). Run as a module, it prints the popularity line, then the report as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import httpx

from scripts.bench_fixtures import SEVEN, write_adapter
from scripts.lora_stress import _base_model, _post, check_loopback
from scripts.png_plot import GREY, PALETTE, BarPanel, CdfPanel, plot_png
from shared.adapter_format import BaseShapes

POPULARITIES = ("uniform", "zipf")
ARRIVALS = ("poisson", "burst")
PERCENTILES = (50, 95, 99)


# ---- configuration -------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Bad arguments raise ValueError (the caller decides how to report them)."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(message)


def _int_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None


def _name_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="bench_serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default=None, help="JSON file with any of these fields; flags override it")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model-dir", default=None, help="the server's base model dir (its config.json shapes the adapters)")
    p.add_argument("--adapter-dir", default=None, help="where adapters are written; inside the server's --lora-allowed-dir")
    p.add_argument("--adapter-prefix", default="bench-a", help="adapters are loaded as PREFIX0, PREFIX1, ...")
    p.add_argument("--num-adapters", type=int, default=4)
    p.add_argument("--ranks", type=_int_list, default=[8, 16, 32], help="rank mix: adapter i gets ranks[i %% len]")
    p.add_argument("--target-modules", type=_name_list, default=list(SEVEN), help="comma-separated projections")
    p.add_argument("--popularity", default="uniform", help="uniform | zipf")
    p.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent (> 0)")
    p.add_argument("--base-share", type=float, default=0.0, help="share of requests to the base model, in [0, 1]")
    p.add_argument("--arrival", default="poisson", help="poisson | burst")
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrival rate, requests/s")
    p.add_argument("--burst-size", type=int, default=None, help="burst: requests per group (default: all at once)")
    p.add_argument("--burst-interval-s", type=float, default=1.0, help="burst: seconds between groups")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (forced)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request timeout")
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--plot", default=None, help="write the PNG plot here")
    return p


def workload_argv(data: Any, known: Sequence[str]) -> list[str]:
    """A workload file's fields as flags (to be parsed before the real command line)."""
    if not isinstance(data, dict):
        raise ValueError("a workload file must hold a JSON object")
    argv: list[str] = []
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in known or dest == "workload":
            raise ValueError(f"workload file: unknown field {key!r}; fields: {', '.join(sorted(known))}")
        if value is None:
            continue
        if isinstance(value, list) and all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in value):
            value = ",".join(str(v) for v in value)
        if isinstance(value, (bool, dict, list)):
            raise ValueError(f"workload file: field {key!r} has an unusable value {value!r}")
        argv += ["--" + dest.replace("_", "-"), str(value)]
    return argv


def read_workload(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read workload file {path!r}: {e}") from None


def parse_config(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Defaults, then the workload file, then the command line; validated."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.workload is not None:
        known = list(vars(parser.parse_args([])))
        args = parser.parse_args(workload_argv(read_workload(args.workload), known) + argv)
    validate(args)
    return args


def validate(args: argparse.Namespace) -> None:
    check_loopback(args.base_url)
    checks = [
        (args.model_dir is not None, "--model-dir is required (the base model's config.json)"),
        (args.popularity in POPULARITIES, f"--popularity must be one of {POPULARITIES}"),
        (args.arrival in ARRIVALS, f"--arrival must be one of {ARRIVALS}"),
        (args.num_adapters >= 0, "--num-adapters must be >= 0"),
        (bool(args.ranks) and all(r >= 1 for r in args.ranks), "--ranks must be one or more ranks >= 1"),
        (bool(args.target_modules) and set(args.target_modules) <= set(SEVEN), f"--target-modules must be among {SEVEN}"),
        (args.zipf_s > 0 and math.isfinite(args.zipf_s), "--zipf-s must be > 0"),
        (0.0 <= args.base_share <= 1.0, "--base-share must be in [0, 1]"),
        (args.num_adapters > 0 or args.base_share == 1.0, "--num-adapters 0 needs --base-share 1"),
        (args.num_adapters == 0 or args.adapter_dir is not None, "--adapter-dir is required with adapters"),
        (args.arrival != "poisson" or (args.rate > 0 and math.isfinite(args.rate)),
         "--rate must be a finite number > 0 (use --arrival burst to send everything at once)"),
        (args.burst_size is None or args.burst_size >= 1, "--burst-size must be >= 1"),
        (args.burst_interval_s >= 0 and math.isfinite(args.burst_interval_s), "--burst-interval-s must be >= 0"),
        (args.num_requests >= 1, "--num-requests must be >= 1"),
        (args.input_len >= 1 and args.output_len >= 1, "--input-len and --output-len must be >= 1"),
        (args.max_concurrency is None or args.max_concurrency >= 1, "--max-concurrency must be >= 1"),
        (args.timeout_s > 0, "--timeout-s must be > 0"),
        (bool(args.adapter_prefix) and args.adapter_prefix == args.adapter_prefix.strip(),
         "--adapter-prefix must be non-empty, without surrounding spaces"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def read_model_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the base model's config {path!r}: {e}") from None


# ---- workload (pure) -----------------------------------------------------------------


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    rank: int


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    arrival_s: float
    adapter: int | None  # index into the adapters; None: the base model
    prompt: list[int]


def adapter_specs(num_adapters: int, ranks: Sequence[int], adapter_dir: str, prefix: str) -> list[AdapterSpec]:
    root = os.path.abspath(adapter_dir)
    return [AdapterSpec(f"{prefix}{i}", os.path.join(root, f"adapter-{i}"), ranks[i % len(ranks)])
            for i in range(num_adapters)]


def popularity_weights(num_adapters: int, popularity: str, zipf_s: float, rng: random.Random) -> list[float]:
    """Each adapter's probability of being picked by an adapter request (sums to 1)."""
    if num_adapters == 0:
        return []
    if popularity == "uniform":
        return [1.0 / num_adapters] * num_adapters
    by_rank = [1.0 / (k + 1) ** zipf_s for k in range(num_adapters)]
    order = list(range(num_adapters))
    rng.shuffle(order)  # order[k]: the adapter at popularity rank k + 1
    weights = [0.0] * num_adapters
    for k, adapter in enumerate(order):
        weights[adapter] = by_rank[k]
    total = sum(weights)
    return [w / total for w in weights]


def choose_targets(num_requests: int, weights: Sequence[float], base_share: float,
                   rng: random.Random) -> list[int | None]:
    """Per request: an adapter index drawn by `weights`, or None (the base model) for
    exactly round(base_share * num_requests) requests at random positions."""
    num_base = round(base_share * num_requests) if weights else num_requests
    is_base = [True] * num_base + [False] * (num_requests - num_base)
    rng.shuffle(is_base)
    picks = rng.choices(range(len(weights)), weights=weights, k=num_requests) if weights else [0] * num_requests
    return [None if base else pick for base, pick in zip(is_base, picks)]


def arrival_times_s(num_requests: int, arrival: str, rate: float, burst_size: int | None,
                    burst_interval_s: float, rng: random.Random) -> list[float]:
    """Send times from the start of the run, non-decreasing."""
    if arrival == "poisson":
        times, t = [], 0.0
        for _ in range(num_requests):
            times.append(t)
            t += rng.expovariate(rate)
        return times
    size = burst_size or num_requests
    return [(i // size) * burst_interval_s for i in range(num_requests)]


def special_token_ids(hf_config: dict[str, Any]) -> set[int]:
    ids: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = hf_config.get(key)
        ids.update(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return ids


def random_prompt(rng: random.Random, num_tokens: int, vocab_size: int, avoid: set[int]) -> list[int]:
    prompt: list[int] = []
    while len(prompt) < num_tokens:
        token = rng.randrange(vocab_size)
        if token not in avoid:
            prompt.append(token)
    return prompt


def plan_workload(args: argparse.Namespace, hf_config: dict[str, Any]) -> tuple[list[PlannedRequest], list[float]]:
    """The requests to send (arrival, target, prompt) and the adapters' popularity weights."""
    def stream(aspect: str) -> random.Random:
        return random.Random(f"{args.seed}-{aspect}")

    weights = popularity_weights(args.num_adapters, args.popularity, args.zipf_s, stream("popularity"))
    targets = choose_targets(args.num_requests, weights, args.base_share, stream("targets"))
    arrivals = arrival_times_s(args.num_requests, args.arrival, args.rate, args.burst_size, args.burst_interval_s,
                               stream("arrivals"))
    prompts_rng, avoid = stream("prompts"), special_token_ids(hf_config)
    plan = [PlannedRequest(i, arrivals[i], targets[i], random_prompt(prompts_rng, args.input_len,
                                                                     hf_config["vocab_size"], avoid))
            for i in range(args.num_requests)]
    return plan, weights


def popularity_shares(targets: Sequence[int | None], weights: Sequence[float]) -> dict[str, Any]:
    """Realised shares of adapter requests that the top-1 and top-10 adapters got, the
    expected ones from the weights, and the realised base share of all requests."""
    counts = sorted(Counter(t for t in targets if t is not None).values(), reverse=True)
    num_adapter_requests = sum(counts)
    expected = sorted(weights, reverse=True)

    def share(part: Sequence[float], total: float) -> float | None:
        return round(sum(part) / total, 4) if total else None

    return {
        "top1_share": share(counts[:1], num_adapter_requests),
        "top10_share": share(counts[:10], num_adapter_requests),
        "expected_top1_share": share(expected[:1], 1.0) if expected else None,
        "expected_top10_share": share(expected[:10], 1.0) if expected else None,
        "base_share": share([sum(t is None for t in targets)], len(targets)),
        "num_adapters_used": len(counts),
    }


def popularity_line(pop: dict[str, Any]) -> str:
    return (f"popularity: top-1 adapter {pop['top1_share']} and top-10 {pop['top10_share']} of adapter requests "
            f"(expected {pop['expected_top1_share']} and {pop['expected_top10_share']}); "
            f"base share {pop['base_share']}; adapters used: {pop['num_adapters_used']}")


def request_body(model: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}


# ---- one request's stream (pure) -----------------------------------------------------


@dataclass
class RequestResult:
    index: int
    adapter: int | None
    status: int  # 200; an HTTP status or an error event's code; 0 transport error; -1 a bad stream
    start_s: float
    end_s: float
    detail: str = ""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass
class StreamTally:
    """What a completion stream said so far, fed one SSE line at a time."""

    first_token_s: float | None = None
    last_token_s: float | None = None
    num_streamed_tokens: int = 0
    usage: dict[str, Any] | None = None
    error: tuple[int, str] | None = None
    done: bool = False

    def feed(self, line: str, now_s: float) -> None:
        if line == "data: [DONE]":
            self.done = True
            return
        if not line.startswith("data: "):
            return
        try:
            event = json.loads(line[len("data: "):])
        except json.JSONDecodeError:
            self.error = self.error or (-1, f"not JSON: {line[:200]}")
            return
        if "error" in event:
            self.error = self.error or (int(event["error"].get("code") or 500), line[:200])
            return
        if event.get("usage"):
            self.usage = event["usage"]
        for choice in event.get("choices") or []:
            num_tokens = len(choice.get("token_ids") or [])
            if num_tokens or choice.get("text"):
                self.first_token_s = now_s if self.first_token_s is None else self.first_token_s
                self.last_token_s = now_s
                self.num_streamed_tokens += num_tokens


def result_of(planned: PlannedRequest, tally: StreamTally, start_s: float, end_s: float) -> RequestResult:
    failed = RequestResult(planned.index, planned.adapter, -1, start_s, end_s)
    if tally.error is not None:
        failed.status, failed.detail = tally.error
        return failed
    if not tally.done or tally.first_token_s is None or tally.last_token_s is None:
        failed.detail = "stream ended without [DONE]" if not tally.done else "no token streamed"
        return failed
    usage = tally.usage or {}
    num_output = int(usage.get("completion_tokens", tally.num_streamed_tokens))
    tpot_ms = (tally.last_token_s - tally.first_token_s) * 1e3 / (num_output - 1) if num_output > 1 else None
    return RequestResult(planned.index, planned.adapter, 200, start_s, end_s,
                         ttft_ms=(tally.first_token_s - start_s) * 1e3, tpot_ms=tpot_ms,
                         e2e_ms=(end_s - start_s) * 1e3,
                         prompt_tokens=int(usage.get("prompt_tokens", len(planned.prompt))), output_tokens=num_output)


# ---- statistics and the report (pure) ------------------------------------------------


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default); None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * pct / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def latency_stats(values: Sequence[float]) -> dict[str, float | None]:
    stats = {"mean": _round(_mean(values))}
    stats.update({f"p{p}": _round(percentile(values, p)) for p in PERCENTILES})
    return stats


def jain_index(values: Sequence[float]) -> float | None:
    """(sum x)^2 / (n * sum x^2): 1 when all equal; None for no values or all zero."""
    squares = sum(v * v for v in values)
    return sum(values) ** 2 / (len(values) * squares) if values and squares > 0 else None


def per_model_rows(results: Sequence[RequestResult], adapters: Sequence[AdapterSpec], base_model: str,
                   duration_s: float) -> list[dict[str, Any]]:
    """One row per model that got requests: the base model first, then adapters by index."""
    by_target: dict[int | None, list[RequestResult]] = {}
    for r in results:
        by_target.setdefault(r.adapter, []).append(r)
    rows = []
    for target in sorted(by_target, key=lambda a: -1 if a is None else a):
        mine = by_target[target]
        ok = [r for r in mine if r.status == 200]
        rows.append({
            "model": base_model if target is None else adapters[target].name,
            "adapter": target,  # index into the adapters; None: the base model
            "rank": None if target is None else adapters[target].rank,
            "num_requests": len(mine),
            "num_errors": len(mine) - len(ok),
            "mean_ttft_ms": _round(_mean([r.ttft_ms for r in ok if r.ttft_ms is not None])),
            "mean_tpot_ms": _round(_mean([r.tpot_ms for r in ok if r.tpot_ms is not None])),
            "output_tokens_per_s": _round(sum(r.output_tokens for r in ok) / duration_s) if duration_s > 0 else None,
        })
    return rows


def fairness(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    tpots = [row["mean_tpot_ms"] for row in rows if row["adapter"] is not None and row["mean_tpot_ms"] is not None]
    jain = jain_index(tpots)
    return {
        "metric": "per-adapter mean TPOT (ms), base model excluded",
        "num_adapters": len(tpots),
        "jain_index": _round(jain, 4),
        "max_min_ratio": _round(max(tpots) / min(tpots), 4) if tpots and min(tpots) > 0 else None,
    }


def error_summary(results: Sequence[RequestResult], num_samples: int = 5) -> dict[str, Any]:
    failed = [r for r in results if r.status != 200]
    return {
        "by_status": dict(sorted(Counter(str(r.status) for r in failed).items())),
        "samples": [{"index": r.index, "status": r.status, "detail": r.detail} for r in failed[:num_samples]],
    }


def summarize(config: dict[str, Any], plan: Sequence[PlannedRequest], weights: Sequence[float],
              results: Sequence[RequestResult], adapters: Sequence[AdapterSpec], base_model: str) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200]
    duration_s = (max(r.end_s for r in results) - min(r.start_s for r in results)) if results else 0.0
    num_output = sum(r.output_tokens for r in ok)
    num_total = num_output + sum(r.prompt_tokens for r in ok)

    def rate(count: float) -> float | None:
        return _round(count / duration_s) if duration_s > 0 else None

    def stats(attr: str, kind: str | None = None) -> dict[str, float | None]:
        chosen = [r for r in ok if kind is None or (r.adapter is None) == (kind == "base")]
        return latency_stats([v for r in chosen if (v := getattr(r, attr)) is not None])

    rows = per_model_rows(results, adapters, base_model, duration_s)
    return {
        "config": config,
        "base_model": base_model,
        "adapters": [{"name": a.name, "rank": a.rank, "path": a.path} for a in adapters],
        "popularity": popularity_shares([p.adapter for p in plan], weights),
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_errors": len(results) - len(ok),
        "errors": error_summary(results),
        "num_output_len_mismatches": sum(r.output_tokens != config["output_len"] for r in ok),
        "duration_s": _round(duration_s),
        "throughput": {"requests_per_s": rate(len(ok)), "output_tokens_per_s": rate(num_output),
                       "total_tokens_per_s": rate(num_total)},
        "ttft_ms": stats("ttft_ms"),
        "tpot_ms": stats("tpot_ms"),
        "e2e_ms": stats("e2e_ms"),
        "by_kind": {kind: {"ttft_ms": stats("ttft_ms", kind), "tpot_ms": stats("tpot_ms", kind)}
                    for kind in ("base", "adapter")},
        "per_adapter": rows,
        "fairness": fairness(rows),
    }


def render_plot(results: Sequence[RequestResult], rows: Sequence[dict[str, Any]]) -> bytes:
    """TTFT and TPOT CDFs (base vs adapter requests) and per-model mean TPOT bars."""
    ok = [r for r in results if r.status == 200]

    def series(attr: str) -> dict[str, list[float]]:
        return {kind: [v for r in ok if (r.adapter is None) == (kind == "base") and (v := getattr(r, attr)) is not None]
                for kind in ("base", "adapter")}

    plotted = [row for row in rows if row["mean_tpot_ms"] is not None]
    bars = [("B" if row["adapter"] is None else str(row["adapter"]), row["mean_tpot_ms"]) for row in plotted]
    colors = [GREY if row["adapter"] is None else PALETTE[1] for row in plotted]
    return plot_png([
        CdfPanel("TTFT ms CDF", series("ttft_ms")),
        CdfPanel("TPOT ms CDF", series("tpot_ms")),
        BarPanel("mean TPOT ms by model: B base, 0.. adapters", bars, colors),
    ])


# ---- IO ------------------------------------------------------------------------------


def write_adapters(specs: Sequence[AdapterSpec], hf_config: dict[str, Any], targets: list[str]) -> None:
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


async def load_adapters(client: httpx.AsyncClient, specs: Sequence[AdapterSpec], loaded: list[str]) -> None:
    """Load each adapter, appending its name to `loaded` once the server has it."""
    for spec in specs:
        status, detail = await _post(client, "/v1/load_lora_adapter", {"lora_name": spec.name, "lora_path": spec.path})
        if status != 200:
            raise RuntimeError(f"loading adapter {spec.name} from {spec.path} failed: HTTP {status}: {detail[:500]}")
        loaded.append(spec.name)


async def unload_adapters(client: httpx.AsyncClient, names: Sequence[str]) -> list[str]:
    """Unload every name; returns what failed (also told on stderr)."""
    failures = []
    for name in names:
        try:
            status, detail = await _post(client, "/v1/unload_lora_adapter", {"lora_name": name})
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
                return RequestResult(planned.index, planned.adapter, r.status_code, start_s, time.perf_counter(), detail)
            async for line in r.aiter_lines():
                tally.feed(line, time.perf_counter())
                if tally.done:
                    break
    except httpx.HTTPError as e:
        return RequestResult(planned.index, planned.adapter, 0, start_s, time.perf_counter(),
                             f"{type(e).__name__}: {e}"[:200])
    return result_of(planned, tally, start_s, time.perf_counter())


async def run_plan(client: httpx.AsyncClient, plan: Sequence[PlannedRequest], models: Sequence[str],
                   base_model: str, output_len: int, max_concurrency: int | None) -> list[RequestResult]:
    """Send each request at its arrival time (at most `max_concurrency` in flight)."""
    gate = asyncio.Semaphore(max_concurrency or len(plan))
    start_s = time.perf_counter()

    async def one(planned: PlannedRequest) -> RequestResult:
        await asyncio.sleep(max(0.0, start_s + planned.arrival_s - time.perf_counter()))
        model = base_model if planned.adapter is None else models[planned.adapter]
        async with gate:
            return await send_request(client, planned, request_body(model, planned.prompt, output_len))

    return list(await asyncio.gather(*(one(p) for p in plan)))


async def _bench(args: argparse.Namespace, hf_config: dict[str, Any], specs: Sequence[AdapterSpec],
                 plan: Sequence[PlannedRequest]) -> tuple[list[RequestResult], str, list[str]]:
    """Check the server, write and load the adapters, run the plan, unload the adapters
    (whatever happened)."""
    limits = httpx.Limits(max_connections=(args.max_concurrency or args.num_requests) + 4)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout_s, limits=limits) as client:
        base_model = await _base_model(client)
        await check_names_free(client, specs)
        write_adapters(specs, hf_config, args.target_modules)  # blocks the loop: nothing is in flight yet
        loaded: list[str] = []
        try:
            await load_adapters(client, specs, loaded)
            results = await run_plan(client, plan, [s.name for s in specs], base_model, args.output_len,
                                     args.max_concurrency)
        finally:
            unload_failures = await unload_adapters(client, loaded)
    return results, base_model, unload_failures


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def main(argv: Sequence[str] | None = None, echo: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the benchmark; return the report. Raises ValueError on bad arguments and
    RuntimeError when the server refuses an adapter. `echo` gets the popularity line."""
    args = parse_config(argv)
    hf_config = read_model_config(args.model_dir)
    specs = adapter_specs(args.num_adapters, args.ranks, args.adapter_dir or ".", args.adapter_prefix)
    plan, weights = plan_workload(args, hf_config)
    if echo is not None:
        echo(popularity_line(popularity_shares([p.adapter for p in plan], weights)))
    results, base_model, unload_failures = asyncio.run(_bench(args, hf_config, specs, plan))
    report = summarize(vars(args), plan, weights, results, specs, base_model)
    report["unload_failures"] = unload_failures
    if args.plot:
        _write(args.plot, render_plot(results, report["per_adapter"]))
        report["plot"] = args.plot
    if args.out:
        _write(args.out, json.dumps(report, indent=2).encode())
    return report


def cli(argv: Sequence[str] | None = None) -> int:
    try:
        report = main(argv, echo=print)
    except (ValueError, RuntimeError, httpx.HTTPError) as e:
        print(f"bench_serving: {type(e).__name__}: {e}" if isinstance(e, httpx.HTTPError) else f"bench_serving: {e}",
              file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0 if report["num_errors"] == 0 and not report["unload_failures"] else 1


if __name__ == "__main__":
    raise SystemExit(cli())
