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


def entries_from_json(body: list, prompt_ids: list[int], k: int) -> list[Entry | None]:
    """vLLM's JSON prompt logprobs as Entry: the prompt token's logprob and rank, and the top k (the
    prompt token is among them when its rank is within k: the top k overwrite its entry there)."""
    out: list[Entry | None] = [body[0]]  # None, as check_entries asserts
    for p, entry in enumerate(body[1:], start=1):
        token = str(prompt_ids[p])
        top = {int(t): v["logprob"] for t, v in entry.items() if t != token or v["rank"] <= k}
        out.append(Entry(entry[token]["logprob"], entry[token]["rank"], top))
    return out


def assert_same_json(got: list, want: list, atol: float = 1e-5) -> None:
    """Two JSON prompt logprobs of one prompt agree: the same tokens, ranks and text, close logprobs."""
    assert len(got) == len(want) and got[0] is None and want[0] is None
    for p, (a, b) in enumerate(zip(got[1:], want[1:]), start=1):
        assert a.keys() == b.keys(), p
        for t in a:
            assert (a[t]["rank"], a[t]["decoded_token"]) == (b[t]["rank"], b[t]["decoded_token"]), (p, t)
            assert abs(a[t]["logprob"] - b[t]["logprob"]) <= atol, (p, t)
