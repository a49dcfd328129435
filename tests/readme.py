"""The commands the README and docs/ quote in their ```bash blocks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = tuple(sorted((ROOT / "docs").glob("*.md")))


def bash_blocks(text: str) -> list[list[str]]:
    """The commands of each ```bash block, a line ending in a backslash joined to the next."""
    blocks = []
    for body in re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        joined = re.sub(r"\\\n\s*", "", body)
        blocks.append([line.strip() for line in joined.splitlines() if line.strip()])
    return blocks


def manual_text() -> str:
    """README.md, then each page of docs/ in name order: the user manual, as one text."""
    return "\n".join(path.read_text(encoding="utf-8") for path in (README, *DOCS))


def readme_commands() -> list[str]:
    """Every command of the ```bash blocks of README.md, then of docs/*.md, in order."""
    return [command for block in bash_blocks(manual_text()) for command in block]
