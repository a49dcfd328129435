"""One request's engine outputs that its reader has not taken yet.

When the reader falls behind the engine (the HTTP process busy parsing a wave of new requests,
say), the outputs waiting for it merge into one: the reader then pays one detokenize call, one
server-sent event and one socket write for all of them, not one per engine step. Nothing waits to
be merged: a reader that keeps up gets every output as it comes. (vLLM's output collector merges
the same way.)"""

from __future__ import annotations

import asyncio
from collections import deque

from ledgerserve.shared.events import TokensEmitted


def merged(waiting: TokensEmitted, new: TokensEmitted) -> TokensEmitted | None:
    """`waiting` then `new` as one output; None where they must stay apart: `waiting` ended the
    request, or either carries prompt logprobs (they go out chunk by chunk, before the first token)."""
    if waiting.finish_reason is not None or waiting.prompt_logprobs is not None or new.prompt_logprobs is not None:
        return None
    if (waiting.logprobs is None) != (new.logprobs is None):
        return None
    logprobs = None if waiting.logprobs is None or new.logprobs is None else waiting.logprobs + new.logprobs
    return TokensEmitted(
        req_id=new.req_id,
        new_token_ids=waiting.new_token_ids + new.new_token_ids,
        finish_reason=new.finish_reason,
        logprobs=logprobs,
        num_prompt_tokens=new.num_prompt_tokens,
        num_cached_tokens=max(waiting.num_cached_tokens, new.num_cached_tokens),
        stop_token_id=new.stop_token_id,
    )


class Mailbox:
    """Outputs (TokensEmitted) and errors in arrival order; an output put behind an output not yet
    taken merges into it (`merged`)."""

    def __init__(self) -> None:
        self._items: deque[TokensEmitted | Exception] = deque()
        self._ready = asyncio.Event()

    def put(self, item: TokensEmitted | Exception) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(last, TokensEmitted) and isinstance(item, TokensEmitted):
            if (both := merged(last, item)) is not None:
                self._items[-1] = both
                return
        self._items.append(item)
        self._ready.set()

    async def get(self) -> TokensEmitted | Exception:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)
