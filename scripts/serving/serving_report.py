"""bench_serving's results: one request's stream tally, percentiles, per-adapter rows,
Jain's fairness index, the JSON summary and the plot's panels. Pure functions of the results."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from scripts.common.plot import BLUE, GREY, BarPanel, CdfPanel, Panel
from scripts.serving.serving_workload import PERCENTILES, AdapterSpec, PlannedRequest, popularity_shares

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
            event = json.loads(line[len("data: ") :])
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
    return RequestResult(
        planned.index,
        planned.adapter,
        200,
        start_s,
        end_s,
        ttft_ms=(tally.first_token_s - start_s) * 1e3,
        tpot_ms=tpot_ms,
        e2e_ms=(end_s - start_s) * 1e3,
        prompt_tokens=int(usage.get("prompt_tokens", len(planned.prompt))),
        output_tokens=num_output,
    )


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


def per_model_rows(
    results: Sequence[RequestResult], adapters: Sequence[AdapterSpec], base_model: str, duration_s: float
) -> list[dict[str, Any]]:
    """One row per model that got requests: the base model first, then adapters by index."""
    by_target: dict[int | None, list[RequestResult]] = {}
    for r in results:
        by_target.setdefault(r.adapter, []).append(r)
    rows = []
    for target in sorted(by_target, key=lambda a: -1 if a is None else a):
        mine = by_target[target]
        ok = [r for r in mine if r.status == 200]
        rows.append(
            {
                "model": base_model if target is None else adapters[target].name,
                "adapter": target,  # index into the adapters; None: the base model
                "rank": None if target is None else adapters[target].rank,
                "num_requests": len(mine),
                "num_errors": len(mine) - len(ok),
                "mean_ttft_ms": _round(_mean([r.ttft_ms for r in ok if r.ttft_ms is not None])),
                "mean_tpot_ms": _round(_mean([r.tpot_ms for r in ok if r.tpot_ms is not None])),
                "output_tokens_per_s": _round(sum(r.output_tokens for r in ok) / duration_s)
                if duration_s > 0
                else None,
            }
        )
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


def summarize(
    config: dict[str, Any],
    plan: Sequence[PlannedRequest],
    weights: Sequence[float],
    results: Sequence[RequestResult],
    adapters: Sequence[AdapterSpec],
    base_model: str,
) -> dict[str, Any]:
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
        "throughput": {
            "requests_per_s": rate(len(ok)),
            "output_tokens_per_s": rate(num_output),
            "total_tokens_per_s": rate(num_total),
        },
        "ttft_ms": stats("ttft_ms"),
        "tpot_ms": stats("tpot_ms"),
        "e2e_ms": stats("e2e_ms"),
        "by_kind": {
            kind: {"ttft_ms": stats("ttft_ms", kind), "tpot_ms": stats("tpot_ms", kind)} for kind in ("base", "adapter")
        },
        "per_adapter": rows,
        "fairness": fairness(rows),
    }


def plot_panels(results: Sequence[RequestResult], rows: Sequence[dict[str, Any]]) -> list[Panel]:
    """TTFT and TPOT CDFs (base vs adapter requests) and per-model mean TPOT bars."""
    ok = [r for r in results if r.status == 200]

    def series(attr: str) -> dict[str, list[float]]:
        return {
            kind: [v for r in ok if (r.adapter is None) == (kind == "base") and (v := getattr(r, attr)) is not None]
            for kind in ("base", "adapter")
        }

    plotted = [row for row in rows if row["mean_tpot_ms"] is not None]
    bars = [("B" if row["adapter"] is None else str(row["adapter"]), row["mean_tpot_ms"]) for row in plotted]
    colors = [GREY if row["adapter"] is None else BLUE for row in plotted]
    return [
        CdfPanel("TTFT CDF", series("ttft_ms"), xlabel="TTFT (ms)"),
        CdfPanel("TPOT CDF", series("tpot_ms"), xlabel="TPOT (ms)"),
        BarPanel("mean TPOT by model: B base, 0.. adapters", bars, colors, value_label="mean TPOT (ms)"),
    ]
