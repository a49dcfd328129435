"""Server-sent event streams for completions and chat completions."""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from tokenizer_proc.engine_client import EngineError
from tokenizer_proc.errors import error_body
from tokenizer_proc.generation import Delta, RequestRun
from tokenizer_proc.protocol import ChatCompletionRequest, CompletionRequest
from tokenizer_proc.responses import chat_choice, chat_logprobs, completion_choice, completion_logprobs, envelope

DONE = "data: [DONE]\n\n"


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _worth_sending(delta: Delta, return_token_ids: bool) -> bool:
    return bool(delta.text) or delta.finish_reason is not None or return_token_ids or delta.logprobs is not None


async def completion_stream(
    run: RequestRun, req: CompletionRequest, tokenizer: Any, model: str
) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = req.include_usage()
    text_offset = 0
    first = True
    try:
        async for delta in run.deltas():
            if not _worth_sending(delta, req.return_token_ids):
                continue
            logprobs = completion_logprobs(tokenizer, delta.token_ids, delta.logprobs, text_offset)
            text_offset += len(delta.text)
            choice = completion_choice(delta, logprobs, req.return_token_ids)
            if first and req.return_token_ids:
                choice["prompt_token_ids"] = list(run.arrived.prompt_token_ids)
            first = False
            yield sse(envelope(run.req_id, "text_completion", created, req.model, [choice], None, include_usage))
        if include_usage:
            yield sse(envelope(run.req_id, "text_completion", created, req.model, [], run.usage))
    except EngineError as exc:
        yield sse(error_body(exc.status_code, exc.message, exc.param, exc.error_type))
    yield DONE


async def chat_stream(run: RequestRun, req: ChatCompletionRequest, tokenizer: Any) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = req.include_usage()
    obj = "chat.completion.chunk"
    role_choice: dict[str, Any] = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    head = envelope(run.req_id, obj, created, req.model, [role_choice], None, include_usage)
    if req.return_token_ids:
        head["prompt_token_ids"] = list(run.arrived.prompt_token_ids)
    try:
        first_delta = True
        async for delta in run.deltas():
            if first_delta:
                yield sse(head)  # after the engine accepted the request
                first_delta = False
            if not _worth_sending(delta, req.return_token_ids):
                continue
            logprobs = chat_logprobs(tokenizer, delta.token_ids, delta.logprobs)
            choice = chat_choice(delta, logprobs, req.return_token_ids, stream=True)
            yield sse(envelope(run.req_id, obj, created, req.model, [choice], None, include_usage))
        if include_usage:
            yield sse(envelope(run.req_id, obj, created, req.model, [], run.usage))
    except EngineError as exc:
        yield sse(error_body(exc.status_code, exc.message, exc.param, exc.error_type))
    yield DONE
