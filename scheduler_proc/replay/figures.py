"""`--show adapters` and `--show requests`: the per-adapter figures folded from the log
(scheduler_proc.views.adapter_stats, the code that feeds /metrics), beside the state dump."""

from __future__ import annotations

from typing import Any

from ledgerserve.scheduler_proc.views.adapter_stats import AdapterStats

FIGURE_SECTIONS = {"adapters": "adapter_figures", "requests": "adapter_waits"}


def figure_sections(stats: AdapterStats, names: list[str], num_lora_wait_steps: int) -> dict[str, Any]:
    """The figure sections that go with the state sections `names`."""
    out: dict[str, Any] = {}
    if "adapters" in names:
        out["adapter_figures"] = {
            "adapters": [
                stats.figures[name].to_json(stats.tier(stats.figures[name].version_id))
                for name in sorted(stats.figures)
            ],
            "engine": {"num_lora_wait_steps": num_lora_wait_steps, "lora_wait_ms": round(stats.lora_wait_ms, 3)},
        }
    if "requests" in names:
        waits = stats.finished_waits + stats.live_waits()
        out["adapter_waits"] = [wait.to_json() for wait in waits]
    return out


def render_figures(figures: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    if "adapter_figures" in figures:
        lines.append("== adapter figures ==")
        body = figures["adapter_figures"]
        lines += [_adapter_line(row) for row in body["adapters"]] or ["  (no adapter registered)"]
        engine = body["engine"]
        lines.append(
            f"  engine: {engine['num_lora_wait_steps']} steps left a request waiting on its adapter's load; "
            f"adapter waits {engine['lora_wait_ms']} ms in all"
        )
    if "adapter_waits" in figures:
        lines.append("== adapter waits ==")
        lines += [_wait_line(row) for row in figures["adapter_waits"]] or ["  (no adapter request)"]
    return lines


def _adapter_line(row: dict[str, Any]) -> str:
    loads, load_ms = row["loads"], row["load_ms"]
    wait_ms = "untimed" if row["wait_ms"] is None else f"{row['wait_ms']} ms"
    return (
        f"  {row['adapter']} (version {row['version_id']}, {row['tier']}{', pinned' if row['pinned'] else ''}): "
        f"loads from disk {loads['disk']}, from cpu {loads['cpu']}, stagings {row['num_stagings']}; "
        f"load ms count {load_ms['count']} total {load_ms['total']} mean {load_ms['mean']} max {load_ms['max']}; "
        f"slot hits {row['slot_hits']} misses {row['slot_misses']}; waits {row['wait_steps']} steps, {wait_ms}; "
        f"running {row['num_running']} waiting {row['num_waiting']}; tokens prompt {row['num_prompt_tokens']} "
        f"generated {row['num_generated_tokens']} cached {row['num_cached_tokens']}"
    )


def _wait_line(row: dict[str, Any]) -> str:
    outcome = {True: "hit", False: "miss", None: "not planned"}[row["hit"]]
    wait_ms = "" if row["wait_ms"] is None else f", {row['wait_ms']} ms"
    return f"  {row['req_id']} ({row['adapter']}): {outcome}, waited {row['wait_steps']} steps{wait_ms}"
