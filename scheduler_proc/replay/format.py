"""Rendering replay findings: field-by-field, side-by-side event comparison."""

from __future__ import annotations

from typing import Any

import msgspec

WIDTH = 48


def event_fields(event: Any) -> dict[str, Any]:
    """Plain data of an event, its type first (`None`: no event)."""
    if event is None:
        return {"type": None}
    fields = {"type": type(event).__name__}
    fields.update({name: msgspec.to_builtins(getattr(event, name)) for name in event.__struct_fields__})
    return fields


def differing_fields(logged: Any, recomputed: Any) -> list[str]:
    left, right = event_fields(logged), event_fields(recomputed)
    return [name for name in _names(left, right) if left.get(name, _MISSING) != right.get(name, _MISSING)]


def side_by_side(
    logged: Any, recomputed: Any, left_title: str = "logged", right_title: str = "recomputed"
) -> list[str]:
    """One line per field: `*` marks the fields that differ."""
    left, right = event_fields(logged), event_fields(recomputed)
    lines = [f"    {'field':<20} {left_title:<{WIDTH}} {right_title}"]
    for name in _names(left, right):
        a, b = left.get(name, _MISSING), right.get(name, _MISSING)
        mark = "*" if a != b else " "
        lines.append(f"  {mark} {name:<20} {_cell(a):<{WIDTH}} {_cell(b)}")
    return lines


def _names(left: dict[str, Any], right: dict[str, Any]) -> list[str]:
    return list(left) + [name for name in right if name not in left]


class _Missing:
    def __repr__(self) -> str:
        return "-"


_MISSING = _Missing()


def _cell(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= WIDTH else text[: WIDTH - 3] + "..."
