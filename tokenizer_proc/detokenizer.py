"""Incremental detokenization and stop-string matching for one request.

Text is decoded from a sliding window of ids (vLLM's prefix/read offsets): new text is
released only when it does not end in U+FFFD, so a multi-byte UTF-8 character split
across tokens is never emitted half-done. Stop strings are matched on the text; the
matched stop string and everything after it are excluded from the output. While a
request runs, a tail that could still grow into a stop string is held back.

Windows are decoded with the tokenizer's `_decode` where it has one: `decode` first walks
every id through transformers' `to_py_obj` checks, which cost several times the Rust decode
itself and made detokenization most of the HTTP process's per-token work. `_decode` is the
same decode and clean-up without that walk (tests hold the two equal).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tail decoded with the output, for spacing


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode_ids = getattr(tokenizer, "_decode", tokenizer.decode)
        self._skip_special = skip_special_tokens
        self._stop = [s for s in stop if s]
        tail = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = tail
        self._prefix_offset = 0
        self._read_offset = len(tail)
        self.output_token_ids: list[int] = []
        self.text = ""  # all decoded output text (after a stop match: cut before it)
        self._num_sent_chars = 0
        self.stop_matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_matched is not None

    def push(self, token_ids: Sequence[int], finished: bool = False) -> str:
        """Add new ids; return the text delta that is safe to send now."""
        if self.stopped:
            return ""
        for token_id in token_ids:
            self.output_token_ids.append(token_id)
            self._ids.append(token_id)
            self.text += self._decode_next(final=False)
            if self._check_stop():
                break
        if finished and not self.stopped:
            self.text += self._decode_next(final=True)
            self._check_stop()
        return self._release(final=finished or self.stopped)

    def _decode_next(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # wait for the rest of the character
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._decode_ids(ids, skip_special_tokens=self._skip_special)

    def _check_stop(self) -> bool:
        if not self._stop:
            return False
        longest = max(len(s) for s in self._stop)
        start = max(0, self._num_sent_chars - longest)
        match = find_stop(self.text, self._stop, start)
        if match is None:
            return False
        index, stop = match
        self.text = self.text[:index]
        self.stop_matched = stop
        return True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - held_back_chars(self.text, self._stop)
        end = max(end, self._num_sent_chars)
        delta = self.text[self._num_sent_chars : end]
        self._num_sent_chars = end
        return delta


def find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """Earliest occurrence of any stop string at or after `start`."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def held_back_chars(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    held = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:length]):
                held = length
                break
    return held
