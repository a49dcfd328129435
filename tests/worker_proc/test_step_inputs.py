"""CUDA: PinnedStaging packs int lists into its pinned buffer and copies them to the device,
as views (upload) or into a given tensor (upload_into, with extra lists as views), and a step
reusing the buffer never overwrites what a queued copy is still reading."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.worker_proc.pinned_staging import PinnedStaging

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_upload_splits_one_copy_into_views() -> None:
    staging = PinnedStaging(torch.device("cuda"))
    parts = [[1, 2, 3], [], [-4, 2**40]]
    got = staging.upload(parts)
    assert [t.tolist() for t in got] == parts and all(t.is_cuda and t.dtype == torch.long for t in got)
    assert all(t.data_ptr() % 16 == 0 for t in got)  # odd-length parts: Triton sees one alignment


def test_upload_into_reuses_the_buffer_behind_a_slow_stream() -> None:
    staging = PinnedStaging(torch.device("cuda"))
    dsts = [torch.zeros(6, dtype=torch.long, device="cuda") for _ in range(3)]
    for i, dst in enumerate(dsts):
        torch.cuda._sleep(20_000_000)  # the copy queues behind a busy stream; the next pack must wait for it
        staging.upload_into(dst, [[i, i + 1], [i * 10] * 4])
    assert [d.tolist() for d in dsts] == [[i, i + 1] + [i * 10] * 4 for i in range(3)]
    with pytest.raises(AssertionError):
        staging.upload_into(dsts[0], [[1, 2]])  # sizes must match


def test_upload_into_returns_the_extra_lists_as_views() -> None:
    staging = PinnedStaging(torch.device("cuda"))
    dst = torch.zeros(3, dtype=torch.long, device="cuda")
    dst_rows, src_rows = staging.upload_into(dst, [[7], [8, 9]], [[0, 2, 4], [5, 6, 1]])
    assert dst.tolist() == [7, 8, 9] and dst_rows.tolist() == [0, 2, 4] and src_rows.tolist() == [5, 6, 1]
    assert dst_rows.data_ptr() % 16 == 0 and src_rows.data_ptr() % 16 == 0
    assert dst_rows.is_cuda and staging.upload_into(dst, [[1, 2, 3]]) == []
