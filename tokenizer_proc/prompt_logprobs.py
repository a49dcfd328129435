"""vLLM's `prompt_logprobs` in a response: the engine's reports for a request (one per prefill
chunk), assembled into one entry per prompt position. Position 0 is None (nothing predicts it);
every other position maps token id -> {"logprob", "rank", "decoded_token"} for the prompt token
there (its rank: how many tokens were at least as likely) and for the top k (ranks 1..k). As in
vLLM the top k are written after the prompt token, so a prompt token among them keeps its key
and shows its top-k rank. Token ids become string keys in JSON, as in vLLM's responses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ledgerserve.shared.events import PromptLogprobs

PromptLogprobsBody = list[dict[int, dict[str, Any]] | None]


def prompt_logprobs_body(
    tokenizer: Any, prompt_ids: Sequence[int], reports: Sequence[PromptLogprobs]
) -> PromptLogprobsBody:
    body: PromptLogprobsBody = [None] * len(prompt_ids)
    texts = _token_texts(tokenizer, prompt_ids, reports)
    for report in reports:
        top_ids = report.top_token_ids or [[] for _ in report.logprobs]
        top_values = report.top_logprobs or [[] for _ in report.logprobs]
        for i, (logprob, rank, ids, values) in enumerate(zip(report.logprobs, report.ranks, top_ids, top_values)):
            token_id = prompt_ids[report.start + i]
            entry = {token_id: _logprob(logprob, rank, texts[token_id])}
            for top_rank, (top_id, value) in enumerate(zip(ids, values), start=1):
                entry[top_id] = _logprob(value, top_rank, texts[top_id])
            body[report.start + i] = entry
    return body


def _logprob(logprob: float, rank: int, decoded_token: str) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": decoded_token}


def _token_texts(tokenizer: Any, prompt_ids: Sequence[int], reports: Sequence[PromptLogprobs]) -> dict[int, str]:
    """Each token id's own text (special tokens included), decoded once per distinct id."""
    ids = {token_id for report in reports for top in report.top_token_ids for token_id in top}
    ids.update(prompt_ids)
    ordered = sorted(ids)
    return dict(zip(ordered, tokenizer.batch_decode([[t] for t in ordered], skip_special_tokens=False)))
