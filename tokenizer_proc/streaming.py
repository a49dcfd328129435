"""Server-sent event streams for completions and chat completions. Prompt logprobs go in each
choice's first chunk (completions: its prompt's) or on the first chunk of the stream (chat): a
prompt's choice 0 computes them, so its other choices' chunks wait for that first delta
(fanout.merged)."""

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
    text = to_json(body)
    if "\x85" in text or "\u2028" in text or "\u2029" in text:  # rare: three scans beat a translate
        text = text.translate(_LINE_BREAKS)
    return f"data: {text}\n\n"


def _worth_sending(delta: Delta, return_token_ids: bool) -> bool:
    return bool(delta.text) or delta.finish_reason is not None or return_token_ids or delta.logprobs is not None


async def completion_stream(
    req_id: str, runs: Sequence[RequestRun], req: CompletionRequest, tokenizer: Any
) -> AsyncIterator[str]:
    """Choice i * n + j is prompt i's choice j; each choice's first chunk carries its prompt's
    prompt logprobs (computed by the prompt's choice 0, whose first chunk goes out first)."""
    created = int(time.time())
    include_usage = req.include_usage()
    text_offsets = [0] * len(runs)
    first = [True] * len(runs)
    prompts: dict[int, PromptLogprobsBody] = {}  # prompt index -> its prompt logprobs
    try:
        group_size = req.n if req.prompt_logprobs is not None else 0
        async with aclosing(merged(runs, group_size)) as deltas:  # closed however the loop ends
            async for index, delta in deltas:
                prompt_index = index // req.n
                if (body := _prompt_body(delta, runs[index], tokenizer)) is not None:
                    prompts.setdefault(prompt_index, body)
                prompt = prompts.get(prompt_index)
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
            yield sse(envelope(req_id, "text_completion", created, req.model, [], total_usage(runs, req.n)))
    except EngineError as exc:
        yield sse(error_body(exc.status_code, exc.message, exc.param, exc.error_type))
    yield DONE


def _prompt_body(delta: Delta, run: RequestRun, tokenizer: Any) -> PromptLogprobsBody | None:
    """The prompt logprobs a delta carries (a prompt's choice 0, its first delta), as sent."""
    if delta.prompt_logprobs is None:
        return None
    return prompt_logprobs_body(tokenizer, run.arrived.prompt_token_ids, delta.prompt_logprobs)


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
        group_size = req.n if req.prompt_logprobs is not None else 0  # prompt logprobs: choice 0's first chunk
        async with aclosing(merged(runs, group_size)) as deltas:  # closed however the loop ends
            async for index, delta in deltas:
                if first_delta:  # after the engine accepted the request
                    for chunk in _role_chunks(req_id, created, req, runs, _prompt_body(delta, runs[0], tokenizer)):
                        yield chunk
                    first_delta = False
                if not _worth_sending(delta, req.return_token_ids):
                    continue
                logprobs = chat_logprobs(tokenizer, delta.token_ids, delta.logprobs)
                choice = chat_choice(delta, logprobs, req.return_token_ids, stream=True, index=index)
                yield sse(envelope(req_id, obj, created, req.model, [choice], None, include_usage))
        if include_usage:
            yield sse(envelope(req_id, obj, created, req.model, [], total_usage(runs, req.n)))
    except EngineError as exc:
        yield sse(error_body(exc.status_code, exc.message, exc.param, exc.error_type))
    yield DONE
