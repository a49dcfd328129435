"""`--diff` of logs written with `--event-log-content hashed`. Each run draws its own key, so the same
traffic logs other prefix digests, and so other block hashes and state digests (they chain from the
digests). For a diff, each log's values of those three kinds are renamed in their order of first
appearance, each kind and each stream (inputs, decisions) apart: two runs then compare by which
values equal which, so the same traffic diffs clean, and any difference in what the core saw or did
(a prefix hit, a stop, a plan) still shows. What the tokens were is not in such a log."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from ledgerserve.scheduler_proc.redaction import MIN_DIGEST
from ledgerserve.shared import codec
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig

_replace = msgspec.structs.replace
_decoder = codec.log_event_decoder()


class Pseudonyms:
    """One stream's renaming: each kind's values numbered from 1 as they first appear."""

    def __init__(self) -> None:
        self._names: dict[str, dict[int, int]] = {"token": {}, "block": {}, "state": {}}

    def name(self, kind: str, value: int) -> int:
        names = self._names[kind]
        return names.setdefault(value, len(names) + 1)

    def tokens(self, values: list[int]) -> list[int]:
        """Digests renamed (above every token id, as they were); a stop's token id stays."""
        return [MIN_DIGEST + self.name("token", v) if v >= MIN_DIGEST else v for v in values]

    def rename(self, data: bytes) -> bytes:
        event = _decoder.decode(data)
        renamed = self._renamed(event)
        return data if renamed is event else codec.encode(renamed)

    def _renamed(self, event: Any) -> Any:
        if isinstance(event, ev.RequestArrived):
            return _replace(event, prompt_token_ids=self.tokens(event.prompt_token_ids))
        if isinstance(event, ev.StepCompleted):
            sampled = [_replace(t, token_id=self.tokens([t.token_id])[0]) for t in event.sampled]
            return _replace(event, sampled=sampled)
        if isinstance(event, ev.StepPlan):
            new_reqs = [_replace(r, token_ids=self.tokens(r.token_ids)) for r in event.new_reqs]
            cached_reqs = [_replace(r, new_token_ids=self.tokens(r.new_token_ids)) for r in event.cached_reqs]
            return _replace(event, new_reqs=new_reqs, cached_reqs=cached_reqs)
        if isinstance(event, ev.TokensEmitted):
            return _replace(event, new_token_ids=self.tokens(event.new_token_ids))
        if isinstance(event, ev.PrefixCached):
            return _replace(event, block_hashes=[self.name("block", h) for h in event.block_hashes])
        if isinstance(event, ev.StateDigest):
            return _replace(event, digest=self.name("state", event.digest))
        return event


def renamer(config_json: bytes) -> Callable[[bytes], bytes] | None:
    """A fresh stream's renaming for a hashed log (by its header's engine config), else None."""
    if EngineConfig.from_json(config_json).event_log_content != "hashed":
        return None
    return Pseudonyms().rename
