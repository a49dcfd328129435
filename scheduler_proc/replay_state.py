"""`--show`: the core's state as named sections, read defensively from `Core.snapshot()`
(sections the core does not keep yet come out empty)."""

from __future__ import annotations

import json
from typing import Any

SECTIONS = ("queues", "slots", "namespaces", "requests", "adapters")
_QUEUE_KEYS = ("step", "in_flight_step", "waiting", "running", "num_free_blocks", "num_total_blocks")


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


def _first(snapshot: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in snapshot and snapshot[key] is not None:
            return snapshot[key]
    return None


def _queues(snapshot: dict[str, Any]) -> dict[str, Any]:
    return {key: snapshot.get(key) for key in _QUEUE_KEYS}


def _requests(snapshot: dict[str, Any]) -> list[Any]:
    return list(snapshot.get("requests") or [])


def _slots(snapshot: dict[str, Any]) -> list[Any]:
    """Adapter GPU slots, each with its version and pins, as the core reports them."""
    slots = _first(snapshot, "adapter_slots", "slots", "lora_slots")
    if isinstance(slots, dict):
        return [{"slot": key, **value} if isinstance(value, dict) else {"slot": key, "value": value} for key, value in slots.items()]
    return list(slots or [])


def _namespaces(snapshot: dict[str, Any]) -> dict[str, int]:
    """Prefix-cache namespaces as block counts."""
    found = _first(snapshot, "namespaces", "prefix_namespaces", "radix_namespaces")
    if isinstance(found, dict):
        return {str(name): _block_count(value) for name, value in found.items()}
    rows = found or []
    return {str(row.get("namespace", row.get("name", i))): _block_count(row) for i, row in enumerate(rows) if isinstance(row, dict)}


def _block_count(value: Any) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)):
        return len(value)
    if isinstance(value, dict):
        for key in ("num_blocks", "blocks", "block_ids"):
            if key in value:
                return _block_count(value[key])
    return 0


def _adapters(snapshot: dict[str, Any]) -> list[Any]:
    found = _first(snapshot, "adapters", "adapter_registry", "registry")
    if isinstance(found, dict):
        return [{"name": name, **value} if isinstance(value, dict) else {"name": name, "value": value} for name, value in found.items()]
    return list(found or [])
