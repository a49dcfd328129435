"""A benchmark's files: JSON inputs read with a clear error, reports written with their parent
directories made."""

from __future__ import annotations

import json
import os
from typing import Any


def write_file(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def write_json(path: str, report: Any, indent: int = 2) -> None:
    write_file(path, json.dumps(report, indent=indent).encode())


def read_json(path: str, what: str) -> Any:
    """The JSON in `path`; ValueError naming `what` when it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {what} {path!r}: {e}") from None
