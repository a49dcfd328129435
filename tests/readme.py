"""The README's commands, as its ```bash blocks quote them."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def bash_blocks(text: str) -> list[list[str]]:
    """The commands of each ```bash block, a line ending in a backslash joined to the next."""
    blocks = []
    for body in re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        joined = re.sub(r"\\\n\s*", "", body)
        blocks.append([line.strip() for line in joined.splitlines() if line.strip()])
    return blocks


def readme_commands() -> list[str]:
    """Every command of the README's ```bash blocks, in order."""
    return [command for block in bash_blocks(README.read_text(encoding="utf-8")) for command in block]
