"""read_manifest against hostile adapters: every finding of the security probe is refused with a
400 naming what was wrong, never another exception; good adapters still read as PEFT means them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ledgerserve.shared import adapter_files, adapter_format, safetensors_header
from ledgerserve.shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, AdapterError, BaseShapes, read_manifest
from ledgerserve.shared.safetensors_header import read_header
from tests.peft_util import make_tiny_peft_adapter
from tests.shared.hostile_adapters import HOSTILE, edit_config, poison_weights, read_weights, write_weights

MAX_RANK = 16


@pytest.fixture(scope="module")
def good(base_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("good") / "a"
    return Path(make_tiny_peft_adapter(base_dir, out, target_modules=["q_proj", "v_proj"]))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root").mkdir()
    (tmp_path / "outside").mkdir()
    return tmp_path / "root"


@pytest.fixture
def copy(good: Path, root: Path) -> Path:
    return Path(shutil.copytree(good, root / "copy"))


def _read(path: Path, base: BaseShapes, roots: tuple[Path, ...] = (), check_weights: bool = True):
    return read_manifest(str(path), base, MAX_RANK, tuple(str(r) for r in roots), check_weights=check_weights)


def _refused(path: Path, base: BaseShapes, fragment: str, roots: tuple[Path, ...] = ()) -> AdapterError:
    with pytest.raises(AdapterError) as info:
        _read(path, base, roots)
    assert info.value.code == 400
    assert fragment in info.value.message, info.value.message
    assert info.value.__cause__ is None, "refused by the catch-all, not by a check"
    return info.value


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_adapter_is_refused(name: str, copy: Path, root: Path, base: BaseShapes) -> None:
    build, fragment = HOSTILE[name]
    build(copy, root.parent / "outside")
    error = _refused(copy, base, fragment, roots=(root,))
    assert str(root.parent / "outside") not in error.message  # a link's target is never revealed


@pytest.mark.timeout(30)
def test_redos_keys_finish_and_match_as_peft(base_dir: str, root: Path, base: BaseShapes) -> None:
    path = Path(
        make_tiny_peft_adapter(
            base_dir,
            root / "p",
            target_modules=["q_proj", "v_proj"],
            rank_pattern={"q_proj": 2},
            alpha_pattern={"v_proj": 32},
        )
    )
    plain = _read(path, base)
    edit_config(
        path,
        rank_pattern={"(.|.)*Z": 9, "(.|.)*q_proj": 2},  # the same meaning, the ReDoS shape
        alpha_pattern={"(.|.)*Z+" + "a" * 40: 9.0, "(.|.)*v_proj": 32},
    )
    assert _read(path, base).modules == plain.modules
    assert {m.name: m.rank for m in plain.modules} == {
        n: 2 if n.endswith("q_proj") else 4 for n in (m.name for m in plain.modules)
    }


def test_links_inside_the_roots_are_followed(copy: Path, root: Path, base: BaseShapes) -> None:
    blobs = root / "blobs"  # a Hugging Face cache: snapshot files link into ../../blobs
    blobs.mkdir()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        os.replace(copy / name, blobs / name)
        (copy / name).symlink_to(Path("..") / "blobs" / name)
    manifest = _read(copy, base, roots=(root,))
    assert manifest.weights_path == str(blobs / WEIGHTS_FILE)
    assert len(manifest.modules) == 2 * base.num_layers


def test_trusted_adapters_outside_the_roots_may_link_anywhere(good: Path, root: Path, base: BaseShapes) -> None:
    trusted = Path(shutil.copytree(good, root.parent / "outside" / "trusted"))
    elsewhere = root.parent / "elsewhere"
    elsewhere.mkdir()
    os.replace(trusted / WEIGHTS_FILE, elsewhere / WEIGHTS_FILE)
    (trusted / WEIGHTS_FILE).symlink_to(elsewhere / WEIGHTS_FILE)
    assert _read(trusted, base, roots=(root,)).weights_path == str(elsewhere / WEIGHTS_FILE)


def test_a_dangling_link_reads_as_a_missing_file(copy: Path, root: Path, base: BaseShapes) -> None:
    (copy / CONFIG_FILE).unlink()
    (copy / CONFIG_FILE).symlink_to(root / "nowhere.json")
    _refused(copy, base, f"The adapter has no {CONFIG_FILE}", roots=(root,))


def test_non_finite_weights_pass_without_the_weight_check(copy: Path, base: BaseShapes) -> None:
    poison_weights(float("nan"), torch.float32)(copy, copy)
    assert _read(copy, base, check_weights=False).max_rank == 4  # the worker reads the tensors and checks them


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_finite_check_agrees_with_torch(
    dtype: torch.dtype, copy: Path, base: BaseShapes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(safetensors_header, "SCAN_CHUNK_BYTES", 24)  # many chunks per tensor
    tensors = {k: v.to(dtype) for k, v in load_file(str(copy / WEIGHTS_FILE)).items()}
    gen = torch.Generator().manual_seed(0)
    specials = [float("nan"), float("inf"), float("-inf"), 1e30, -0.0, 6e-8]
    for i, key in enumerate(sorted(tensors)):
        flat = tensors[key].view(-1)
        flat[torch.randint(0, flat.numel(), (1,), generator=gen)] = specials[i % len(specials)]
    save_file(tensors, str(copy / WEIGHTS_FILE))
    fd = os.open(copy / WEIGHTS_FILE, os.O_RDONLY)
    try:
        header = read_header(fd, os.fstat(fd).st_size, 64)
        bad = safetensors_header.scan(fd, header, lambda chunk: None, set(tensors))
        ours = {key: key not in bad for key in tensors}
    finally:
        os.close(fd)
    assert ours == {key: bool(torch.isfinite(t).all()) for key, t in tensors.items()}
    assert set(ours.values()) == {True, False}


FLOAT32_MAX = float(torch.finfo(torch.float32).max)
EDGES = [
    65504.0,
    65519.99,
    65520.0,
    -65520.0,
    1e5,
    float.fromhex("0x1.fep127"),
    float.fromhex("0x1.feffffp127"),
    float.fromhex("0x1.ffp127"),
    -3.39e38,
    FLOAT32_MAX,
    float.fromhex("0x1.fffffff0p127"),
    1e39,
    1e-40,
    0.0,
]


@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("file_dtype", ["F64", "F32", "BF16", "F16"])
def test_value_range_check_agrees_with_the_cast_torch_does(file_dtype: str, model_dtype: str) -> None:
    """A value passes iff torch's cast of it (file dtype -> model dtype) is finite, at each edge
    of each dtype's range (rounding to nearest, through float32 for F64)."""
    dtype = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[file_dtype]
    for value in EDGES:
        for sign in (1.0, -1.0):
            stored = torch.tensor([0.5, sign * value, 0.25], dtype=torch.float64).to(dtype)  # [3]
            if not bool(torch.isfinite(stored).all()):
                continue  # not a finite value of the file dtype: the exponent check's case
            chunk = stored.view(torch.uint8).numpy().tobytes()
            ok = safetensors_header.value_problem(chunk, file_dtype, model_dtype) == ""
            assert ok == bool(torch.isfinite(stored.to(getattr(torch, model_dtype))).all()), (value, sign)


