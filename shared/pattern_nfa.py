"""Thompson NFAs of module-name patterns, simulated on the set of live states: time linear in
the pattern's size times the name's length, never backtracking.

Every unit of work (one NFA state built, one state visited) is paid from a `MatchBudget`
shared by all the patterns of one adapter, so no config can make matching run long. Sets of
live states reached before are remembered per pattern (a lazily built DFA), so matching many
similar names (`model.layers.N....`) costs little more than one dictionary lookup a character.
"""

from __future__ import annotations

from ledgerserve.shared.pattern_syntax import Alt, Anchor, Chars, CharSet, Concat, Node, PatternError, Repeat

MAX_NFA_STATES = 4096
MAX_REMEMBERED_SETS = 65536  # per pattern; past it, the remembered sets are forgotten between names

_CHAR, _SPLIT, _BOL, _EOL, _MATCH = range(5)


class MatchBudget:
    """The steps the patterns of one adapter may spend, building and matching together."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.num_steps = 0

    def spend(self, num_steps: int) -> None:
        self.num_steps += num_steps
        if self.num_steps > self.max_steps:
            raise PatternError(
                f"the module patterns need more than {self.max_steps} matching steps; use fewer or simpler patterns"
            )


class Nfa:
    """States 0..n-1: a kind, a character set (for _CHAR) and up to two successors."""

    def __init__(self, node: Node, budget: MatchBudget) -> None:
        self.kinds: list[int] = []
        self.sets: list[CharSet | None] = []
        self.outs: list[list[int]] = []
        self.budget = budget
        self.start = self._build(node, self._add(_MATCH))

    def _add(self, kind: int, outs: list[int] | None = None, chars: CharSet | None = None) -> int:
        if len(self.kinds) >= MAX_NFA_STATES:
            raise PatternError(f"the pattern compiles to more than {MAX_NFA_STATES} states")
        self.budget.spend(1)
        self.kinds.append(kind)
        self.sets.append(chars)
        self.outs.append(outs if outs is not None else [])
        return len(self.kinds) - 1

    def _build(self, node: Node, out: int) -> int:
        """The entry state of `node`, whose exit continues at `out` (built back to front)."""
        if isinstance(node, Chars):
            return self._add(_CHAR, [out], node.chars)
        if isinstance(node, Anchor):
            return self._add(_BOL if node.kind == "^" else _EOL, [out])
        if isinstance(node, Concat):
            for item in reversed(node.items):
                out = self._build(item, out)
            return out
        if isinstance(node, Alt):
            return self._add(_SPLIT, [self._build(option, out) for option in node.options])
        return self._repeat(node, out)

    def _repeat(self, node: Repeat, out: int) -> int:
        if node.max is None:  # item*: a loop through one split
            tail = self._add(_SPLIT)
            self.outs[tail] += [self._build(node.item, tail), out]
        else:  # (item(item(...)?)?)? for the optional copies
            tail = out
            for _ in range(node.max - node.min):
                tail = self._add(_SPLIT, [self._build(node.item, tail), out])
        for _ in range(node.min):
            tail = self._build(node.item, tail)
        return tail


class Simulation:
    """Matches names against one NFA, remembering the moves between sets of live states."""

    def __init__(self, nfa: Nfa) -> None:
        self.nfa = nfa
        self._forget()

    def _forget(self) -> None:
        self.set_ids: dict[frozenset[int], int] = {}
        self.sets: list[frozenset[int]] = []
        self.accepting: list[bool] = []
        self.moves: dict[tuple[int, str, bool, bool], int] = {}  # (set id, char, at end, at start) -> set id

    def run(self, name: str, prefix: bool) -> bool:
        """`re.fullmatch` of the pattern on `name`; with `prefix`, `re.match` (any prefix may match).
        A remembered move costs one step; a new one also the states it visits."""
        if len(self.sets) > MAX_REMEMBERED_SETS:
            self._forget()
        moves, sets, accepting = self.moves, self.sets, self.accepting
        set_id = self._move(-1, "", _at_end(name, 0), True)
        num_chars = 0
        for pos, ch in enumerate(name):
            if (prefix and accepting[set_id]) or not sets[set_id]:
                break
            num_chars += 1
            at_end = pos + 2 >= len(name) and _at_end(name, pos + 1)
            known = moves.get((set_id, ch, at_end, False))
            set_id = known if known is not None else self._move(set_id, ch, at_end, False)
        self.nfa.budget.spend(num_chars)
        return accepting[set_id]

    def _move(self, set_id: int, ch: str, at_end: bool, at_start: bool) -> int:
        """The live set after reading `ch` from set `set_id` (-1, "": the start), computed once."""
        key = (set_id, ch, at_end, at_start)
        known = self.moves.get(key)
        if known is not None:
            return known
        seeds = [self.nfa.start] if set_id < 0 else self._step(self.sets[set_id], ch)
        new_id = self._intern(self._closure(seeds, at_start, at_end))
        self.moves[key] = new_id
        return new_id

    def _step(self, live: frozenset[int], ch: str) -> list[int]:
        nfa = self.nfa
        nfa.budget.spend(len(live))
        return [nfa.outs[s][0] for s in live if nfa.kinds[s] == _CHAR and nfa.sets[s].contains(ch)]

    def _closure(self, seeds: list[int], at_start: bool, at_end: bool) -> frozenset[int]:
        """The states reachable from `seeds` without reading, through splits and the anchors that hold."""
        nfa = self.nfa
        seen: set[int] = set()
        stack = list(seeds)
        while stack:
            state = stack.pop()
            if state in seen:
                continue
            seen.add(state)
            kind = nfa.kinds[state]
            if kind == _SPLIT or (kind == _BOL and at_start) or (kind == _EOL and at_end):
                stack.extend(nfa.outs[state])
        nfa.budget.spend(len(seen))
        return frozenset(s for s in seen if nfa.kinds[s] in (_CHAR, _MATCH))

    def _intern(self, live: frozenset[int]) -> int:
        set_id = self.set_ids.get(live)
        if set_id is None:
            set_id = len(self.sets)
            self.sets.append(live)
            self.accepting.append(any(self.nfa.kinds[s] == _MATCH for s in live))
            self.set_ids[live] = set_id
        return set_id


def _at_end(name: str, pos: int) -> bool:
    """Where `$` holds: at the end of the name, or before a newline that ends it."""
    return pos == len(name) or (pos == len(name) - 1 and name[pos] == "\n")
