"""Torch reference for kernels/embedding.py (CPU and CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def vocab_embedding_ref(
    ids: torch.Tensor,  # [num_tokens] int64: token ids of the whole vocabulary
    weight: torch.Tensor,  # [num_rows, hidden]: the table's rows first_row .. first_row + num_rows - 1
    first_row: int,
) -> torch.Tensor:  # [num_tokens, hidden]
    """Each token's row of the table where this shard holds it, zeros where another does."""
    local = ids - first_row  # [num_tokens]
    held = (local >= 0) & (local < weight.shape[0])
    rows = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)  # [num_tokens, hidden]
    return rows * held.unsqueeze(1).to(rows.dtype)