def test_weights_past_the_model_dtype_are_refused_at_registration(copy: Path, base: BaseShapes) -> None:
    poison_weights(1e5, torch.float32)(copy, copy)  # finite in float32 and bfloat16, infinite in float16
    for model_dtype in ("float32", "bfloat16"):
        assert read_manifest(str(copy), base, MAX_RANK, check_weights=True, model_dtype=model_dtype).content_sha256
    with pytest.raises(AdapterError, match=r"values that become infinite in the model's dtype \(float16\)") as info:
        read_manifest(str(copy), base, MAX_RANK, check_weights=True, model_dtype="float16")
    assert info.value.code == 400 and "lora_A" in info.value.message


def test_trailing_bytes_and_gaps_are_refused(copy: Path, base: BaseShapes) -> None:
    header, body = read_weights(copy)
    write_weights(copy, header, body + b"\0" * 8)
    _refused(copy, base, "8 bytes after its last tensor")
    key = sorted(k for k in header if k != "__metadata__")[-1]
    start, stop = header[key]["data_offsets"]
    header[key]["data_offsets"] = [start + 4, stop + 4]
    write_weights(copy, header, body + b"\0" * 4)
    _refused(copy, base, "leave a gap")


def test_unforeseen_failures_become_a_400_with_their_cause(
    copy: Path, base: BaseShapes, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> None:
        raise KeyError("a check this reader lacks")

    monkeypatch.setattr(adapter_format, "_check_tensors", broken)
    with pytest.raises(AdapterError, match="malformed \\(KeyError\\)") as info:
        _read(copy, base)
    assert info.value.code == 400 and isinstance(info.value.__cause__, KeyError)


def test_a_nul_byte_in_the_path_is_a_refusal(base: BaseShapes) -> None:
    _refused(Path("/tmp/a\0b"), base, "NUL")


def test_a_directory_swapped_for_a_link_while_opening_is_refused(
    copy: Path, root: Path, base: BaseShapes, monkeypatch: pytest.MonkeyPatch
) -> None:
    outside = Path(shutil.copytree(copy, root.parent / "outside" / "copy"))
    real_open = os.open

    def racing_open(path: str, flags: int, *args: int) -> int:  # the race: checked, then swapped, then opened
        if Path(path).parent == copy and not copy.is_symlink():
            os.replace(copy, root / "moved")
            copy.symlink_to(outside)
        return real_open(path, flags, *args)

    monkeypatch.setattr(adapter_files.os, "open", racing_open)
    error = _refused(copy, base, "changed while it was being opened", roots=(root,))
    assert str(outside) not in error.message
