"""The module-name matcher against Python's `re`: generated patterns of the supported language,
realistic PEFT patterns over a Llama model's module names, the known ReDoS patterns (which `re`
itself cannot finish, so their answers are stated), and the constructs that are refused."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ledgerserve.shared.adapter_types import BaseShapes
from ledgerserve.shared.module_pattern import MatchBudget, PatternError, compile_key, compile_target

SETTINGS = settings(max_examples=400, deadline=None, derandomize=True, database=None)
BASE = BaseShapes(num_layers=12, hidden_size=64, intermediate_size=128, q_size=64, kv_size=32, vocab_size=256)
MODULE_NAMES = [name for name, _, _ in BASE.module_names()] + [
    "base_model.model.model.layers.3.mlp.up_proj",
    "model.embed_tokens",
    "model.norm",
    "lm_head.weight",
]


def _budget() -> MatchBudget:
    return MatchBudget(10_000_000)


def _agrees(pattern: str, name: str) -> None:
    budget = _budget()
    assert compile_target(pattern, budget).matches(name) == (re.fullmatch(pattern, name) is not None), (pattern, name)
    key_reference = re.match(rf"(.*\.)?({pattern})$", name) is not None  # PEFT's rank/alpha_pattern rule
    assert compile_key(pattern, budget).matches(name) == key_reference, (pattern, name)


# Patterns of the supported language, built from its pieces.
_ATOMS = [
    "a",
    "b",
    "_",
    "1",
    ".",
    "\\.",
    "\\d",
    "\\D",
    "\\w",
    "\\W",
    "\\s",
    "\\S",
    "\\-",
    "\\|",
    "[ab]",
    "[^a]",
    "[a-c]",
    "[.\\d]",
    "[^.\n]",
    "[]a]",
    "[^]b]",
    "[a-]",
    "[\\w.]",
    "[^\\W_]",
    "}",
    "]",
    "x",
]
_QUANTIFIERS = ["", "", "", "*", "+", "?", "*?", "+?", "??", "{2}", "{0,2}", "{1,}", "{,2}", "{2}?", "{0}"]


def _patterns() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        group = st.tuples(st.sampled_from(["(", "(?:"]), st.lists(inner, min_size=1, max_size=3)).map(
            lambda t: t[0] + "|".join(t[1]) + ")"
        )
        item = st.tuples(st.one_of(st.sampled_from(_ATOMS), group), st.sampled_from(_QUANTIFIERS)).map("".join)
        anchored = st.sampled_from(["^", "$"])
        return st.lists(st.one_of(item, item, item, anchored), min_size=0, max_size=4).map("".join)

    return st.recursive(st.sampled_from(_ATOMS), extend, max_leaves=8)


_NAMES = st.one_of(st.text(alphabet="ab_1x.-| \n]}", max_size=10), st.sampled_from(MODULE_NAMES[:20]))


@SETTINGS
@given(pattern=_patterns(), names=st.lists(_NAMES, min_size=1, max_size=6))
def test_generated_patterns_agree_with_re(pattern: str, names: list[str]) -> None:
    for name in names:
        _agrees(pattern, name)


@SETTINGS
@given(pattern=st.text(alphabet="ab.*+?()[]{}|^$\\-,:=!<>P12dwsSbAZ_\n", max_size=12), name=_NAMES)
def test_any_text_is_refused_or_means_what_re_means(pattern: str, name: str) -> None:
    try:
        compile_target(pattern, _budget())
    except PatternError:
        return
    re.compile(pattern)  # accepted here: `re` must accept it too ...
    _agrees(pattern, name)  # ... and both must mean the same


REALISTIC = [
    r"model.layers.*.self_attn.(q_proj|v_proj)",
    r".*\.(q|k|v|o)_proj",
    r".*(self_attn|mlp)\.(up|down|gate)_proj",
    r"model\.layers\.\d+\.self_attn\.[qkvo]_proj",
    r"^(?:model\.layers\.(?:[0-9]|1[01])\.mlp\.down_proj)$",
    r".*\.layers\.[0-5]\..*proj",
    r"lm_head",
    r"q_proj",
    r"layers.1.mlp.up_proj",
    r"model.layers.1[0-9].*",
    r".*_proj",
    r"(?:.*\.)?v_proj",
    r"[^.]+\.layers\.\d{1,2}\.mlp\..*",
    r"model.layers.(0|3|7).self_attn.k_proj",
    r".*decoder.*(SelfAttention|EncDecAttention).*(q|v)$",
    r"\w+\.\w+\.\d+\.\w+\.\w+",
    "mlp\\.down_proj",
]


@pytest.mark.parametrize("pattern", REALISTIC)
def test_realistic_peft_patterns_agree_with_re(pattern: str) -> None:
    for name in MODULE_NAMES:
        _agrees(pattern, name)


# (pattern, a name it runs against, whether it matches): `re` needs exponential time on these.
REDOS = [
    ("(.|.)*Z", "model.layers.0.self_attn.q_proj" * 2, False),
    ("model.(.|.)*Z", "model." + "x" * 60, False),
    ("(a+)+$", "a" * 60 + "!", False),
    ("(a|aa)*b", "a" * 80, False),
    ("(a*)*b", "a" * 80, False),
    ("(.*a){12}", "a" * 40 + "b", False),
    ("(.*a){12}", "a" * 40, True),
    ("((a|b|ab)*)*c", "ab" * 40 + "c", True),
]


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("pattern", "name", "expected"), REDOS)
def test_redos_patterns_finish_with_the_right_answer(pattern: str, name: str, expected: bool) -> None:
    assert compile_target(pattern, _budget()).matches(name) is expected
    assert compile_key(pattern, _budget()).matches(name) is expected  # `(.*\.)?` adds no match: no dots


@pytest.mark.parametrize(
    ("pattern", "fragment"),
    [
        (r"(a)\1", "backreferences"),
        (r"(?=a)", "lookarounds"),
        (r"(?<!a)b", "lookarounds"),
        (r"(?i)a", "flags"),
        (r"(?P<x>a)", "named"),
        (r"a*+", "possessive"),
        (r"a**", "multiple repeat"),
        (r"a{2}{3}", "multiple repeat"),
        (r"\bq_proj", "\\b"),
        (r"q_proj\Z", "\\Z"),
        (r"\x41", "character escapes"),
        (r"[[a]]", "nested set"),
        (r"[a&&b]", "reserved"),
        (r"[a||b]", "reserved"),
        ("a{", "brace"),
        ("a{1,x}", "brace"),
        ("(a", "unterminated group"),
        ("a)", "unbalanced"),
        ("[a", "unterminated character set"),
        ("[z-a]", "bad character range"),
        (r"[\d-z]", "bad character range"),
        ("*a", "nothing to repeat"),
        ("^*", "nothing to repeat"),
        ("a{2,1}", "min repeat greater"),
        ("a{65}", "bound above 64"),
        ("(" * 33 + ")" * 33, "nested deeper"),
        ("((a{60}){60}){60}", "more than 4096 states"),
        ("a" * 1025, "longer than 1024"),
        ("a\\", "trailing backslash"),
    ],
)
def test_unsupported_constructs_are_refused(pattern: str, fragment: str) -> None:
    with pytest.raises(PatternError, match=re.escape(fragment)):
        compile_target(pattern, _budget())


def test_the_budget_bounds_building_and_matching() -> None:
    with pytest.raises(PatternError, match="more than 1000 matching steps"):
        compile_target("(a|b){0,60}" * 10, MatchBudget(1000))
    budget = MatchBudget(5000)
    pattern = compile_target("(" + "|".join(f"[a-z_.0-9]{{0,{n}}}x" for n in range(2, 40)) + ")*", budget)
    with pytest.raises(PatternError, match="more than 5000 matching steps"):
        for name in MODULE_NAMES:
            pattern.matches(name + "!")
