"""GPU: the vocabulary-parallel embedding lookup (kernels/embedding.py) against its torch reference,
and the shards' lookups summed against the whole table's."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels.embedding_ref import vocab_embedding_ref
from tests.kernels.triton_device import DEVICE, DTYPES, requires_triton_device

pytest.importorskip("triton")

from ledgerserve.kernels import embedding  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_triton_device]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1000, 4096])
def test_each_shard_copies_its_rows_and_zeros_the_rest(dtype: torch.dtype, hidden: int) -> None:
    vocab, num_shards = 50, 2
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, hidden, generator=gen).to(DEVICE, dtype)
    wide = torch.randn(vocab // num_shards, hidden + 8, generator=gen).to(DEVICE, dtype)  # strided rows
    ids = torch.tensor([0, 24, 25, 49, 3, 3, 30], device=DEVICE)
    total = torch.zeros(len(ids), hidden, dtype=dtype, device=DEVICE)
    for shard in range(num_shards):
        first = shard * vocab // num_shards
        weight = wide[:, :hidden]
        weight.copy_(table[first : first + vocab // num_shards])
        got = embedding.vocab_embedding(ids, weight, first)
        assert torch.equal(got, vocab_embedding_ref(ids, weight, first))
        total += got
    assert torch.equal(total, table[ids])
    assert embedding.vocab_embedding(ids[:0], weight, 0).shape == (0, hidden)
