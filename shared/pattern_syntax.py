"""The module-name pattern language: the part of Python `re` syntax that PEFT adapter
configs use for `target_modules`, `rank_pattern` and `alpha_pattern`, parsed into a small
syntax tree that `shared.pattern_nfa` matches without backtracking.

Supported: literals; `.`; classes `[...]` with ranges and `^` negation; the escapes `\\d \\D
\\w \\W \\s \\S` and escaped punctuation (`\\.`); groups `(...)` and `(?:...)` with `|`; the
quantifiers `* + ? {m} {m,} {,n} {m,n}` (bounds up to MAX_REPEAT), lazy or not; `^` and `$`.
Everything else (backreferences, lookarounds, flags, named groups, possessive quantifiers,
`\\b`, `\\A`, character escapes, nested sets) raises PatternError. Whatever parses here means
what it means to `re`; whatever `re` refuses is refused here too.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

MAX_PATTERN_CHARS = 1024
MAX_GROUP_DEPTH = 32
MAX_REPEAT = 64
CATEGORIES = "dDwWsS"
_PUNCTUATION = frozenset(string.punctuation)
_QUANTIFIERS = "*+?{"


class PatternError(ValueError):
    """A pattern outside the supported language, or one too costly to match."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class CharSet:
    """One character position: code-point ranges and `\\d`-style categories, maybe negated."""

    ranges: tuple[tuple[int, int], ...]
    categories: str = ""  # letters of CATEGORIES
    negate: bool = False

    def contains(self, ch: str) -> bool:
        code = ord(ch)
        hit = any(lo <= code <= hi for lo, hi in self.ranges) or any(_in_category(c, ch) for c in self.categories)
        return hit != self.negate


DOT = CharSet(ranges=((10, 10),), negate=True)  # any character but a newline, as in `re`


@dataclass(frozen=True)
class Chars:
    chars: CharSet


@dataclass(frozen=True)
class Concat:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True)
class Repeat:
    item: Node
    min: int
    max: int | None  # None: unbounded


@dataclass(frozen=True)
class Anchor:
    kind: str  # "^" (start of the name) or "$" (end, or before a final newline)


Node = Chars | Concat | Alt | Repeat | Anchor


def _in_category(category: str, ch: str) -> bool:
    """`re`'s Unicode categories for str patterns: \\d is Nd, \\w alnum or `_`, \\s whitespace."""
    lower = category.lower()
    hit = ch.isdecimal() if lower == "d" else (ch.isalnum() or ch == "_") if lower == "w" else ch.isspace()
    return hit if category == lower else not hit


