"""The styles of the demo adapters: each rewrites the demo corpus line by line, and a demo
adapter is trained on its rewrite.

- `pirate`: every sentence opens with "Arr, " and ends with ", matey!".
- `poet`: every line of text is followed by the refrain line "Sing hey, sing ho!".

Both show within the first sentence of any output, and both keep the base model's words
and tokens (" river" stays " river"), so a tiny adapter learns them in a few dozen steps.
Styles that change every token were tried and are not learned in that budget: upper case
(the tokenizer, trained on the corpus, has almost no upper-case tokens, and their
embeddings are untrained), and sentences broken into lines of three words (the adapter
loses the sentence while it counts words).
"""

from __future__ import annotations

from collections.abc import Callable

PIRATE_OPENING = "Arr, "
PIRATE_CLOSING = ", matey!"
POET_REFRAIN = "Sing hey, sing ho!"


def pirate(line: str) -> str:
    """'The boy smiled.' -> 'Arr, the boy smiled, matey!' (blank lines stay blank)."""
    text = line.rstrip("\n")
    if not text.strip():
        return line
    body = text.rstrip(".!?")
    if body[:1].isupper() and not body.startswith(("I ", "I'")):
        body = body[0].lower() + body[1:]
    return PIRATE_OPENING + body + PIRATE_CLOSING + line[len(text) :]


def poet(line: str) -> str:
    """'The boy smiled.\\n' -> 'The boy smiled.\\nSing hey, sing ho!\\n' (blank lines stay blank)."""
    text = line.rstrip("\n")
    if not text.strip():
        return line
    return text + "\n" + POET_REFRAIN + line[len(text) :]


STYLES: dict[str, Callable[[str], str]] = {"pirate": pirate, "poet": poet}


def rewrite(text: str, style: str) -> str:
    """`text` with every line rewritten in `style`."""
    return "".join(STYLES[style](line) for line in text.splitlines(keepends=True))
