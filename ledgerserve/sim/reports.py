"""What a fake rank 0 reports as prompt logprobs: made-up values a test can trace to their step."""

from __future__ import annotations

from ledgerserve.shared import events as ev


def fake_reports(plan: ev.StepPlan, asks: dict[str, tuple[int, int]]) -> list[ev.PromptLogprobs]:
    """For each request of `plan` in `asks` (req id -> (num_prompt_tokens, k)), the prompt positions
    the step scores: the logits at p score position p + 1, up to the last prompt position. Position
    p gets logprob -(p + step / 1000), so a test can tell which step scored it."""
    reports = []
    for req in list(plan.new_reqs) + list(plan.cached_reqs):
        if req.req_id not in asks:
            continue
        num_prompt_tokens, k = asks[req.req_id]
        start = req.num_computed_tokens
        positions = range(start + 1, min(start + req.num_scheduled_tokens, num_prompt_tokens - 1) + 1)
        if not positions:
            continue
        logprobs = [-(p + plan.step / 1000) for p in positions]
        tops = [[p % 5 + j for j in range(k)] for p in positions] if k else []
        reports.append(
            ev.PromptLogprobs(
                req.req_id,
                positions[0],
                logprobs,
                [p % 3 + 1 for p in positions],
                tops,
                [[-0.5 * (j + 1) for j in range(k)] for _ in positions] if k else [],
            )
        )
    return reports
