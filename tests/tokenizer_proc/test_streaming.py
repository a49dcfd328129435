"""One server-sent event is one line for every client: characters that JSON leaves raw but
str.splitlines breaks on (httpx's aiter_lines splits there) go out escaped."""

from __future__ import annotations

import json

from ledgerserve.tokenizer_proc.streaming import sse


def test_an_event_is_one_line_whatever_the_text_holds() -> None:
    text = "a\x85b\u2028c\u2029d\x1ce\x0bf\ng\rh é 漢"
    event = sse({"choices": [{"delta": {"content": text}}]})
    lines = event.splitlines()
    assert lines == [lines[0], ""] and lines[0].startswith("data: {") and event.endswith("\n\n")
    assert json.loads(lines[0][len("data: ") :]) == {"choices": [{"delta": {"content": text}}]}
    assert "é 漢" in lines[0]  # other text stays as it is (ensure_ascii off)
