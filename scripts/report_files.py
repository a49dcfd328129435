"""A benchmark's report files: written with their parent directories made."""

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
