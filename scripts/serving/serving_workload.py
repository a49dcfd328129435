"""bench_serving's configuration (flags, workload file, checks) and its workload plan: adapters,
popularity, base share, arrivals and prompts, all drawn from the seed. Pure: no IO but reading
files. The workload semantics are described in scripts/serving/bench_serving.py."""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from ledgerserve.shared.adapter_format import TARGET_KINDS
from scripts.common.report_files import read_json
from scripts.common.request_loop import check_loopback

SEVEN = list(TARGET_KINDS[:7])  # the projections an adapter may target (no lm_head)

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
    p.add_argument(
        "--model-dir", default=None, help="the server's base model dir (its config.json shapes the adapters)"
    )
    p.add_argument(
        "--adapter-dir", default=None, help="where adapters are written; inside the server's --lora-allowed-dir"
    )
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


def parse_config(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Defaults, then the workload file, then the command line; validated."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.workload is not None:
        known = list(vars(parser.parse_args([])))
        args = parser.parse_args(workload_argv(read_json(args.workload, "workload file"), known) + argv)
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
        (
            bool(args.target_modules) and set(args.target_modules) <= set(SEVEN),
            f"--target-modules must be among {SEVEN}",
        ),
        (args.zipf_s > 0 and math.isfinite(args.zipf_s), "--zipf-s must be > 0"),
        (0.0 <= args.base_share <= 1.0, "--base-share must be in [0, 1]"),
        (args.num_adapters > 0 or args.base_share == 1.0, "--num-adapters 0 needs --base-share 1"),
        (args.num_adapters == 0 or args.adapter_dir is not None, "--adapter-dir is required with adapters"),
        (
            args.arrival != "poisson" or (args.rate > 0 and math.isfinite(args.rate)),
            "--rate must be a finite number > 0 (use --arrival burst to send everything at once)",
        ),
        (args.burst_size is None or args.burst_size >= 1, "--burst-size must be >= 1"),
        (args.burst_interval_s >= 0 and math.isfinite(args.burst_interval_s), "--burst-interval-s must be >= 0"),
        (args.num_requests >= 1, "--num-requests must be >= 1"),
        (args.input_len >= 1 and args.output_len >= 1, "--input-len and --output-len must be >= 1"),
        (args.max_concurrency is None or args.max_concurrency >= 1, "--max-concurrency must be >= 1"),
        (args.timeout_s > 0, "--timeout-s must be > 0"),
        (
            bool(args.adapter_prefix) and args.adapter_prefix == args.adapter_prefix.strip(),
            "--adapter-prefix must be non-empty, without surrounding spaces",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def read_model_config(model_dir: str) -> dict[str, Any]:
    return read_json(os.path.join(model_dir, "config.json"), "the base model's config")


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
    return [
        AdapterSpec(f"{prefix}{i}", os.path.join(root, f"adapter-{i}"), ranks[i % len(ranks)])
        for i in range(num_adapters)
    ]


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


def choose_targets(
    num_requests: int, weights: Sequence[float], base_share: float, rng: random.Random
) -> list[int | None]:
    """Per request: an adapter index drawn by `weights`, or None (the base model) for
    exactly round(base_share * num_requests) requests at random positions."""
    num_base = round(base_share * num_requests) if weights else num_requests
    is_base = [True] * num_base + [False] * (num_requests - num_base)
    rng.shuffle(is_base)
    picks = rng.choices(range(len(weights)), weights=weights, k=num_requests) if weights else [0] * num_requests
    return [None if base else pick for base, pick in zip(is_base, picks)]


def arrival_times_s(
    num_requests: int, arrival: str, rate: float, burst_size: int | None, burst_interval_s: float, rng: random.Random
) -> list[float]:
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
    arrivals = arrival_times_s(
        args.num_requests, args.arrival, args.rate, args.burst_size, args.burst_interval_s, stream("arrivals")
    )
    prompts_rng, avoid = stream("prompts"), special_token_ids(hf_config)
    plan = [
        PlannedRequest(
            i, arrivals[i], targets[i], random_prompt(prompts_rng, args.input_len, hf_config["vocab_size"], avoid)
        )
        for i in range(args.num_requests)
    ]
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
    return (
        f"popularity: top-1 adapter {pop['top1_share']} and top-10 {pop['top10_share']} of adapter requests "
        f"(expected {pop['expected_top1_share']} and {pop['expected_top10_share']}); "
        f"base share {pop['base_share']}; adapters used: {pop['num_adapters_used']}"
    )


def request_body(model: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "min_tokens": output_len,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
