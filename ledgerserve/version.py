"""The version of ledgerserve: the installed distribution's, else (a source tree run without
installing it) the one pyproject.toml gives."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

DISTRIBUTION = "ledgerserve"
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return source_version(PYPROJECT)


def source_version(pyproject: Path) -> str:
    """The `version = "..."` of the [project] table of `pyproject` ("unknown" when there is none)."""
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return "unknown"
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.MULTILINE | re.DOTALL)
    found = re.search(r'^version\s*=\s*"([^"]+)"', project.group(1), re.MULTILINE) if project else None
    return found.group(1) if found else "unknown"
