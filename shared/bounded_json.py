"""JSON from untrusted files, with its shape bounded before it is parsed.

`loads` checks nesting depth and the number of object members with one linear scan (no
recursion, no regular expression that could backtrack) and only then hands the text to
`json.loads`, so deep nesting can never reach the parser's recursion. Duplicate keys and the
non-standard constants NaN / Infinity are refused rather than silently resolved.
"""

from __future__ import annotations

import json
import re
import reprlib
from typing import Any

MAX_DEPTH = 32
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")  # one character class: linear
_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 80
_SHORT.maxlong = 40
_SHORT.maxlevel, _SHORT.maxlist, _SHORT.maxdict = 2, 6, 4


class JsonError(ValueError):
    """Malformed or over-limit JSON; the message says which."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def loads(data: bytes, max_members: int) -> Any:
    """The JSON value in `data` (UTF-8), nested at most MAX_DEPTH deep, with at most
    `max_members` object members in all."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise JsonError("is not UTF-8") from None
    scan(text, max_members)
    try:
        return json.loads(text, object_pairs_hook=_object, parse_constant=_constant)
    except JsonError:
        raise
    except ValueError as e:  # JSONDecodeError, or an integer with too many digits
        raise JsonError(f"is not valid JSON ({_first_line(e)})") from None


def scan(text: str, max_members: int) -> None:
    """JsonError if `text` nests deeper than MAX_DEPTH or holds more than `max_members`
    object members (counted as `:` outside strings). Linear in len(text)."""
    outside = "".join(_outside_strings(text))
    if outside.count(":") > max_members:
        raise JsonError(f"has more than {max_members} object members")
    depth = 0
    for bracket in _NOT_BRACKET.sub("", outside):
        if bracket in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise JsonError(f"nests deeper than {MAX_DEPTH} levels")
        else:
            depth -= 1


def _outside_strings(text: str) -> list[str]:
    """The pieces of `text` that lie outside JSON strings."""
    parts = text.split('"')
    outside = [parts[0]]
    in_string = False
    for before, part in zip(parts, parts[1:]):  # `before` ends at the quote between the two
        escaped = in_string and (len(before) - len(before.rstrip("\\"))) % 2 == 1
        if not escaped:
            in_string = not in_string
        if not in_string:
            outside.append(part)
    if in_string:
        raise JsonError("is not valid JSON (an unterminated string)")
    return outside


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise JsonError(f"repeats the key {show(key)}")
        obj[key] = value
    return obj


def _constant(name: str) -> Any:
    raise JsonError(f"holds {name}, which is not JSON")


def _first_line(e: ValueError) -> str:
    return str(e).splitlines()[0][:200]


def show(value: Any) -> str:
    """A short repr of `value` (reprlib: long strings, lists and dicts cut), for messages that
    quote untrusted input."""
    return _SHORT.repr(value)
