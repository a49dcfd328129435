"""The reference for prompt logprobs: transformers' log_softmax over one forward of the whole
prompt, and a check of per-position entries against it at fp32 tolerance."""

from __future__ import annotations

from dataclasses import dataclass

import torch

ATOL = 1e-4


@dataclass
class Entry:
    """One prompt position's prompt logprobs, whatever form they came in."""

    logprob: float  # of the prompt token there
    rank: int
    top: dict[int, float]  # the top k tokens' logprobs


@torch.no_grad()
def prompt_logprobs_reference(model, prompt_ids: list[int]) -> torch.Tensor:
    """[num_prompt_tokens - 1, vocab]: row p - 1 is the distribution that scores position p."""
    logits = model(torch.tensor([prompt_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check_entries(ref: torch.Tensor, prompt_ids: list[int], entries: list[Entry | None], k: int) -> None:
    """entries[p] for every prompt position (entries[0] is None) against `ref`. A rank or a top-k
    member may differ from the reference only among tokens within ATOL of each other."""
    assert len(entries) == len(prompt_ids) and entries[0] is None, (len(entries), len(prompt_ids), entries[:1])
    for p in range(1, len(prompt_ids)):
        entry, row = entries[p], ref[p - 1]
        assert entry is not None, f"position {p} has no prompt logprobs"
        want = float(row[prompt_ids[p]])
        assert abs(entry.logprob - want) <= ATOL, (p, entry.logprob, want)
        assert int((row > want + ATOL).sum()) + 1 <= entry.rank <= int((row >= want - ATOL).sum()), (p, entry.rank)
        assert len(entry.top) == k, (p, entry.top)
        got_top = sorted(entry.top.values(), reverse=True)
        assert torch.allclose(torch.tensor(got_top), row.topk(k).values, atol=ATOL, rtol=0), (p, got_top)
        for token_id, value in entry.top.items():
            assert abs(float(row[token_id]) - value) <= ATOL, (p, token_id, value)
