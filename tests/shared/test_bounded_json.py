"""The bounded JSON reader against `json` itself and against depth and member counts computed
from the decoded value: the same values within the limits, a JsonError past them."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledgerserve.shared.bounded_json import MAX_DEPTH, JsonError, loads

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True, database=None)
TEXT = st.text(alphabet=st.sampled_from('ab"\\/:,[]{} \n\u00e9\u2028'), max_size=8)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(TEXT, children, max_size=3),
    max_leaves=10,
)


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


def _members(value: Any) -> int:
    if isinstance(value, dict):
        return len(value) + sum(map(_members, value.values()))
    if isinstance(value, list):
        return sum(map(_members, value))
    return 0


@SETTINGS
@given(value=VALUES, num_wraps=st.integers(0, MAX_DEPTH + 3), in_object=st.booleans(), ascii_only=st.booleans())
def test_limits_agree_with_the_decoded_value(value: Any, num_wraps: int, in_object: bool, ascii_only: bool) -> None:
    for _ in range(num_wraps):
        value = {"k:[": value} if in_object else [value]
    data = json.dumps(value, ensure_ascii=ascii_only).encode()
    if _depth(value) > MAX_DEPTH:
        with pytest.raises(JsonError, match="nests deeper"):
            loads(data, 10**9)
        return
    assert loads(data, _members(value)) == value
    if _members(value) > 0:
        with pytest.raises(JsonError, match="object members"):
            loads(data, _members(value) - 1)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b'{"a": 1, "a": 2}', "repeats the key 'a'"),
        (b"[NaN]", "holds NaN"),
        (b"[-Infinity]", "holds -Infinity"),
        (b'["\\"]', "unterminated string"),
        (b"[1,]", "not valid JSON"),
        (b'"\xc3"', "not UTF-8"),
        (b"[" + b"9" * 5000 + b"]", "not valid JSON"),
        (b"[" * 33 + b"]" * 33, "nests deeper than 32"),
    ],
)
def test_malformed_json_is_a_json_error(data: bytes, fragment: str) -> None:
    with pytest.raises(JsonError, match=fragment.replace("[", "\\[")):
        loads(data, 100)
