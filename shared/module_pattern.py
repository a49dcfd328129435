"""Module-name patterns of PEFT adapter configs, with PEFT's meaning and without `re`.

PEFT runs the config's regexes with Python's backtracking `re`, which a hostile pattern
(`(.|.)*Z`) keeps busy for minutes while holding the GIL. These patterns are parsed into a
restricted language (`shared.pattern_syntax`) and matched by an NFA simulation
(`shared.pattern_nfa`) paid from a step budget, so matching is linear and bounded:

- `target_modules` as a string: `re.fullmatch(pattern, module_name)`;
- a `rank_pattern` / `alpha_pattern` key: `re.match(rf"(.*\\.)?({key})$", module_name)`.

Configs converted from AdaLoRA list one key per module, hundreds of them, so keys are fast:
a key of only literal characters and `.` (`model.layers.3.mlp.up_proj`) is compared in place
at the end of the name; any other key is matched from the end of the name backwards
(`(.*\\.)?(KEY)$` reversed is KEY reversed, then the start of the name or a dot), so a name
that does not end like the key is given up after a few characters.
"""

from __future__ import annotations

from ledgerserve.shared.pattern_nfa import MatchBudget, Nfa, Simulation
from ledgerserve.shared.pattern_syntax import (
    DOT,
    Alt,
    Anchor,
    Chars,
    CharSet,
    Concat,
    Node,
    PatternError,
    Repeat,
    parse,
)

__all__ = ["MatchBudget", "ModulePattern", "PatternError", "compile_key", "compile_target"]

_DOT_LITERAL = Chars(CharSet(ranges=((ord("."), ord(".")),)))
_ANY_PARENT = Repeat(Concat((Repeat(Chars(DOT), 0, None), _DOT_LITERAL)), 0, 1)  # (.*\.)?
_FLIP = {"^": "$", "$": "^"}


class ModulePattern:
    """One compiled pattern; `matches` spends from the budget it was compiled with."""

    def __init__(self, text: str, node: Node, as_key: bool, budget: MatchBudget) -> None:
        self.text = text
        self.node = node
        self.as_key = as_key
        self.budget = budget
        self._fixed = _fixed_chunks(node) if as_key else None
        self._backward: Simulation | None = None
        if as_key and self._fixed is None:
            self._backward = Simulation(Nfa(_key_backward(node), budget))
        self._forward = None if as_key else Simulation(Nfa(node, budget))

    def matches(self, name: str) -> bool:
        if "\n" not in name:  # a key's `$` is the end of the name (no final newline)
            if self._fixed is not None:
                self.budget.spend(1)
                return _ends_with(name, *self._fixed)
            if self._backward is not None:
                return self._backward.run(name[::-1], prefix=True)
        if self._forward is None:  # a key on a name with a newline: PEFT's regex, read forwards
            self._forward = Simulation(Nfa(Concat((_ANY_PARENT, self.node, Anchor("$"))), self.budget))
        return self._forward.run(name, prefix=self.as_key)


def compile_target(text: str, budget: MatchBudget) -> ModulePattern:
    """`target_modules` given as a string: matches a name as `re.fullmatch(text, name)` does."""
    budget.spend(len(text))
    return ModulePattern(text, parse(text), as_key=False, budget=budget)


def compile_key(text: str, budget: MatchBudget) -> ModulePattern:
    """A `rank_pattern` / `alpha_pattern` key: matches a name as PEFT's
    `re.match(rf"(.*\\.)?({text})$", name)` does."""
    budget.spend(len(text))
    return ModulePattern(text, parse(text), as_key=True, budget=budget)


def _fixed_chunks(node: Node) -> tuple[int, tuple[tuple[int, str], ...]] | None:
    """(length, [(offset, literal run)]) of a key made of literal characters and `.` only; None
    for any other key."""
    items = node.items if isinstance(node, Concat) else (node,)
    chunks: list[tuple[int, str]] = []
    for offset, item in enumerate(items):
        if not isinstance(item, Chars):
            return None
        if item.chars == DOT:
            continue
        chars = item.chars
        if len(chars.ranges) != 1 or chars.ranges[0][0] != chars.ranges[0][1] or chars.categories or chars.negate:
            return None
        ch = chr(chars.ranges[0][0])
        if chunks and chunks[-1][0] + len(chunks[-1][1]) == offset:  # extends the run before it
            chunks[-1] = (chunks[-1][0], chunks[-1][1] + ch)
        else:
            chunks.append((offset, ch))
    return len(items), tuple(chunks)


def _ends_with(name: str, length: int, chunks: tuple[tuple[int, str], ...]) -> bool:
    """`(.*\\.)?(KEY)$` for a fixed KEY of `length` (literal runs at their offsets, `.` between)
    on a name without newlines: the name ends with KEY, which starts the name or follows a dot."""
    start = len(name) - length
    if start < 0 or (start > 0 and name[start - 1] != "."):
        return False
    return all(name.startswith(run, start + offset) for offset, run in chunks)


def _key_backward(node: Node) -> Node:
    """`(.*\\.)?(node)$` read from the end of a name without newlines, as a prefix match: the
    reversed key, then the start of the name (`$` once reversed: the end) or a dot."""
    return Concat((Anchor("^"), _reversed(node), Alt((Anchor("$"), _DOT_LITERAL))))


def _reversed(node: Node) -> Node:
    """The pattern that matches the reversed strings; `^` and `$` swap (strict ends: no newline)."""
    if isinstance(node, Concat):
        return Concat(tuple(_reversed(item) for item in reversed(node.items)))
    if isinstance(node, Alt):
        return Alt(tuple(_reversed(option) for option in node.options))
    if isinstance(node, Repeat):
        return Repeat(_reversed(node.item), node.min, node.max)
    if isinstance(node, Anchor):
        return Anchor(_FLIP[node.kind])
    return node
