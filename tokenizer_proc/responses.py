"""OpenAI response bodies (plain dicts) for completions and chat completions, and their JSON.

No NaN or infinity is ever written: a logprob of -inf is sent as LOGPROB_FLOOR (vLLM's), and
a NaN (or +inf) fails the request with a 500; the serializer refuses any non-finite number.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from fastapi import Response

from ledgerserve.shared.events import TokenLogprobs
from ledgerserve.tokenizer_proc.engine_client import EngineError
from ledgerserve.tokenizer_proc.generation import Delta, Usage

LOGPROB_FLOOR = -9999.0


class NonFiniteOutput(EngineError):
    """The output holds a number JSON cannot carry (a NaN logprob): the request fails."""


def finite_logprob(value: float) -> float:
    """-inf (no chance at all) becomes LOGPROB_FLOOR; NaN or +inf fail the request."""
    if math.isnan(value) or value == math.inf:
        raise NonFiniteOutput(f"the model produced a logprob of {value}, which is not a number; the request failed")
    return max(value, LOGPROB_FLOOR)


def to_json(body: Any) -> str:
    """`body` as compact JSON; NonFiniteOutput rather than writing NaN or Infinity."""
    try:
        return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError as exc:
        raise NonFiniteOutput(f"the response holds a number JSON cannot carry ({exc}); the request failed") from exc


def json_response(body: Any) -> Response:
    return Response(to_json(body).encode("utf-8"), media_type="application/json")


def completion_choice(delta: Delta, logprobs: dict | None, return_token_ids: bool, index: int = 0) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": index,
        "text": delta.text,
        "logprobs": logprobs,
        "finish_reason": delta.finish_reason,
        "stop_reason": delta.stop_reason,
    }
    if return_token_ids:
        choice["token_ids"] = delta.token_ids
    return choice


def chat_choice(
    delta: Delta, logprobs: dict | None, return_token_ids: bool, stream: bool, index: int = 0
) -> dict[str, Any]:
    message: dict[str, Any] = {"content": delta.text} if stream else {"role": "assistant", "content": delta.text}
    choice: dict[str, Any] = {"index": index, "delta" if stream else "message": message, "logprobs": logprobs}
    choice["finish_reason"] = delta.finish_reason
    choice["stop_reason"] = delta.stop_reason
    if return_token_ids:
        choice["token_ids"] = delta.token_ids
    return choice


def envelope(
    req_id: str,
    obj: str,
    created: int,
    model: str,
    choices: list[dict[str, Any]],
    usage: Usage | None,
    include_usage_key: bool = True,
) -> dict[str, Any]:
    body: dict[str, Any] = {"id": req_id, "object": obj, "created": created, "model": model, "choices": choices}
    if include_usage_key:
        body["usage"] = usage.as_dict() if usage is not None else None
    return body


def completion_logprobs(
    tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None, text_offset: int
) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    tokens = [_token_text(tokenizer, t) for t in token_ids]
    offsets: list[int] = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    top = []
    for token_id, lp in zip(token_ids, logprobs):
        entry = {_token_text(tokenizer, t): finite_logprob(v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
        entry.setdefault(_token_text(tokenizer, token_id), finite_logprob(lp.logprob))
        top.append(entry)
    return {
        "text_offset": offsets,
        "token_logprobs": [finite_logprob(lp.logprob) for lp in logprobs],
        "tokens": tokens,
        "top_logprobs": top,
    }


def chat_logprobs(
    tokenizer: Any, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None
) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    content = []
    for token_id, lp in zip(token_ids, logprobs):
        entry = _chat_entry(tokenizer, token_id, lp.logprob)
        entry["top_logprobs"] = [_chat_entry(tokenizer, t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs)]
        content.append(entry)
    return {"content": content}


def _chat_entry(tokenizer: Any, token_id: int, logprob: float) -> dict[str, Any]:
    text = _token_text(tokenizer, token_id)
    return {"token": text, "logprob": finite_logprob(logprob), "bytes": list(text.encode("utf-8"))}


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)
