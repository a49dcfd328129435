"""Per-request sampling parameters, as they travel from the tokenizer to the workers."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """Validated sampling parameters; the tokenizer process rejects bad values first.

    `temperature == 0` means greedy. `top_k == 0` and `top_p == 1` disable those filters.
    `seed` makes one request's sampling reproducible whatever else shares its batch.
    Stop strings are matched by the tokenizer process (it sees text); stop token ids and
    EOS are matched by the scheduler core (it sees ids).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token + top k
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob and rank + top k
    # (token id, bias) pairs, ids unique and ascending, biases in [-100, 100] and nonzero: added to
    # the logits before penalties, temperature and the filters (vLLM/OpenAI logit_bias)
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """Whether sampling reads the request's earlier tokens (so they must be known on the host)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
