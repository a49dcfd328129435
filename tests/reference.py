"""Greedy references from transformers (and later PEFT), with the near-tie rule: a token
may differ from the reference only where the reference's top-2 logit gap is < 1e-4."""

from __future__ import annotations

from dataclasses import dataclass

import torch

NEAR_TIE = 1e-4


@dataclass
class Reference:
    token_ids: list[int]
    top2_gaps: list[float]  # reference logit gap between its top-2 tokens, per position


@torch.no_grad()
def greedy_reference(
    model, prompt_ids: list[int], num_new_tokens: int, logit_bias: dict[int, float] | None = None
) -> Reference:
    """`model.generate` greedy that does not stop at EOS (like `ignore_eos`), keeping
    each step's logits; `logit_bias` is added to them (transformers' sequence_bias)."""
    input_ids = torch.tensor([prompt_ids])
    model.generation_config.eos_token_id = None
    bias = {(token_id,): value for token_id, value in (logit_bias or {}).items()} or None
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=num_new_tokens,
        do_sample=False,
        output_logits=True,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        sequence_bias=bias,
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    gaps = []
    for logits in out.scores if bias else out.logits:  # [1, vocab] each; scores: after the bias
        top2 = torch.topk(logits[0].float(), 2).values
        gaps.append(float(top2[0] - top2[1]))
    return Reference(tokens, gaps)


def check_greedy(got: list[int], ref: Reference) -> str | None:
    """None when `got` matches; else a message. A divergence is accepted only at a near
    tie, after which the sequences are no longer comparable. Returns 'near-tie ...'
    (accepted) or 'mismatch ...' (failure)."""
    n = min(len(got), len(ref.token_ids))
    if len(got) != len(ref.token_ids):
        return f"mismatch: got {len(got)} tokens, reference {len(ref.token_ids)}"
    for i in range(n):
        if got[i] != ref.token_ids[i]:
            gap = ref.top2_gaps[i]
            kind = "near-tie" if gap < NEAR_TIE else "mismatch"
            return f"{kind} at token {i}: got {got[i]}, reference {ref.token_ids[i]}, top-2 gap {gap:.3g}"
    return None


def assert_greedy_matches(results: dict[str, list[int]], refs: dict[str, Reference]) -> list[str]:
    """Assert every result matches its reference; return the near-tie notes to report."""
    notes, failures = [], []
    for key in sorted(refs):
        msg = check_greedy(results[key], refs[key])
        if msg is None:
            continue
        (notes if msg.startswith("near-tie") else failures).append(f"{key}: {msg}")
    if failures:
        raise AssertionError("greedy parity failed:\n" + "\n".join(failures + notes))
    return notes
