"""Prompt logprobs as the core passes them on. Rank 0 reports, with each step, those of the prompt
positions the step computed for every request asking for them (the logits at position p score
the prompt token at p + 1). The core checks the report against what it scheduled and sends the
positions not sent before: a request preempted and recomputed reports its positions again.

Pure functions of the request's counts and the report; the core keeps `num_prompt_logprobs_sent`.
"""

from __future__ import annotations

from ledgerserve.shared.events import PromptLogprobs
from ledgerserve.shared.sampling import SamplingParams


def step_span(num_computed_tokens: int, num_tokens: int, num_prompt_tokens: int) -> tuple[int, int]:
    """(first position, number of positions) of the prompt tokens that a step computing tokens
    [num_computed_tokens, + num_tokens) scores: every computed position before the last prompt
    position scores the token after it (the last one's logits are the first sample's)."""
    end = min(num_computed_tokens + num_tokens, num_prompt_tokens - 1)
    return num_computed_tokens + 1, max(0, end - num_computed_tokens)


def report_error(
    sampling: SamplingParams, first: int, count: int, num_sent: int, report: PromptLogprobs | None
) -> str | None:
    """Why rank 0's `report` for a step whose prompt span is (first, count) is wrong, or None.
    Positions 1..num_sent went out already; a report may repeat them, never skip past them."""
    if sampling.prompt_logprobs is None or count == 0:
        return (
            None if report is None else f"rank 0 reported prompt logprobs from position {report.start}, none were due"
        )
    if report is None:
        return f"rank 0 reported no prompt logprobs for positions {first}..{first + count - 1}"
    if report.start != first or len(report.logprobs) != count or len(report.ranks) != count:
        return (
            f"rank 0 reported {len(report.logprobs)} prompt logprobs from position {report.start}, "
            f"expected {count} from position {first}"
        )
    if first > num_sent + 1:
        return f"prompt logprobs of positions {num_sent + 1}..{first - 1} were never reported"
    num_top = sampling.prompt_logprobs
    if (report.top_token_ids or report.top_logprobs) and (
        len(report.top_token_ids) != count
        or len(report.top_logprobs) != count
        or any(
            len(ids) != len(lps) or len(ids) > num_top for ids, lps in zip(report.top_token_ids, report.top_logprobs)
        )
    ):
        return f"rank 0 reported top prompt logprobs of mismatched lengths (k = {num_top})"
    return None


def unsent(report: PromptLogprobs, num_sent: int) -> PromptLogprobs | None:
    """The part of a checked `report` after position `num_sent` (None if nothing is new)."""
    skip = num_sent + 1 - report.start
    if skip <= 0:
        return report
    if skip >= len(report.logprobs):
        return None
    return PromptLogprobs(
        report.req_id,
        report.start + skip,
        report.logprobs[skip:],
        report.ranks[skip:],
        report.top_token_ids[skip:],
        report.top_logprobs[skip:],
    )
