"""Bounds on the big lists a request body may hold, checked before the body is validated.

A body within `--max-request-bytes` can still hold a million token ids or a quarter of a
million empty chat messages, and turning those into validated Python objects (and a chat of
them into a rendered prompt) would hold the event loop for seconds. So every route first
splits the raw JSON with msgspec, which reads each top-level field as raw bytes and a bounded
list as raw elements without building their values, and refuses with a 400:

- `prompt`: more than `--max-n` prompts, or a prompt of token ids longer than `max_model_len`
  (no such prompt leaves room to generate);
- `messages`: more than MAX_MESSAGES messages, or a message of more than MAX_CONTENT_PARTS
  content parts;
- `tokens` (/detokenize): more than `max_model_len` token ids;
- `stop`, `logit_bias` and `metadata` past the bounds protocol.py gives them (which pydantic
  would check only after validating every element).

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
from ledgerserve.tokenizer_proc.protocol import MAX_LOGIT_BIAS, MAX_METADATA, MAX_STOP_STRINGS, InvalidParam
from ledgerserve.tokenizer_proc.text_check import TextCheckedRoute

MAX_MESSAGES = 4096  # a chat of more messages is refused before its messages are read
MAX_CONTENT_PARTS = 4096  # content parts of one message
FIXED_BOUNDS = {  # field -> (its most elements or members, what they are)
    "stop": (MAX_STOP_STRINGS, "stop strings"),
    "logit_bias": (MAX_LOGIT_BIAS, "logit_bias entries"),
    "metadata": (MAX_METADATA, "metadata pairs"),
}

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
    _check_messages(fields.get("messages"), bounds)
    what = "token ids (the maximum context length) can be detokenized"
    _check_size(fields.get("tokens"), bounds.max_token_ids, "tokens", what)
    for name, (limit, what) in FIXED_BOUNDS.items():
        _check_size(fields.get(name), limit, name, f"{what} are allowed")


def _check_size(value: Any, limit: int, param: str, what: str) -> None:
    found = count(value)
    if found is None:
        members = _members(value)
        found = None if members is None else len(members)
    if found is not None and found > limit:
        raise InvalidParam(f"at most {limit} {what}, got {found}", param)


def _check_messages(value: Any, bounds: BodyBounds) -> None:
    messages = elements(value)
    if messages is None:
        return
    if len(messages) > bounds.max_messages:
        raise InvalidParam(f"at most {bounds.max_messages} messages are allowed, got {len(messages)}", "messages")
    for index, message in enumerate(messages):
        num_parts = count((_members(message) or {}).get("content"))
        if num_parts is not None and num_parts > MAX_CONTENT_PARTS:
            raise InvalidParam(
                f"`messages.{index}.content`: at most {MAX_CONTENT_PARTS} content parts are allowed, got {num_parts}",
                "messages",
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


def _members(value: Any) -> Mapping[str, Any] | None:
    """A JSON object's members (values raw, if it is raw), or None if `value` is not an object."""
    if isinstance(value, dict):
        return value
    if isinstance(value, msgspec.Raw) and bytes(memoryview(value)[:1]) == b"{":
        try:
            return msgspec.json.decode(value, type=_FIELDS)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return None
    return None


def _kind(value: Any) -> type | None:
    """list or str for a JSON array or string (raw or parsed); None for anything else."""
    if isinstance(value, msgspec.Raw):
        first = bytes(memoryview(value)[:1])
        return list if first == b"[" else str if first == b'"' else None
    return list if isinstance(value, list) else str if isinstance(value, str) else None
