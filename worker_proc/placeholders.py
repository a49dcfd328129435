"""Placeholder tokens, for async scheduling: the scheduler may plan step N+1 before it has
read step N's sampled tokens, and so schedule a request's next decode token while no host
knows its id yet. That is legal only when this worker sampled that very token in the step
it launched just before; the token's id is then taken from that step's sampled tokens on
the device, after the step's inputs are uploaded, so launching never waits on the GPU
(batch.fill_placeholders)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ledgerserve.worker_proc.batch import ReqState


@dataclass(frozen=True)
class SampledRows:
    """One launched step's sampled tokens, still on the device, and which request sampled which."""

    token_ids: torch.Tensor | None = None  # [num_sampling] int64; None when the step sampled nothing
    # req_id -> (its row in token_ids, the index in the request of the token it sampled)
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)

    @staticmethod
    def of(token_ids: torch.Tensor, reqs: Sequence[ReqState]) -> SampledRows:
        """reqs: the step's sampling requests, in the order of token_ids' rows."""
        return SampledRows(token_ids, {r.req_id: (i, r.num_tokens_after_step) for i, r in enumerate(reqs)})


def mark_placeholder(req: ReqState, prev: SampledRows) -> None:
    """Give `req` a placeholder when its step is the one token past the known ones that `prev`
    (the previous launched step) sampled for it. Any other step past the known tokens is left
    as it is, for validate_req to reject. A penalised request can't take a placeholder: its
    penalties need the pending token's id on the host."""
    if req.num_scheduled_tokens != 1 or req.num_computed_tokens != len(req.token_ids):
        return
    row, sampled_index = prev.rows.get(req.req_id, (-1, -1))
    if sampled_index != len(req.token_ids):
        return
    if req.sampling.penalised:
        raise ValueError(
            f"token {len(req.token_ids)} is scheduled before its id is known, but penalties "
            "need it on the host: a penalised request can't be scheduled ahead"
        )
    req.placeholder_row = row
