"""How a request ends. Pure checks: a stop on its newest token, and who may be served at all.
The endings (a finish, a worker's failure, a rejection at admission) take the request out of
the core for good and return what its end decides."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ledgerserve.scheduler_proc.core.block_manager import num_blocks_for
from ledgerserve.scheduler_proc.core.decisions import Decisions
from ledgerserve.scheduler_proc.core.request import FINISH_REASON_TO_STATUS, Request, RequestStatus, transition
from ledgerserve.shared import events as ev
from ledgerserve.shared.sampling import SamplingParams

if TYPE_CHECKING:
    from ledgerserve.scheduler_proc.core.core import Core


def check_stop(
    token_id: int,
    num_output_tokens: int,
    num_tokens: int,
    sampling: SamplingParams,
    eos_token_ids: list[int],
    max_model_len: int,
) -> tuple[str | None, int | None]:
    """(finish_reason, stop_token_id) after `token_id` was appended. EOS and stop ids only
    count once `min_tokens` outputs exist; a stop beats a length limit hit at once."""
    if num_output_tokens >= sampling.min_tokens:
        if not sampling.ignore_eos and token_id in eos_token_ids:
            return "stop", token_id
        if token_id in sampling.stop_token_ids:
            return "stop", token_id
    if reaches_length(num_output_tokens, num_tokens, sampling, max_model_len):
        return "length", None
    return None, None


def reaches_length(num_output_tokens: int, num_tokens: int, sampling: SamplingParams, max_model_len: int) -> bool:
    """Whether a request with these counts ends by length (max_tokens or max_model_len)."""
    return num_output_tokens >= sampling.max_tokens or num_tokens >= max_model_len


def max_blocks_needed(num_prompt_tokens: int, max_tokens: int, max_model_len: int, block_size: int) -> int:
    """KV blocks a request holds at its longest: every token but the last sampled one."""
    final_len = min(num_prompt_tokens + max_tokens, max_model_len)
    return num_blocks_for(max(num_prompt_tokens, final_len - 1), block_size)


def admission_error(
    num_prompt_tokens: int, sampling: SamplingParams, max_model_len: int, block_size: int, num_total_blocks: int | None
) -> str | None:
    """Why a request can never be served, or None. Requests are only admitted if they fit
    the whole KV pool alone at their longest, so the oldest one always makes progress."""
    if num_prompt_tokens == 0:
        return "The prompt is empty; it must contain at least one token."
    if num_prompt_tokens > max_model_len:
        return (
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens} tokens in the prompt. Please reduce the length of the prompt."
        )
    if sampling.max_tokens < 1:
        return f"max_tokens must be at least 1, got {sampling.max_tokens}."
    if num_total_blocks is None:
        return None
    num_blocks = max_blocks_needed(num_prompt_tokens, sampling.max_tokens, max_model_len, block_size)
    if num_blocks > num_total_blocks:
        return (
            f"The request needs up to {num_blocks} KV cache blocks ({num_prompt_tokens} prompt tokens plus up to "
            f"{sampling.max_tokens} generated, {block_size} tokens per block) but the KV cache holds only "
            f"{num_total_blocks} blocks. Please reduce the prompt or max_tokens."
        )
    return None


def append_token(core: Core, req: Request, token: ev.SampledToken) -> Decisions:
    req.output_token_ids.append(token.token_id)
    reason, stop_token_id = check_stop(
        token.token_id,
        req.num_output_tokens,
        req.num_tokens,
        req.sampling,
        core.eos_token_ids,
        core.config.max_model_len,
    )
    logprobs = [token.logprobs] if token.logprobs is not None else None
    if reason is not None:
        return finish(core, req, reason, [token.token_id], logprobs, stop_token_id)
    return [emitted(req, [token.token_id], logprobs, None, None)]


def finish(
    core: Core, req: Request, reason: str, token_ids: list[int], logprobs: Any, stop_token_id: int | None
) -> Decisions:
    released = _retire(core, req, FINISH_REASON_TO_STATUS[reason])
    return [
        emitted(req, token_ids, logprobs, reason, stop_token_id),
        ev.RequestFinished(req.req_id, reason, req.num_output_tokens),
    ] + released


def fail_request(core: Core, req: Request, message: str) -> Decisions:
    released = _retire(core, req, RequestStatus.FINISHED_ERROR)
    return [
        ev.RequestFinished(req.req_id, "error", req.num_output_tokens),
        ev.RequestRejected(req.req_id, f"The worker failed this request: {message}", code=500),
    ] + released


def reject_if_unservable(core: Core, req: Request) -> Decisions:
    num_total_blocks = core.scheduler.block_manager.num_total_blocks if core.scheduler.is_ready else None
    message = admission_error(
        req.num_prompt_tokens, req.sampling, core.config.max_model_len, core.config.block_size, num_total_blocks
    )
    if message is None:
        return []
    released = _retire(core, req, RequestStatus.FINISHED_ERROR)
    return [ev.RequestRejected(req.req_id, message, code=400)] + released


def _retire(core: Core, req: Request, status: RequestStatus) -> Decisions:
    """Take a request out for good; returns the adapter decisions its end triggers."""
    released = core.adapters.release(req)
    core.scheduler.remove(req, core.step)
    transition(req, status)
    del core.requests[req.req_id]
    if req.on_worker:
        core.finished_req_ids.append(req.req_id)
    return released


def emitted(
    req: Request,
    token_ids: list[int],
    logprobs: Any,
    reason: str | None,
    stop_token_id: int | None,
    prompt: ev.PromptLogprobs | None = None,
) -> ev.TokensEmitted:
    return ev.TokensEmitted(
        req_id=req.req_id,
        new_token_ids=token_ids,
        finish_reason=reason,
        logprobs=logprobs,
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens,
        stop_token_id=stop_token_id,
        prompt_logprobs=prompt,
    )
