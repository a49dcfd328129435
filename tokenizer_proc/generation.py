"""Drive one request through the engine: detokenize, match stop strings, account usage."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ledgerserve.shared.events import PromptLogprobs, RequestArrived, TokenLogprobs
from ledgerserve.tokenizer_proc.detokenizer import IncrementalDetokenizer
from ledgerserve.tokenizer_proc.engine_client import EngineClientBase, EngineError
from ledgerserve.tokenizer_proc.request_trace import RequestTrace


@dataclass
class Delta:
    """What one engine output adds to a choice."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    # on a request's first delta, when it asked for them: the engine's reports, every prompt position
    prompt_logprobs: list[PromptLogprobs] | None = None


@dataclass
class Usage:
    num_prompt_tokens: int
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


@dataclass
class RequestRun:
    engine: EngineClientBase
    tokenizer: Any
    arrived: RequestArrived
    stop: Sequence[str]
    skip_special_tokens: bool = True
    usage: Usage = field(init=False)

    def __post_init__(self) -> None:
        self.usage = Usage(num_prompt_tokens=len(self.arrived.prompt_token_ids))

    @property
    def req_id(self) -> str:
        return self.arrived.req_id

    async def deltas(self) -> AsyncIterator[Delta]:
        """Yield deltas until the request finishes; abort it in the engine on a stop
        string, and on any early exit (client gone, cancellation)."""
        detok = IncrementalDetokenizer(
            self.tokenizer, self.arrived.prompt_token_ids, self.stop, self.skip_special_tokens
        )
        prompt: list[PromptLogprobs] | None = [] if self.arrived.sampling.prompt_logprobs is not None else None
        trace = RequestTrace(self.arrived, self.engine.request_observer)
        try:
            async for out in self.engine.generate(self.arrived):
                self.usage.num_cached_tokens = max(self.usage.num_cached_tokens, out.num_cached_tokens)
                finished = out.finish_reason is not None
                if out.prompt_logprobs is not None and prompt is not None:
                    prompt.append(out.prompt_logprobs)
                if not out.new_token_ids and not finished:
                    continue  # a prefill chunk's prompt logprobs: they go with the first delta
                num_before = len(detok.output_token_ids)
                text = detok.push(out.new_token_ids, finished)
                num_taken = len(detok.output_token_ids) - num_before
                self.usage.num_output_tokens += num_taken
                trace.on_tokens(num_taken, self.usage.num_cached_tokens)
                logprobs = out.logprobs[:num_taken] if out.logprobs is not None else None
                token_ids = list(out.new_token_ids[:num_taken])
                if detok.stopped:
                    trace.finish("stop")
                    if not finished:
                        await self.engine.abort(self.req_id, "stop")
                    yield Delta(text, token_ids, logprobs, "stop", detok.stop_matched, prompt)
                    return
                if finished:
                    trace.finish(out.finish_reason)
                yield Delta(text, token_ids, logprobs, out.finish_reason, out.stop_token_id, prompt)
                prompt = None
                if finished:
                    return
        except EngineError as exc:
            trace.fail(exc.status_code)
            raise
        finally:
            self.engine.release(self.req_id)
            trace.finish("abort")  # left early (client gone, cancelled); nothing once it ended


async def collect(run: RequestRun) -> Delta:
    """Run to completion; return the whole output as one delta."""
    texts: list[str] = []
    token_ids: list[int] = []
    logprobs: list[TokenLogprobs] | None = None
    prompt: list[PromptLogprobs] | None = None
    last = Delta("", [], None)
    async for delta in run.deltas():
        texts.append(delta.text)
        token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            logprobs = (logprobs or []) + list(delta.logprobs)
        prompt = delta.prompt_logprobs if prompt is None else prompt
        last = delta
    return Delta("".join(texts), token_ids, logprobs, last.finish_reason, last.stop_reason, prompt)
