"""An adapter's safetensors file: its header read within limits and checked entry by entry,
and its bytes scanned once (into the content digest, its tensors' values checked to be
finite, and to stay finite in the model's dtype), all without safetensors' own parser.

The header may be at most `max_tensors` entries of a generous size each, plus slack: an
adapter for a given base model can only hold so many tensors. Every entry must be a known
float dtype, a shape of non-negative ints and offsets that tile the data section exactly
(as the safetensors library itself demands), so whatever passes here loads there.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from ledgerserve.shared.adapter_files import read_at
from ledgerserve.shared.adapter_types import WEIGHTS_FILE, AdapterError
from ledgerserve.shared.bounded_json import JsonError, loads, show

DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
_EXPONENT_BITS = {
    "F64": ("<u8", 0x7FF0000000000000),
    "F32": ("<u4", 0x7F800000),
    "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80),
}  # all set: inf or NaN
_FLOATS = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}
# the largest magnitude of a finite value once cast to float32, rounded up (F64's may overflow it)
DTYPE_MAX = {"F64": math.inf, "F32": 3.41e38, "F16": 65504.0, "BF16": 3.39e38}
# model dtype -> the smallest magnitude that a float32 rounds to infinity in (halfway past its largest value)
OVERFLOW = {"float32": math.inf, "bfloat16": float.fromhex("0x1.ffp127"), "float16": 65520.0}
NOT_FINITE = "NaN or infinite values"
_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}
HEADER_BYTES_PER_TENSOR = 512
HEADER_SLACK_BYTES = 64 * 1024  # __metadata__, padding
HEADER_MEMBERS_PER_TENSOR = 4  # the key and its three fields
HEADER_SLACK_MEMBERS = 1024
MAX_DIMS = 8
MAX_DIM_SIZE = 1 << 40
SCAN_CHUNK_BYTES = 1 << 22


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    start: int  # byte offsets inside the data section
    stop: int


@dataclass(frozen=True)
class Header:
    tensors: dict[str, TensorEntry]
    data_offset: int  # where the data section starts in the file
    raw: bytes = b""  # the file's first data_offset bytes as read and parsed: what the content digest takes


def read_header(fd: int, file_size: int, max_tensors: int) -> Header:
    """The checked header of the safetensors file open at `fd`."""
    max_bytes = max_tensors * HEADER_BYTES_PER_TENSOR + HEADER_SLACK_BYTES
    (header_len,) = struct.unpack("<Q", read_at(fd, 0, 8, WEIGHTS_FILE))
    if header_len > file_size - 8:
        raise AdapterError(f"{WEIGHTS_FILE} is truncated or malformed (bad header length).")
    if header_len > max_bytes:
        raise AdapterError(
            f"{WEIGHTS_FILE} has a {header_len}-byte header; an adapter of this base model needs at most {max_bytes}."
        )
    text = read_at(fd, 8, header_len, WEIGHTS_FILE)
    try:
        raw = loads(text, max_tensors * HEADER_MEMBERS_PER_TENSOR + HEADER_SLACK_MEMBERS)
    except JsonError as e:
        raise AdapterError(f"{WEIGHTS_FILE} has a malformed header: it {e.message}.") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{WEIGHTS_FILE} has a malformed header: not a JSON object.")
    _check_metadata(raw.pop("__metadata__", None))
    if len(raw) > max_tensors:
        raise AdapterError(
            f"{WEIGHTS_FILE} holds {len(raw)} tensors; an adapter of this base model has at most {max_tensors}."
        )
    tensors = {key: _entry(key, value) for key, value in raw.items()}
    _check_layout(tensors, file_size - 8 - header_len)
    return Header(tensors, 8 + header_len, struct.pack("<Q", header_len) + text)


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise AdapterError(f"{WEIGHTS_FILE}: __metadata__ must map names to strings.")


def _entry(key: str, value: Any) -> TensorEntry:
    """One header entry, type- and range-checked."""
    where = f"{WEIGHTS_FILE}: tensor {show(key)}"
    if not isinstance(value, dict) or set(value) != _ENTRY_FIELDS:
        raise AdapterError(f"{where} has a malformed entry (it needs exactly dtype, shape and data_offsets).")
    dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise AdapterError(f"{where} has an unsupported dtype {show(dtype)} (supported: {', '.join(DTYPE_BYTES)}).")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d, 0, MAX_DIM_SIZE) for d in shape):
        raise AdapterError(
            f"{where} has a malformed shape {show(shape)} (a list of at most {MAX_DIMS} non-negative integers)."
        )
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o, 0, None) for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise AdapterError(f"{where} has malformed data_offsets {show(offsets)} (two integers, 0 <= start <= stop).")
    if offsets[1] - offsets[0] != DTYPE_BYTES[dtype] * math.prod(shape):
        raise AdapterError(f"{where} has inconsistent offsets for its shape and dtype.")
    return TensorEntry(dtype, tuple(shape), offsets[0], offsets[1])


def _is_int(value: Any, low: int, high: int | None) -> bool:
    return type(value) is int and low <= value and (high is None or value <= high)


def _check_layout(tensors: dict[str, TensorEntry], data_bytes: int) -> None:
    """The tensors must tile the data section: no gap, no overlap, nothing after the last."""
    end = 0
    for key, entry in sorted(tensors.items(), key=lambda item: (item[1].start, item[1].stop, item[0])):
        if entry.start != end:
            raise AdapterError(
                f"{WEIGHTS_FILE}: tensor {show(key)} has offsets that overlap another tensor or leave a gap."
            )
        end = entry.stop
    if end > data_bytes:
        raise AdapterError(
            f"{WEIGHTS_FILE} is truncated: its header needs {end} data bytes, the file has {data_bytes}."
        )
    if end < data_bytes:
        raise AdapterError(f"{WEIGHTS_FILE} has {data_bytes - end} bytes after its last tensor.")


def scan(
    fd: int, header: Header, feed: Callable[[bytes], None], checked_keys: Collection[str], model_dtype: str = "float32"
) -> dict[str, str]:
    """Read the whole file once, front to back, in chunks: every byte goes to `feed` (the
    content digest), and the tensors of `checked_keys` are checked to be finite in the model's
    dtype (`value_problem`). Returns those of them that are not, in file order, each with what
    is wrong with it. The header goes to `feed` as it was read and parsed, not read again."""
    feed(header.raw)
    problems = {}
    for key, entry in sorted(header.tensors.items(), key=lambda item: (item[1].start, item[1].stop, item[0])):
        problem = _scan_tensor(fd, header.data_offset, entry, feed, model_dtype if key in checked_keys else "")
        if problem:
            problems[key] = problem
    return problems


def _scan_tensor(fd: int, data_offset: int, entry: TensorEntry, feed: Callable[[bytes], None], model_dtype: str) -> str:
    """Feed one tensor's bytes; what is wrong with its values in `model_dtype` ('' if nothing,
    or when `model_dtype` is '': not checked)."""
    step = SCAN_CHUNK_BYTES - SCAN_CHUNK_BYTES % DTYPE_BYTES[entry.dtype]
    problem = ""
    for start in range(entry.start, entry.stop, step):
        chunk = read_at(fd, data_offset + start, min(step, entry.stop - start), WEIGHTS_FILE)
        feed(chunk)
        if model_dtype and not problem:
            problem = value_problem(chunk, entry.dtype, model_dtype)
    return problem


def value_problem(chunk: bytes | memoryview, dtype: str, model_dtype: str) -> str:
    """What keeps the values in `chunk` (whole values of file dtype `dtype`) from being finite
    once cast to `model_dtype` ('float32', 'bfloat16' or 'float16'), as torch casts them
    (through float32, rounding to nearest): '' if nothing."""
    uint, exponent = _EXPONENT_BITS[dtype]
    bits = np.frombuffer(chunk, dtype=uint)  # [num_values] raw bit patterns
    if np.any((bits & exponent) == exponent):
        return NOT_FINITE
    limit = OVERFLOW[model_dtype]
    if DTYPE_MAX[dtype] < limit:  # every finite value of the file dtype fits
        return ""
    if dtype == "BF16":
        values = (bits.astype(np.uint32) << 16).view(np.float32)
    else:
        with np.errstate(over="ignore"):  # F64 past float32's range: inf, caught below
            values = np.frombuffer(chunk, dtype=_FLOATS[dtype]).astype(np.float32)
    if not np.all(np.abs(values) < limit):
        return f"values that become infinite in the model's dtype ({model_dtype})"
    return ""
