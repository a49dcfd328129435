"""Bounds on the big lists a request body may hold, checked before the body is validated.

A body within `--max-request-bytes` can still hold a million token ids or a quarter of a
million empty chat messages, and turning those into validated Python objects (and a chat of
them into a rendered prompt) would hold the event loop for seconds. So every route first
splits the raw JSON with msgspec, which reads each top-level field as raw bytes and a bounded
list as raw elements without building their values, and refuses with a 400:

- `prompt`: more than `--max-n` prompts, or a prompt of token ids longer than `max_model_len`
  (no such prompt leaves room to generate);
- `messages`: more than MAX_MESSAGES messages;
- `tokens` (/detokenize): more than `max_model_len` token ids.

A body msgspec cannot split (not JSON, NaN, a lone surrogate escape, not UTF-8) is parsed as
the routes parse it (json.loads, kept for them) and judged the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Request, Response
from fastapi.routing import APIRoute

from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.protocol import InvalidParam
from ledgerserve.tokenizer_proc.text_check import TextCheckedRoute

MAX_MESSAGES = 4096  # a chat of more messages is refused before its messages are read

Handler = Callable[[Request], Coroutine[Any, Any, Response]]
_FIELDS = dict[str, msgspec.Raw]
_ELEMENTS = list[msgspec.Raw]


@dataclass(frozen=True)
class BodyBounds:
    max_prompt_ids: int  # token ids in one prompt: max_model_len
    max_prompts: int  # prompts in one completion request: --max-n
    max_token_ids: int  # token ids to detokenize: max_model_len
    max_messages: int = MAX_MESSAGES

    @classmethod
    def for_config(cls, config: EngineConfig) -> BodyBounds:
        return cls(config.max_model_len, config.max_n, config.max_model_len)


def bounded_route(bounds: BodyBounds) -> type[APIRoute]:
    """A route class whose bodies are held to `bounds`, then checked for valid text."""

    class BoundedRoute(TextCheckedRoute):
        def get_route_handler(self) -> Handler:
            handler = super().get_route_handler()

            async def bounded(request: Request) -> Response:
                body = await request.body()
                if body:
                    fields = split(body)
                    if fields is None:
                        fields = await _parsed(request)
                    if fields is not None:
                        check_fields(fields, bounds)
                return await handler(request)

            return bounded

    return BoundedRoute


def split(body: bytes) -> dict[str, msgspec.Raw] | None:
    """The body's top-level fields as raw JSON, or None if msgspec cannot read it as an object."""
    try:
        return msgspec.json.decode(body, type=_FIELDS)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


async def _parsed(request: Request) -> dict[str, Any] | None:
    try:
        data = await request.json()  # cached on the request: the route reads it again
    except ValueError:
        return None  # not JSON: the route's own validation says so
    return data if isinstance(data, dict) else None


def check_fields(fields: Mapping[str, Any], bounds: BodyBounds) -> None:
    """InvalidParam for the first field over its bound; values are raw JSON or parsed Python."""
    _check_prompt(fields.get("prompt"), bounds)
    num_messages = count(fields.get("messages"))
    if num_messages is not None and num_messages > bounds.max_messages:
        raise InvalidParam(f"at most {bounds.max_messages} messages are allowed, got {num_messages}", "messages")
    num_tokens = count(fields.get("tokens"))
    if num_tokens is not None and num_tokens > bounds.max_token_ids:
        raise InvalidParam(
            f"at most {bounds.max_token_ids} token ids (the maximum context length) can be detokenized, "
            f"got {num_tokens}",
            "tokens",
        )


def _check_prompt(value: Any, bounds: BodyBounds) -> None:
    if _numbers_only(value):  # one prompt of token ids, counted without reading them
        _check_ids(count(value) or 0, bounds, "prompt")
        return
    items = elements(value)
    if not items:
        return
    if _kind(items[0]) not in (list, str):  # one prompt of token ids
        _check_ids(len(items), bounds, "prompt")
        return
    if len(items) > bounds.max_prompts:
        raise InvalidParam(f"at most {bounds.max_prompts} prompts (--max-n) are allowed, got {len(items)}", "prompt")
    for index, item in enumerate(items):
        num_ids = count(item)
        if num_ids is not None:
            _check_ids(num_ids, bounds, f"prompt.{index}")


def _check_ids(num_ids: int, bounds: BodyBounds, where: str) -> None:
    if num_ids > bounds.max_prompt_ids:
        prompt = "the prompt" if where == "prompt" else f"`{where}`"
        raise InvalidParam(
            f"This model's maximum context length is {bounds.max_prompt_ids} tokens, "
            f"but {prompt} has {num_ids} tokens.",
            "prompt",
        )


def count(value: Any) -> int | None:
    """How many elements a JSON array has, or None if `value` is not an array. A raw array of
    numbers alone is counted by its commas, without reading its elements."""
    if _numbers_only(value):
        raw = bytes(value)
        return raw.count(b",") + 1 if raw[1:-1].strip() else 0
    found = elements(value)
    return None if found is None else len(found)


def _numbers_only(value: Any) -> bool:
    """A raw array without nested arrays, objects or strings: its commas separate its elements."""
    if not isinstance(value, msgspec.Raw) or _kind(value) is not list:
        return False
    raw = bytes(value)
    return raw.count(b"[") == 1 and b'"' not in raw and b"{" not in raw


def elements(value: Any) -> list[Any] | None:
    """A JSON array's elements (raw, if it is raw), or None if `value` is not an array."""
    if isinstance(value, list):
        return value
    if isinstance(value, msgspec.Raw) and _kind(value) is list:
        try:
            return msgspec.json.decode(value, type=_ELEMENTS)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return None
    return None


def _kind(value: Any) -> type | None:
    """list or str for a JSON array or string (raw or parsed); None for anything else."""
    if isinstance(value, msgspec.Raw):
        first = bytes(memoryview(value)[:1])
        return list if first == b"[" else str if first == b'"' else None
    return list if isinstance(value, list) else str if isinstance(value, str) else None
