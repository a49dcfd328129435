"""vLLM's `prompt_logprobs` in a response: the engine's reports for a request (one per prefill
chunk), assembled into one entry per prompt position. Position 0 is None (nothing predicts it);
every other position maps token id -> {"logprob", "rank", "decoded_token"} for the prompt token
there (its rank: how many tokens were at least as likely) and for the top k (ranks 1..k). As in
vLLM the top k are written after the prompt token, so a prompt token among them keeps its key
and shows its top-k rank. Token ids become string keys in JSON, as in vLLM's responses.

A completion's response carries a prompt's logprobs on each of its `n` choices (a chat's once),
so one cheap request could ask for a huge body: `check_response_size` refuses a request whose
response would hold more entries than one prompt of `max_model_len` tokens at the most
`prompt_logprobs` (MAX_LOGPROBS) does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ledgerserve.shared.events import PromptLogprobs
from ledgerserve.tokenizer_proc.protocol import MAX_LOGPROBS, InvalidParam

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


def check_response_size(
    num_logprobs: int | None, num_prompt_tokens: Sequence[int], copies: int, max_model_len: int
) -> None:
    """InvalidParam when `copies` copies of each prompt's logprobs (positions after the first,
    each with the prompt token and the top `num_logprobs`) pass max_model_len x (MAX_LOGPROBS + 1)."""
    if num_logprobs is None:
        return
    num_entries = copies * sum(max(n - 1, 0) for n in num_prompt_tokens) * (num_logprobs + 1)
    limit = max_model_len * (MAX_LOGPROBS + 1)
    if num_entries > limit:
        raise InvalidParam(
            f"prompt_logprobs={num_logprobs} would put {num_entries} logprob entries in the response "
            f"(each of {copies} choices carries its prompt's); at most {limit} are allowed: ask for fewer "
            "choices, shorter prompts or fewer prompt_logprobs",
            "prompt_logprobs",
        )


def _logprob(logprob: float, rank: int, decoded_token: str) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": decoded_token}


def _token_texts(tokenizer: Any, prompt_ids: Sequence[int], reports: Sequence[PromptLogprobs]) -> dict[int, str]:
    """Each token id's own text (special tokens included), decoded once per distinct id."""
    ids = {token_id for report in reports for top in report.top_token_ids for token_id in top}
    ids.update(prompt_ids)
    ordered = sorted(ids)
    return dict(zip(ordered, tokenizer.batch_decode([[t] for t in ordered], skip_special_tokens=False)))
