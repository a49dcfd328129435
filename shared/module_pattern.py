"""Module-name patterns of PEFT adapter configs, with PEFT's meaning and without `re`.

PEFT runs the config's regexes with Python's backtracking `re`, which a hostile pattern
(`(.|.)*Z`) keeps busy for minutes while holding the GIL. These patterns are parsed into a
restricted language (`shared.pattern_syntax`) and matched by an NFA simulation
(`shared.pattern_nfa`) paid from a step budget, so matching is linear and bounded:

- `target_modules` as a string: `re.fullmatch(pattern, module_name)`;
- a `rank_pattern` / `alpha_pattern` key: `re.match(rf"(.*\\.)?({key})$", module_name)`.
"""

from __future__ import annotations

from shared.pattern_nfa import MatchBudget, Nfa, Simulation
from shared.pattern_syntax import DOT, Anchor, Chars, CharSet, Concat, Node, PatternError, Repeat, parse

__all__ = ["MatchBudget", "ModulePattern", "PatternError", "compile_key", "compile_target"]

_META = frozenset(".^$*+?{}[]\\|()\n")
_DOT_LITERAL = Chars(CharSet(ranges=((ord("."), ord(".")),)))
_ANY_PARENT = Repeat(Concat((Repeat(Chars(DOT), 0, None), _DOT_LITERAL)), 0, 1)  # (.*\.)?


class ModulePattern:
    """One compiled pattern; `matches` spends from the budget it was compiled with."""

    def __init__(self, text: str, node: Node, as_key: bool, budget: MatchBudget) -> None:
        self.text = text
        self.as_key = as_key
        self.budget = budget
        self.literal = not any(ch in _META for ch in text)
        self._simulation = Simulation(Nfa(node, budget))

    def matches(self, name: str) -> bool:
        if self.literal and "\n" not in name:  # the common case, without the NFA
            self.budget.spend(1)
            return name == self.text or (self.as_key and name.endswith("." + self.text))
        return self._simulation.run(name, prefix=self.as_key)


def compile_target(text: str, budget: MatchBudget) -> ModulePattern:
    """`target_modules` given as a string: matches a name as `re.fullmatch(text, name)` does."""
    budget.spend(len(text))
    return ModulePattern(text, parse(text), as_key=False, budget=budget)


def compile_key(text: str, budget: MatchBudget) -> ModulePattern:
    """A `rank_pattern` / `alpha_pattern` key: matches a name as PEFT's
    `re.match(rf"(.*\\.)?({text})$", name)` does."""
    budget.spend(len(text))
    node = Concat((_ANY_PARENT, parse(text), Anchor("$")))
    return ModulePattern(text, node, as_key=True, budget=budget)
