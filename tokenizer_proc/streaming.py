"""Server-sent event streams for completions and chat completions. Prompt logprobs go in each
choice's first chunk (completions) or on the first chunk of the stream (chat): choice 0 computes
them, so the other choices' chunks wait for its first delta (fanout.merged)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import Any

from ledgerserve.tokenizer_proc.engine_client import EngineError
from ledgerserve.tokenizer_proc.errors import error_body
from ledgerserve.tokenizer_proc.fanout import merged, total_usage
from ledgerserve.tokenizer_proc.generation import Delta, RequestRun
from ledgerserve.tokenizer_proc.prompt_logprobs import PromptLogprobsBody, prompt_logprobs_body
from ledgerserve.tokenizer_proc.protocol import ChatCompletionRequest, CompletionRequest
from ledgerserve.tokenizer_proc.responses import (
    chat_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    envelope,
    to_json,
)

DONE = "data: [DONE]\n\n"
# JSON leaves these raw inside strings, but line readers built on str.splitlines (httpx's
# aiter_lines among them) break a line on them; escaped, an event stays one line for every client
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(body: dict[str, Any]) -> str:
    """One event; NonFiniteOutput (an EngineError: the stream ends with an error event) for NaN."""
    return f"data: {to_json(body).translate(_LINE_BREAKS)}\n\n"


def _worth_sending(delta: Delta, return_token_ids: bool) -> bool:
    return bool(delta.text) or delta.finish_reason is not None or return_token_ids or delta.logprobs is not None


async def completion_stream(
    req_id: str, runs: Sequence[RequestRun], req: CompletionRequest, tokenizer: Any
) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = req.include_usage()
    text_offsets = [0] * len(runs)
    first = [True] * len(runs)
    prompt: PromptLogprobsBody | None = None
    try:
        first_of_choice_0 = req.prompt_logprobs is not None  # prompt logprobs go out in choice 0's first chunk
        async with aclosing(merged(runs, choice_0_first=first_of_choice_0)) as deltas:  # closed however the loop ends
            async for index, delta in deltas:
                prompt = _prompt_body(prompt, delta, runs, tokenizer)
                if not _worth_sending(delta, req.return_token_ids) and not (first[index] and prompt is not None):
                    continue
                logprobs = completion_logprobs(tokenizer, delta.token_ids, delta.logprobs, text_offsets[index])
                text_offsets[index] += len(delta.text)
                choice = completion_choice(delta, logprobs, req.return_token_ids, index)
                if first[index] and req.return_token_ids:
                    choice["prompt_token_ids"] = list(runs[index].arrived.prompt_token_ids)
                if first[index] and prompt is not None:
                    choice["prompt_logprobs"] = prompt
                first[index] = False
                yield sse(envelope(req_id, "text_completion", created, req.model, [choice], None, include_usage))
        if include_usage:
            yield sse(envelope(req_id, "text_completion", created, req.model, [], total_usage(runs)))
    except EngineError as exc:
        yield sse(error_body(exc.status_code, exc.message, exc.param, exc.error_type))
    yield DONE


def _prompt_body(
    prompt: PromptLogprobsBody | None, delta: Delta, runs: Sequence[RequestRun], tokenizer: Any
) -> PromptLogprobsBody | None:
    """The stream's prompt logprobs: built from choice 0's first delta (the first to go out)."""
    if prompt is not None or delta.prompt_logprobs is None:
        return prompt
    return prompt_logprobs_body(tokenizer, runs[0].arrived.prompt_token_ids, delta.prompt_logprobs)


def _role_chunks(
    req_id: str, created: int, req: ChatCompletionRequest, runs: Sequence[RequestRun], prompt: PromptLogprobsBody | None
) -> list[str]:
    chunks = []
    for index in range(len(runs)):
        role = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        head = envelope(req_id, "chat.completion.chunk", created, req.model, [role], None, req.include_usage())
        if req.return_token_ids:
            head["prompt_token_ids"] = list(runs[index].arrived.prompt_token_ids)
        if index == 0 and prompt is not None:
            head["prompt_logprobs"] = prompt  # on the response, as in a chat completion
        chunks.append(sse(head))
    return chunks


async def chat_stream(
    req_id: str, runs: Sequence[RequestRun], req: ChatCompletionRequest, tokenizer: Any
) -> AsyncIterator[str]:
    created = int(time.time())
    include_usage = req.include_usage()
    obj = "chat.completion.chunk"
    try:
        first_delta = True
        first_of_choice_0 = req.prompt_logprobs is not None  # prompt logprobs go out in choice 0's first chunk
        async with aclosing(merged(runs, choice_0_first=first_of_choice_0)) as deltas:  # closed however the loop ends
            async for index, delta in deltas:
                if first_delta:  # after the engine accepted the request
                    for chunk in _role_chunks(req_id, created, req, runs, _prompt_body(None, delta, runs, tokenizer)):
                        yield chunk
                    first_delta = False
                if not _worth_sending(delta, req.return_token_ids):
                    continue
                logprobs = chat_logprobs(tokenizer, delta.token_ids, delta.logprobs)
                choice = chat_choice(delta, logprobs, req.return_token_ids, stream=True, index=index)
                yield sse(envelope(req_id, obj, created, req.model, [choice], None, include_usage))
        if include_usage:
            yield sse(envelope(req_id, obj, created, req.model, [], total_usage(runs)))
    except EngineError as exc:
        yield sse(error_body(exc.status_code, exc.message, exc.param, exc.error_type))
    yield DONE