def parse(text: str) -> Node:
    """The syntax tree of `text`, or PatternError saying what is not supported and where."""
    if len(text) > MAX_PATTERN_CHARS:
        raise PatternError(f"pattern longer than {MAX_PATTERN_CHARS} characters")
    return _Parser(text).parse()


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0
        self.depth = 0

    def parse(self) -> Node:
        node = self._alt()
        if self.pos < len(self.text):  # only a `)` stops _alt early
            raise self._error("unbalanced parenthesis")
        return node

    def _peek(self) -> str | None:
        return self.text[self.pos] if self.pos < len(self.text) else None

    def _take(self) -> str | None:
        ch = self._peek()
        self.pos += ch is not None
        return ch

    def _error(self, what: str, at: int | None = None) -> PatternError:
        return PatternError(f"{what} at position {self.pos if at is None else at}")

    def _alt(self) -> Node:
        options = [self._concat()]
        while self._peek() == "|":
            self.pos += 1
            options.append(self._concat())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def _concat(self) -> Node:
        items = []
        while (ch := self._peek()) is not None and ch not in "|)":
            items.append(self._quantified())
        return items[0] if len(items) == 1 else Concat(tuple(items))

    def _quantified(self) -> Node:
        bare_anchor = self._peek() in ("^", "$")  # `(^)*` may repeat, `^*` may not (as in `re`)
        atom = self._atom()
        start = self.pos
        bounds = self._quantifier()
        if bounds is None:
            return atom
        if bare_anchor:
            raise self._error("nothing to repeat", start)
        if self._peek() == "?":  # lazy: the same names match in full
            self.pos += 1
        if (ch := self._peek()) is not None and ch in _QUANTIFIERS:
            raise self._error("a repeated quantifier (possessive or multiple repeat) is not supported")
        return Repeat(atom, *bounds)

    def _quantifier(self) -> tuple[int, int | None] | None:
        ch = self._peek()
        if ch is None or ch not in _QUANTIFIERS:
            return None
        self.pos += 1
        if ch != "{":
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
        return self._braces()

    def _braces(self) -> tuple[int, int | None]:
        start = self.pos - 1
        close = self.text.find("}", self.pos)
        low, comma, high = self.text[self.pos : close].partition(",")
        well_formed = all(part == "" or (part.isascii() and part.isdigit()) for part in (low, high))
        if close < 0 or not well_formed or not (low if not comma else low or high):
            raise self._error("`{` must start a repetition {m}, {m,}, {,n} or {m,n}; write \\{ for a brace", start)
        self.pos = close + 1
        min_count = int(low) if low else 0
        max_count = min_count if not comma else (int(high) if high else None)
        if min_count > MAX_REPEAT or (max_count is not None and max_count > MAX_REPEAT):
            raise self._error(f"repetition bound above {MAX_REPEAT}", start)
        if max_count is not None and max_count < min_count:
            raise self._error("min repeat greater than max repeat", start)
        return min_count, max_count

    def _atom(self) -> Node:
        start = self.pos
        ch = self._take()
        if ch == "(":
            return self._group(start)
        if ch == "[":
            return Chars(self._class(start))
        if ch == ".":
            return Chars(DOT)
        if ch in ("^", "$"):
            return Anchor(ch)
        if ch == "\\":
            return Chars(self._escape(start, in_class=False))
        if ch in _QUANTIFIERS:
            what = "nothing to repeat" if ch != "{" else "a literal `{` must be written \\{"
            raise self._error(what, start)
        return Chars(_literal(ch))

    def _group(self, start: int) -> Node:
        if self._peek() == "?":
            if self.text[self.pos : self.pos + 2] != "?:":
                raise self._error(
                    "only plain `(...)` and `(?:...)` groups are supported (no lookarounds, "
                    "flags, named or conditional groups)",
                    start,
                )
            self.pos += 2
        self.depth += 1
        if self.depth > MAX_GROUP_DEPTH:
            raise self._error(f"groups nested deeper than {MAX_GROUP_DEPTH}", start)
        node = self._alt()
        if self._take() != ")":
            raise self._error("missing ), unterminated group", start)
        self.depth -= 1
        return node

    def _escape(self, start: int, in_class: bool) -> CharSet:
        ch = self._take()
        if ch is None:
            raise self._error("a trailing backslash", start)
        if ch in CATEGORIES:
            return CharSet(ranges=(), categories=ch)
        if ch in _PUNCTUATION:
            return _literal(ch)
        where = " inside a set" if in_class else ""
        raise self._error(
            f"unsupported escape \\{ch}{where} (backreferences, \\b, \\A, \\Z and character escapes are not supported)",
            start,
        )

    def _class(self, start: int) -> CharSet:
        negate = self._peek() == "^"
        self.pos += negate
        items: list[CharSet] = []
        while True:
            ch = self._class_char(start)
            if ch == "]" and items:
                break
            first = self._class_item(ch, start)
            if self._peek() != "-":
                items.append(first)
                continue
            self.pos += 1
            if self._peek() == "]":
                self.pos += 1
                items += [first, _literal("-")]
                break
            items.append(self._range(first, self._class_item(self._class_char(start), start), start))
        ranges = tuple(r for item in items for r in item.ranges)
        return CharSet(ranges, "".join(item.categories for item in items), negate)

    def _class_char(self, start: int) -> str:
        ch = self._take()
        if ch is None:
            raise self._error("unterminated character set", start)
        if ch == "[":
            raise self._error("a nested set `[` inside a set is not supported; write \\[", self.pos - 1)
        if ch in "-&~|" and self._peek() == ch:
            raise self._error(f"`{ch}{ch}` inside a set is reserved by `re`; escape it", self.pos - 1)
        return ch

    def _class_item(self, ch: str, start: int) -> CharSet:
        return self._escape(start, in_class=True) if ch == "\\" else _literal(ch)

    def _range(self, low: CharSet, high: CharSet, start: int) -> CharSet:
        if low.categories or high.categories or low.ranges[0][0] > high.ranges[0][0]:
            raise self._error("bad character range", start)
        return CharSet(ranges=((low.ranges[0][0], high.ranges[0][0]),))


def _literal(ch: str) -> CharSet:
    return CharSet(ranges=((ord(ch), ord(ch)),))
