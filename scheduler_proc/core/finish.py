"""Pure stop checks on a request's newest token, and who may be served at all."""

from __future__ import annotations

from ledgerserve.scheduler_proc.core.block_manager import num_blocks_for
from ledgerserve.shared.sampling import SamplingParams


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
