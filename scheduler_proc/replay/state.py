"""`--show`: the core's state as named sections, read defensively from `Core.snapshot()`
(sections the core does not keep yet come out empty)."""

from __future__ import annotations

import json
from typing import Any

SECTIONS = ("queues", "slots", "namespaces", "requests", "adapters")
_QUEUE_KEYS = ("step", "in_flight_step", "in_flight_steps", "waiting", "running", "num_free_blocks", "num_total_blocks")


def parse_sections(text: str) -> list[str]:
    if text.strip() == "all":
        return list(SECTIONS)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SECTIONS]
    if unknown or not names:
        raise ValueError(f"unknown --show section(s) {unknown or text!r}; choose from {', '.join(SECTIONS)}")
    return names


def sections(snapshot: dict[str, Any], names: list[str]) -> dict[str, Any]:
    builders = {
        "queues": _queues,
        "slots": _slots,
        "namespaces": _namespaces,
        "requests": _requests,
        "adapters": _adapters,
    }
    return {name: builders[name](snapshot) for name in names}


def render(state: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for name, body in state.items():
        lines.append(f"== {name} ==")
        if isinstance(body, dict):
            lines += [f"  {key}: {json.dumps(value)}" for key, value in body.items()] or ["  (empty)"]
        else:
            lines += [f"  {json.dumps(row)}" for row in body] or ["  (empty)"]
    return lines


def _queues(snapshot: dict[str, Any]) -> dict[str, Any]:
    return {key: snapshot.get(key) for key in _QUEUE_KEYS}


def _requests(snapshot: dict[str, Any]) -> list[Any]:
    return list(snapshot.get("requests") or [])


def _slots(snapshot: dict[str, Any]) -> list[Any]:
    """Adapter GPU slots, each with its version, state and pins."""
    return list(snapshot["adapters"]["slots"])


def _namespaces(snapshot: dict[str, Any]) -> dict[str, Any]:
    """Prefix-cache namespaces (0 = base, else the adapter version id) as block counts."""
    cache = snapshot["prefix_cache"]
    counts = {str(row["namespace"]): row["num_blocks"] for row in cache["namespaces"]}
    return {**counts, "cached": cache["num_cached_blocks"], "locked": cache["num_locked_blocks"]}


def _adapters(snapshot: dict[str, Any]) -> list[Any]:
    """The registry (name -> current version), every version the core still tracks (with its
    user pin and on-demand mark), then the deferred evictions, the pinned versions, the CPU tier,
    the slot loads in flight (overlapped loading) and the slots draining for a waiting version
    (targeted drains)."""
    adapters = snapshot["adapters"]
    current = adapters["registry"]
    tiers = {
        key: adapters.get(key)
        for key in (
            "deferred_evictions",
            "pinned",
            "on_demand_use_clock",
            "cpu_tier",
            "cpu_tier_bytes",
            "cpu_staged_on_every_rank",
            "loads_in_flight",
            "drains",
        )
    }
    return [
        {**version, "current": current.get(version["name"]) == version["version_id"]}
        for version in adapters["versions"]
    ] + [tiers]
