"""Property tests of the adapter reader: random JSON for every config field, random header
entries and random bytes give a manifest or an AdapterError from one of the reader's own
checks (never another exception, never the catch-all), and any manifest is one that can run."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledgerserve.shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, AdapterError, BaseShapes, read_manifest
from tests.peft_util import make_tiny_peft_adapter
from tests.shared.hostile_adapters import read_weights, write_config, write_weights

MAX_RANK = 16
SETTINGS = settings(
    max_examples=250, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
MODULE_KEYS = st.sampled_from(
    [
        "q_proj",
        "v_proj",
        "k_proj",
        "lm_head",
        "layers.1.self_attn.q_proj",
        ".*_proj",
        "model.layers.0.self_attn.v_proj",
        "(.|.)*Z",
        "(q|v)_proj",
        "[",
        "(?=x)",
        "",
    ]
)
PLAUSIBLE = {
    "r": st.integers(-2, MAX_RANK + 2),
    "lora_alpha": st.integers(-1, 64) | st.floats(allow_nan=True, allow_infinity=True),
    "use_rslora": st.booleans(),
    "target_modules": st.lists(st.sampled_from(["q_proj", "v_proj", "o_proj", "lm_head", "qkv_proj"]), max_size=3)
    | st.sampled_from(["all-linear", ".*\\.(q|v)_proj", "model.(.|.)*Z", "(a)\\1", ""]),
    "rank_pattern": st.dictionaries(MODULE_KEYS, st.integers(-1, MAX_RANK + 1) | JSON, max_size=3),
    "alpha_pattern": st.dictionaries(MODULE_KEYS, st.floats() | st.integers(-1, 64) | JSON, max_size=3),
    "peft_type": st.sampled_from(["LORA", "lora", "IA3"]),
    "bias": st.sampled_from(["none", "none", "none", "all"]),
    "use_dora": st.sampled_from([False, False, False, True]),
    "modules_to_save": st.none() | st.lists(st.text(max_size=5), max_size=2),
    "layers_to_transform": st.none() | st.lists(st.integers(0, 3), max_size=2),
    **{
        field: st.sampled_from([None, False, [], {}]) | JSON
        for field in ("exclude_modules", "lora_bias", "trainable_token_indices", "layer_replication")
    },
}
FIELDS = sorted(PLAUSIBLE)


@pytest.fixture(scope="module")
def good(base_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("good") / "a"
    return Path(make_tiny_peft_adapter(base_dir, out, target_modules=["q_proj", "v_proj"]))


@pytest.fixture(scope="module")
def scratch(good: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(shutil.copytree(good, tmp_path_factory.mktemp("scratch") / "a"))


def _read_or_refuse(path: Path, base: BaseShapes) -> None:
    """A manifest that can run, or a refusal from one of the reader's own checks."""
    try:
        manifest = read_manifest(str(path), base, MAX_RANK, check_weights=True)
    except AdapterError as e:
        assert e.code == 400 and e.message and e.__cause__ is None, (e.message, e.__cause__)
        return
    assert manifest.modules and 1 <= manifest.max_rank <= MAX_RANK
    for m in manifest.modules:
        assert 1 <= m.rank <= MAX_RANK and math.isfinite(m.scaling) and m.scaling > 0, m


def _field_values() -> st.SearchStrategy[dict[str, Any]]:
    value_for = {field: st.one_of(PLAUSIBLE[field], PLAUSIBLE[field], PLAUSIBLE[field], JSON) for field in FIELDS}
    return st.lists(st.sampled_from(FIELDS), max_size=5, unique=True).flatmap(
        lambda fields: st.fixed_dictionaries({f: value_for[f] for f in fields})
    )


@SETTINGS
@given(changes=_field_values())
def test_random_config_fields(changes: dict[str, Any], good: Path, scratch: Path, base: BaseShapes) -> None:
    config = json.loads((good / CONFIG_FILE).read_text())
    write_config(scratch, {**config, **changes})
    _read_or_refuse(scratch, base)


ENTRY = (
    st.fixed_dictionaries(
        {},
        optional={
            "dtype": st.sampled_from(["F32", "BF16", "F16", "F64", "I8", "f32"]) | JSON,
            "shape": st.lists(st.integers(-2, 80), max_size=3) | JSON,
            "data_offsets": st.lists(st.integers(-4, 20_000), min_size=2, max_size=2) | JSON,
            "extra": JSON,
        },
    )
    | JSON
)


@SETTINGS
@given(
    edits=st.lists(st.tuples(st.integers(0, 20) | st.text(max_size=8), ENTRY), min_size=1, max_size=4),
    metadata=st.none() | JSON,
)
def test_random_header_entries(
    edits: list[tuple[int | str, Any]], metadata: Any, good: Path, scratch: Path, base: BaseShapes
) -> None:
    (scratch / CONFIG_FILE).write_bytes((good / CONFIG_FILE).read_bytes())
    header, body = read_weights(good)
    keys = sorted(k for k in header if k != "__metadata__")
    for where, entry in edits:  # an int: change (fields of) an existing entry; a str: a new key
        key = keys[where % len(keys)] if isinstance(where, int) else where
        if isinstance(entry, dict) and isinstance(header.get(key), dict):
            header[key].update(entry)
        else:
            header[key] = entry
    header["__metadata__"] = metadata
    write_weights(scratch, header, body)
    _read_or_refuse(scratch, base)


@SETTINGS
@given(config=st.binary(max_size=64), header=st.binary(max_size=64), header_len=st.integers(0, 2**64 - 1) | st.none())
def test_random_bytes(
    config: bytes, header: bytes, header_len: int | None, good: Path, scratch: Path, base: BaseShapes
) -> None:
    (scratch / CONFIG_FILE).write_bytes(config)
    _read_or_refuse(scratch, base)
    (scratch / CONFIG_FILE).write_bytes((good / CONFIG_FILE).read_bytes())
    _, body = read_weights(good)
    prefix = b"" if header_len is None else header_len.to_bytes(8, "little")
    (scratch / WEIGHTS_FILE).write_bytes(prefix + header + body[: len(header)])
    _read_or_refuse(scratch, base)
