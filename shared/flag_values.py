"""How the text of a serve flag becomes a setting's value: vLLM's human-readable integers, dtype
aliases, JSON lists, Hugging Face revision names and the generation-config source."""

from __future__ import annotations

import json
import os
import re
from typing import Any


def human_readable_int(text: str) -> int:
    """vLLM's rule: a plain int, or a number with a suffix: k, m, g, t decimal (1k = 1000, 25.6k
    allowed), K, M, G, T binary (1K = 1024, whole numbers only)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    if match is None:
        return int(text)
    number, suffix = match.groups()
    power = "kmgt".index(suffix.lower()) + 1
    if suffix.islower():
        return int(float(number) * 1000**power)
    if not number.isdigit():
        raise ValueError(f"{text!r}: no decimals with a binary suffix; did you mean {number}{suffix.lower()}?")
    return int(number) * 1024**power


DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's names


def dtype_name(text: str) -> str:
    return DTYPE_ALIASES.get(text, text)


def json_str_list(text: str) -> tuple[str, ...]:
    """A JSON list of strings, as vLLM takes --allowed-origins."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{text!r} is not a JSON list of strings, e.g. '[\"https://example.com\"]'")
    return tuple(value)


CORS_LIST: dict[str, Any] = {"parse": json_str_list, "repeat": False}
_REVISION_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+@-]*")


def revision_name(text: str) -> str:
    """A Hugging Face revision: a branch, tag or commit name, parts joined by `/` (`refs/pr/1`), each
    of letters, digits and `_ . + @ -`, not starting with `.` or `-`, no `..`: never a path out of the
    cache's refs."""
    parts = text.split("/")
    if len(text) > 256 or ".." in text or not all(_REVISION_PART.fullmatch(part) for part in parts):
        raise ValueError(
            f"revision {text!r} is not a branch, tag or commit name (letters, digits and _ . + @ - in parts "
            "joined by /, none starting with . or -, no ..)"
        )
    return text


def generation_config_source(text: str) -> str:
    """`auto`, `vllm`, or a directory (made absolute: the HTTP process may run elsewhere)."""
    return text if text in ("auto", "vllm") else os.path.realpath(text)
