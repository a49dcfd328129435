"""Start-up progress of the worker's loads (shared/progress.py): a checkpoint load counts every
byte of tensor data its files hold, and logs its start (rank 0) and its end (every rank); an
adapter read from disk counts its weights file and logs its end line with the bytes read."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from ledgerserve.shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE
from ledgerserve.shared.events import AdapterLoadCompleted
from ledgerserve.shared.progress import Progress, format_bytes
from ledgerserve.worker_proc.lora import loader as adapter_loader
from ledgerserve.worker_proc.lora.fences import SlotFences
from ledgerserve.worker_proc.lora.file_image import SlotLayout
from ledgerserve.worker_proc.lora.pinned_pool import PinnedPool
from ledgerserve.worker_proc.lora.reader import ReadSpec
from ledgerserve.worker_proc.lora.slot_copy import SlotCopier, flat_tables, staging_bytes
from ledgerserve.worker_proc.models import loader as weights_loader
from ledgerserve.worker_proc.models.config import load_model_config
from ledgerserve.worker_proc.models.loader import build_model
from tests.model_factory import make_tiny_checkpoint
from tests.worker_proc.lora_files import write_adapter
from tests.worker_proc.lora_setup import ALL_SEVEN
from tests.worker_proc.test_file_image import ODD, _buffers

WEIGHTS_LOGGER = "ledgerserve.worker_proc.models.loader"
ADAPTER_LOGGER = "ledgerserve.worker_proc.lora.loader"


class RecordedProgress(Progress):
    """Progress that keeps every instance, to read their counts after the load."""

    made: list[Progress] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        RecordedProgress.made.append(self)


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[Progress]:
    RecordedProgress.made = []
    monkeypatch.setattr(weights_loader, "Progress", RecordedProgress)
    monkeypatch.setattr(adapter_loader, "Progress", RecordedProgress)
    return RecordedProgress.made


@pytest.fixture(scope="module")
def sharded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, int]:
    """A tiny checkpoint split into two safetensors files, and its bytes of tensor data."""
    path = make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("sharded"))
    single = os.path.join(path, "model.safetensors")
    tensors = load_file(single)
    os.remove(single)
    names = sorted(tensors)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        save_file(
            {n: tensors[n].contiguous() for n in part}, os.path.join(path, f"model-0000{i + 1}-of-00002.safetensors")
        )
    return path, sum(t.numel() * t.element_size() for t in tensors.values())


def _load(path: str, rank: int) -> None:
    cfg = load_model_config(path)
    build_model(cfg, path, "auto", torch.float32, torch.device("cpu"), seed=0, rank=rank)


def test_weights_load_counts_every_tensor_byte_and_logs_start_and_end(
    sharded_checkpoint: tuple[str, int], recorded: list[Progress], caplog: pytest.LogCaptureFixture
) -> None:
    path, num_bytes = sharded_checkpoint
    caplog.set_level(logging.INFO, logger=WEIGHTS_LOGGER)
    _load(path, rank=0)
    [progress] = recorded
    assert progress.total == progress.done == num_bytes
    lines = [r.getMessage() for r in caplog.records if r.name == WEIGHTS_LOGGER]
    assert lines[0] == f"loading weights: {format_bytes(num_bytes)} in 2 files"
    assert lines[-1].startswith(f"loaded weights: {format_bytes(num_bytes)} in ") and lines[-1].endswith("/s")
    assert not progress.owns_line  # no terminal in the tests: never a bar


def test_other_ranks_log_only_the_end_line(
    sharded_checkpoint: tuple[str, int], recorded: list[Progress], caplog: pytest.LogCaptureFixture
) -> None:
    path, num_bytes = sharded_checkpoint
    caplog.set_level(logging.INFO, logger=WEIGHTS_LOGGER)
    _load(path, rank=1)
    lines = [r.getMessage() for r in caplog.records if r.name == WEIGHTS_LOGGER]
    assert len(lines) == 1 and lines[0].startswith(f"loaded weights: {format_bytes(num_bytes)} in ")


def test_a_failed_load_logs_no_end_line(
    sharded_checkpoint: tuple[str, int], tmp_path, recorded: list[Progress], caplog: pytest.LogCaptureFixture
) -> None:
    path, _ = sharded_checkpoint
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(path):
        if not name.startswith("model-00002"):
            os.symlink(os.path.join(path, name), broken / name)  # half the weights
    caplog.set_level(logging.INFO, logger=WEIGHTS_LOGGER)
    with pytest.raises(ValueError, match="lacks weights"):
        _load(str(broken), rank=0)
    assert not any(r.getMessage().startswith("loaded weights:") for r in caplog.records)


def test_adapter_read_from_disk_counts_its_weights_file_and_logs_its_end(
    tmp_path, recorded: list[Progress], caplog: pytest.LogCaptureFixture
) -> None:
    max_rank = 8
    path = write_adapter(str(tmp_path / "odd-adapter"), ODD, r=3, targets=ALL_SEVEN + ["lm_head"], seed=3)
    weights = _buffers(ODD, max_rank)
    ranks, scalings = flat_tables(weights)
    layout = SlotLayout(weights)
    copier = SlotCopier(weights, layout, ranks, scalings, staging_bytes(layout, max_rank), torch.device("cpu"))
    pool = PinnedPool(4 * layout.max_image_bytes(max_rank), 4096, pin=False)
    spec = ReadSpec(ODD, max_rank, (), layout, torch.bfloat16)
    loader = adapter_loader.AdapterLoader(spec, pool, copier, SlotFences(), 0, False, lambda *_: None)
    caplog.set_level(logging.INFO, logger=ADAPTER_LOGGER)
    loader.prefetch(1, path, 0, time.monotonic())
    [reply] = loader.poll()
    assert isinstance(reply, AdapterLoadCompleted) and reply.source_tier == "disk"
    weights_bytes = os.path.getsize(os.path.join(path, WEIGHTS_FILE))
    [progress] = recorded
    assert progress.total == progress.done == weights_bytes
    file_bytes = weights_bytes + os.path.getsize(os.path.join(path, CONFIG_FILE))
    assert reply.num_bytes == file_bytes
    [line] = [r.getMessage() for r in caplog.records if r.name == ADAPTER_LOGGER]
    assert line.startswith(f"loaded adapter odd-adapter ({format_bytes(file_bytes)}) in ") and line.endswith(" s")
    loader.prefetch(1, path, 0, time.monotonic())  # already in the CPU tier: nothing read, nothing logged
    assert len(loader.poll()) == 1 and len(caplog.records) == 1
    loader.close()
