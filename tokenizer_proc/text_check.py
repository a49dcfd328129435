"""Text is checked at the edge: every string of a JSON request body must encode to UTF-8.

JSON can carry a lone UTF-16 surrogate (`"\\ud800"`, or its raw bytes, which Python's JSON
decoder lets through), and Python keeps it in a str that no tokenizer, path function or
response encoder accepts. One route class checks the decoded body of every route before
its model is validated, and refuses the first such string (or key) with a 400 naming where
it is, e.g. `messages.0.content`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Coroutine
from typing import Any

import msgspec
from fastapi import Request, Response
from fastapi.routing import APIRoute

from ledgerserve.tokenizer_proc.protocol import InvalidParam
from ledgerserve.tokenizer_proc.request_fields import shown_name

# a surrogate written as an escape; a body with other non-ASCII bytes is walked whatever it holds
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")

Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class TextCheckedRoute(APIRoute):
    """An APIRoute whose JSON body is refused (400) if any string in it is not valid text."""

    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            body = await request.body()
            if body and may_hold_surrogates(body):
                try:
                    data = await request.json()  # cached on the request: the route reads it again
                except ValueError:
                    data = None  # not JSON: the route's own validation says so
                check_text(data)
            return await handler(request)

        return checked


def may_hold_surrogates(body: bytes) -> bool:
    return not body.isascii() or _SURROGATE_ESCAPE.search(body) is not None


def check_text(data: Any) -> None:
    """InvalidParam naming the first string or key in `data` that does not encode to UTF-8."""
    found = first_bad_text(data)
    if found is None:
        return
    path, is_key = found
    where = ".".join(shown_name(str(part)) for part in path)
    param = shown_name(str(path[0])) if path else None
    if is_key:
        what = f"a key of `{where}`" if where else "a field name"
    else:
        what = f"`{where}`"
    raise InvalidParam(f"{what} is not valid UTF-8 text (it holds an unpaired UTF-16 surrogate)", param)


def first_bad_text(data: Any) -> tuple[tuple[str | int, ...], bool] | None:
    """(path, is_key) of a string that does not encode to UTF-8, the first in document order but
    that an object's keys come before its values. The whole body is checked at once in C
    (msgspec); only a body holding such a string is then searched, along the one path that leads
    to it, container by container and CHUNK children at a time, so no body costs a walk of
    every string in Python, and no nesting exhausts the stack."""
    if _all_encode(data):
        return None
    path: list[str | int] = []
    node = data
    while isinstance(node, (dict, list)):
        keys = list(node) if isinstance(node, dict) else None
        if keys is not None and _first_failing(keys) is not None:
            return tuple(path), True
        values = list(node.values()) if isinstance(node, dict) else node
        index = _first_failing(values)
        if index is None:
            return None
        path.append(keys[index] if keys is not None else index)
        node = values[index]
    return (tuple(path), False) if isinstance(node, str) else None


CHUNK = 4096  # children checked at once in C while searching for the failing one


def _first_failing(values: list[Any]) -> int | None:
    """The index of the first value that is, or holds, a string that does not encode."""
    for start in range(0, len(values), CHUNK):
        chunk = values[start : start + CHUNK]
        if _all_encode(chunk):
            continue
        for offset, value in enumerate(chunk):
            if not _all_encode(value):
                return start + offset
    return None


def _all_encode(data: Any) -> bool:
    """Whether every string and key in `data` encodes to UTF-8: msgspec's encoder refuses lone
    surrogates; a structure too deep for it is walked here, iteratively."""
    try:
        msgspec.json.encode(data)
    except UnicodeEncodeError:
        return False
    except (RecursionError, TypeError, ValueError, OverflowError):
        return _walk_encodes(data)
    return True


def _walk_encodes(data: Any) -> bool:
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            if not encodes(node):
                return False
        elif isinstance(node, dict):
            if not all(encodes(key) for key in node if isinstance(key, str)):
                return False
            stack.extend(value for value in node.values() if isinstance(value, (str, dict, list)))
        elif isinstance(node, list):
            stack.extend(value for value in node if isinstance(value, (str, dict, list)))
    return True


def encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
