"""bench_adapter_churn's results: one row per workload, the adapter loads its servers logged,
the printed table and the plot's panels (TTFT CDFs and output throughput per workload)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from ledgerserve.shared import codec
from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import RunScanner, newest_log
from scripts.common.plot import BarPanel, CdfPanel, Panel
from scripts.serving.serving_report import RequestResult


def workload_row(
    name: str, summary: dict[str, Any], results: Sequence[RequestResult], extra: dict[str, Any]
) -> dict[str, Any]:
    """The table's view of one bench_serving summary, plus every TTFT (for the CDFs)."""
    return {
        "workload": name,
        **extra,
        "num_requests": summary["num_requests"],
        "num_errors": summary["num_errors"],
        "errors": summary["errors"],
        "duration_s": summary["duration_s"],
        "requests_per_s": summary["throughput"]["requests_per_s"],
        "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
        "ttft_ms": summary["ttft_ms"],
        "tpot_ms": summary["tpot_ms"],
        "ttft_values_ms": sorted(round(r.ttft_ms, 2) for r in results if r.status == 200 and r.ttft_ms is not None),
    }


def load_stats(log_dir: str) -> dict[str, Any]:
    """What rank 0 reported of the adapter loads in the newest run of `log_dir`: per target
    (a GPU slot, or the CPU tier for a staging) and source tier, how many, their median
    duration and bandwidth; and how many movement decisions of each kind the core took."""
    loads: dict[str, list[ev.AdapterLoadCompleted]] = {}
    decisions = {
        "AdapterSlotAssigned": 0,
        "AdapterPrefetched": 0,
        "AdapterEvicted": 0,
        "AdapterCpuEvicted": 0,
        "AdapterLoadFailed": 0,
    }
    decoder = codec.log_event_decoder()
    for _, raw in RunScanner(newest_log(log_dir)):
        if b"Adapter" not in bytes(raw):  # every record is checked; only adapter events are decoded
            continue
        event = decoder.decode(raw)
        kind = type(event).__name__
        if kind in decisions:
            decisions[kind] += 1
        if isinstance(event, ev.AdapterLoadCompleted) and event.rank == 0:
            key = f"{'gpu_slot' if event.slot >= 0 else 'cpu_tier'}<-{event.source_tier or 'unreported'}"
            loads.setdefault(key, []).append(event)
    return {"decisions": decisions, "loads": {key: _load_row(done) for key, done in sorted(loads.items())}}


def _load_row(done: Sequence[ev.AdapterLoadCompleted]) -> dict[str, Any]:
    timed = [e for e in done if e.duration_ms > 0]
    return {
        "count": len(done),
        "median_duration_ms": round(statistics.median(e.duration_ms for e in timed), 3) if timed else None,
        "median_gbps": round(statistics.median(e.num_bytes / e.duration_ms / 1e6 for e in timed), 3) if timed else None,
    }


def table_text(rows: Sequence[dict[str, Any]]) -> str:
    """The serving table as aligned text, one line per workload."""
    head = (
        f"{'workload':<34} {'req':>5} {'err':>4} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'TPOT p99':>9}"
    )
    lines = [head]
    for row in rows:
        ttft, tpot = row["ttft_ms"], row["tpot_ms"]
        lines.append(
            f"{row['workload']:<34} {row['num_requests']:>5} {row['num_errors']:>4} "
            f"{_num(row['output_tokens_per_s']):>10} {_num(ttft['p50']):>9} {_num(ttft['p99']):>9} "
            f"{_num(tpot['p50']):>9} {_num(tpot['p99']):>9}"
        )
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def plot_panels(rows: Sequence[dict[str, Any]]) -> list[Panel]:
    """A TTFT CDF per arrival pattern (one line per workload of it) and output tok/s bars."""
    by_arrival: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        by_arrival.setdefault(row["arrival"], {})[f"{row['mode']} {row['label']}"] = row["ttft_values_ms"]
    panels: list[Panel] = [
        CdfPanel(f"TTFT CDF, {arrival}", series, xlabel="TTFT (ms)", log_x=True)
        for arrival, series in by_arrival.items()
    ]
    bars = [(f"{row['mode']} {row['workload']}", row["output_tokens_per_s"] or 0.0) for row in rows]
    panels.append(BarPanel("output tok/s by workload", bars, value_label="output tokens/s", horizontal=True))
    return panels
