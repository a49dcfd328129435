"""Per-request worker state, its checks, and the placeholder tokens of its steps
(worker_proc/step_inputs.py builds a step's inputs from it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ledgerserve.shared.events import CachedReq, NewReq
from ledgerserve.shared.sampling import SamplingParams


@dataclass
class ReqState:
    """What the worker holds for one request between steps (mirrors the scheduler's view)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs known so far
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    lora_slot: int
    # this step's placeholder: the row of the previous step's sampled tokens that holds the input id
    # of token len(token_ids), not yet known on the host (async scheduling); -1 when none
    placeholder_row: int = -1

    @staticmethod
    def from_new(req: NewReq) -> ReqState:
        return ReqState(
            req.req_id,
            list(req.token_ids),
            req.num_prompt_tokens,
            req.sampling,
            list(req.block_ids),
            req.num_computed_tokens,
            req.num_scheduled_tokens,
            req.lora_slot,
        )

    def apply_delta(self, delta: CachedReq) -> None:
        self.token_ids.extend(delta.new_token_ids)
        self.block_ids.extend(delta.new_block_ids)
        self.num_computed_tokens = delta.num_computed_tokens
        self.num_scheduled_tokens = delta.num_scheduled_tokens
        self.lora_slot = delta.lora_slot
        self.placeholder_row = -1

    @property
    def num_tokens_after_step(self) -> int:
        return self.num_computed_tokens + self.num_scheduled_tokens

    @property
    def num_known_tokens(self) -> int:
        """The tokens this step may compute: those on the host, and a placeholder's pending one."""
        return len(self.token_ids) + (self.placeholder_row >= 0)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens (prefill done, or decode)."""
        return self.num_scheduled_tokens > 0 and self.num_tokens_after_step == self.num_known_tokens

    def step_input_ids(self) -> list[int]:
        """The token ids this step computes; a placeholder's is 0 here, written on the device later."""
        ids = self.token_ids[self.num_computed_tokens : self.num_tokens_after_step]
        return ids + [0] if self.placeholder_row >= 0 else ids


def validate_req(
    req: ReqState, new_block_ids: Sequence[int], block_size: int, num_blocks: int, max_model_len: int
) -> None:
    """Raise ValueError if this request's step can't be run; it fails alone. Block ids are
    range-checked as they arrive (`new_block_ids`), so a step costs O(new blocks), not O(context)."""
    end = req.num_tokens_after_step
    if req.num_computed_tokens < 0 or req.num_scheduled_tokens < 0:
        raise ValueError("negative token counts")
    if not 0 < req.num_prompt_tokens <= len(req.token_ids):
        raise ValueError(f"num_prompt_tokens {req.num_prompt_tokens} out of range for {len(req.token_ids)} tokens")
    if end > req.num_known_tokens:
        raise ValueError(f"scheduled up to token {end} but only {len(req.token_ids)} tokens are known")
    if end > max_model_len:
        raise ValueError(f"{end} tokens exceed max_model_len {max_model_len}")
    if len(req.block_ids) * block_size < end:
        raise ValueError(f"{len(req.block_ids)} blocks can't hold {end} tokens")
    if any(not 0 <= b < num_blocks for b in new_block_ids):
        raise ValueError(f"block id out of range [0, {num_blocks})")


def check_fault(req: ReqState, fault_token_id: int | None) -> None:
    """Test-only fault switch: raise while preparing a request whose prompt holds
    `fault_token_id` (env LEDGERSERVE_TEST_FAULT_TOKEN_ID), so it fails alone."""
    if fault_token_id is not None and fault_token_id in req.token_ids[: req.num_prompt_tokens]:
        raise ValueError(f"test fault: the prompt holds token id {fault_token_id}")


def placeholder_pairs(reqs: Sequence[ReqState], last_token_index: Sequence[int]) -> list[list[int]]:
    """[dst, src]: for each request with a placeholder, the index in the flat batch of its one
    scheduled token (`last_token_index` gives each request's last), and its row in the previous
    step's sampled tokens."""
    pairs = [(i, r.placeholder_row) for r, i in zip(reqs, last_token_index) if r.placeholder_row >= 0]
    return [[dst for dst, _ in pairs], [src for _, src in pairs]]


def fill_placeholders(
    input_ids: torch.Tensor, dst: torch.Tensor, src: torch.Tensor, prev_token_ids: torch.Tensor | None
) -> None:
    """input_ids[dst] = prev_token_ids[src], queued on the device behind the step that sampled them.
    input_ids: [num_tokens] int64; dst, src: [num_placeholders] int64."""
    if prev_token_ids is None:
        raise ValueError("placeholder tokens, but the previous step sampled nothing")
    input_ids.index_copy_(0, dst, prev_token_ids.index_select(0, src))
