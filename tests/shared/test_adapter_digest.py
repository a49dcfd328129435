"""The content digest `read_manifest` takes while it checks the weights: SHA-256 of the config's
bytes then the weights file's bytes (all 256 bits), from the one pass that also checks the values
finite, hashing each byte as it was read and parsed: nothing, the header included, is read twice."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ledgerserve.shared import safetensors_header
from ledgerserve.shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, AdapterError, BaseShapes, read_manifest
from tests.peft_util import make_tiny_peft_adapter

MAX_RANK = 16


@pytest.fixture(scope="module")
def good(base_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("good") / "a"
    return Path(make_tiny_peft_adapter(base_dir, out, target_modules=["q_proj", "v_proj", "down_proj"]))


@pytest.fixture
def copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "copy"))


def _files_sha256(path: Path) -> str:
    """The independent reference: hashlib's SHA-256 over the two files' bytes, concatenated."""
    return hashlib.sha256((path / CONFIG_FILE).read_bytes() + (path / WEIGHTS_FILE).read_bytes()).hexdigest()


def _digest(path: Path, base: BaseShapes, check_weights: bool = True) -> str:
    return read_manifest(str(path), base, MAX_RANK, check_weights=check_weights).content_sha256


def test_digest_is_sha256_of_the_config_then_the_weights(
    good: Path, base: BaseShapes, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _files_sha256(good)
    assert _digest(good, base) == expected and len(expected) == 64
    monkeypatch.setattr(safetensors_header, "SCAN_CHUNK_BYTES", 24)  # chunking does not change the bytes fed
    assert _digest(good, base) == expected


def test_digest_changes_when_either_file_changes(copy: Path, base: BaseShapes) -> None:
    before = _digest(copy, base)
    config = json.loads((copy / CONFIG_FILE).read_text())
    (copy / CONFIG_FILE).write_text(json.dumps(config, indent=1))  # the same settings, other bytes
    after_config = _digest(copy, base)
    assert after_config != before and after_config == _files_sha256(copy)

    tensors = load_file(str(copy / WEIGHTS_FILE))
    key = sorted(tensors)[0]
    tensors[key].view(-1)[0] += 1.0  # one finite value
    save_file(tensors, str(copy / WEIGHTS_FILE))
    after_weights = _digest(copy, base)
    assert after_weights not in (before, after_config) and after_weights == _files_sha256(copy)


def test_identical_files_elsewhere_have_the_same_digest(good: Path, copy: Path, base: BaseShapes) -> None:
    assert _digest(copy, base) == _digest(good, base)  # what the version is, not where it lies


def test_no_digest_without_the_weight_check(good: Path, base: BaseShapes) -> None:
    assert _digest(good, base, check_weights=False) == ""


def test_weights_are_read_once(good: Path, base: BaseShapes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Validation and the digest share one pass: every byte is read exactly once, the header too
    (the digest takes the bytes that were parsed, not a second read that could differ)."""
    reads: list[tuple[int, int]] = []
    real_read_at = safetensors_header.read_at

    def counting(fd: int, offset: int, num_bytes: int, name: str) -> bytes:
        reads.append((offset, num_bytes))
        return real_read_at(fd, offset, num_bytes, name)

    monkeypatch.setattr(safetensors_header, "read_at", counting)
    _digest(good, base)
    size = os.path.getsize(good / WEIGHTS_FILE)
    header_bytes = 8 + int.from_bytes((good / WEIGHTS_FILE).read_bytes()[:8], "little")
    data = sorted((offset, n) for offset, n in reads if offset >= header_bytes)
    assert sum(n for _, n in data) == size - header_bytes
    assert all(a + n == b for (a, n), (b, _) in zip(data, data[1:]))  # front to back, no byte twice
    assert sum(n for _, n in reads) == size


def test_a_non_finite_tensor_is_still_named(copy: Path, base: BaseShapes) -> None:
    tensors = load_file(str(copy / WEIGHTS_FILE))
    key = sorted(tensors)[-1]
    tensors[key].view(-1)[-1] = torch.inf
    save_file(tensors, str(copy / WEIGHTS_FILE))
    with pytest.raises(AdapterError, match="holds NaN or infinite values") as info:
        read_manifest(str(copy), base, MAX_RANK, check_weights=True)
    assert key in info.value.message
