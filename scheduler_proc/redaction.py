"""What the event log keeps of request content: `--event-log-content tokens` (everything) or `hashed`.

The shell passes every input through `Redactor.inbound` before it is logged and applied, and every
decision through `Redactor.outbound` after it is logged and before it is sent. The core stays
content-blind: the log holds exactly what it saw, so replay of a hashed log is exact. In hashed mode:

- the token at position p of a request (prompt or sampled) becomes a *prefix digest*, a keyed BLAKE2b
  of the request's whole sequence up to p, chained (d_p = H(d_{p-1}, token_p)), in [2**40, 2**63) so
  it never equals a token id. Equal digests mean equal prefixes: the prefix cache, which compares
  whole blocks of values, matches what it matches on token ids, and a single token's digest says
  nothing about the token. The key is drawn for the run and never written anywhere.
- a sampled token that stops its request keeps its id (the core's own stop check, finish.check_stop,
  run on the shell's count of the outputs the core took), so the core stops it as it would on ids.
  It ends the request, so it is never computed, cached or sent to a worker; the stop it causes is
  logged in any mode (TokensEmitted.stop_token_id).
- logprobs (TokenLogprobs, PromptLogprobs) become zeros of the same shape: the core checks shapes.

Outbound, digests go back to token ids and the real logprobs onto the TokensEmitted that carries
them, from a table per live request, dropped when the core finishes or rejects the request.
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ledgerserve.scheduler_proc.core.finish import check_stop
from ledgerserve.shared import events as ev
from ledgerserve.shared.sampling import SamplingParams

MIN_DIGEST = 1 << 40  # above every token id: a digest never equals one
_DIGEST_SPAN = (1 << 63) - MIN_DIGEST
_NEVER_LONG = 1 << 62  # a length no request reaches: check_stop then reports stops only
_PAIR = struct.Struct("<Qq")  # (previous digest, token id)
_replace = msgspec.structs.replace


@dataclass
class _Req:
    """One live request's content, as the hashed log hides it."""

    sampling: SamplingParams
    head: int  # digest of the tokens the core holds: the prompt, then each output it took
    real: dict[int, int] = field(default_factory=dict)  # digest -> token id, of every token the core holds
    num_outputs: int = 0  # outputs the core took (TokensEmitted), as check_stop counts them
    sampled: tuple[int, int, int, Any] | None = None  # latest sample: (value logged, digest, token id, logprobs)
    prompt_report: ev.PromptLogprobs | None = None  # the latest real prompt-logprobs report


class Redactor:
    """Identity for `tokens`; for `hashed`, pseudonymizes inputs and restores decisions (above)."""

    def __init__(self, content: str = "tokens", key: bytes | None = None) -> None:
        if content not in ("tokens", "hashed"):
            raise ValueError(f"event-log content must be tokens or hashed, got {content!r}")
        self.hashed = content == "hashed"
        self._hasher = hashlib.blake2b(key=key or secrets.token_bytes(32), digest_size=8)
        self.reqs: dict[str, _Req] = {}  # live requests, lookups only
        self.eos_token_ids: list[int] = []  # rank 0's, as the core takes them
        self._duplicate: str | None = None  # an arrival whose id is live: its rejection ends nothing here
        self._num_unlinked = 0

    def inbound(self, event: Any) -> Any:
        """The input as it is logged and applied."""
        if not self.hashed:
            return event
        self._duplicate = None
        if isinstance(event, ev.RequestArrived):
            return self._arrived(event)
        if isinstance(event, ev.StepCompleted):
            return self._completed(event)
        if isinstance(event, ev.WorkerReady) and event.rank == 0:
            self.eos_token_ids = list(event.eos_token_ids)
        return event

    def outbound(self, decision: Any) -> Any:
        """The logged decision as it is sent."""
        if not self.hashed:
            return decision
        if isinstance(decision, ev.StepPlan):
            return self._plan(decision)
        if isinstance(decision, ev.TokensEmitted):
            return self._emitted(decision)
        if isinstance(decision, ev.RequestFinished) or (
            isinstance(decision, ev.RequestRejected) and decision.req_id != self._duplicate
        ):
            self.reqs.pop(decision.req_id, None)
        return decision

    # ------------------------------------------------------------------ inbound

    def digest(self, prev: int, token_id: int) -> int:
        """The prefix digest of a sequence whose prefix digest before `token_id` is `prev` (0: empty)."""
        h = self._hasher.copy()
        try:
            h.update(_PAIR.pack(prev, token_id))
        except struct.error:  # an id past int64 (the HTTP process refuses those): a longer, distinct encoding
            h.update(prev.to_bytes(8, "little") + token_id.to_bytes(9, "little", signed=True))
        return MIN_DIGEST + int.from_bytes(h.digest(), "little") % _DIGEST_SPAN

    def _arrived(self, event: ev.RequestArrived) -> ev.RequestArrived:
        req = _Req(event.sampling, 0)
        values = []
        for token_id in event.prompt_token_ids:
            req.head = self.digest(req.head, token_id)
            req.real[req.head] = token_id
            values.append(req.head)
        if event.req_id in self.reqs:
            self._duplicate = event.req_id  # the core refuses it; the live request keeps its table
        else:
            self.reqs[event.req_id] = req
        return _replace(event, prompt_token_ids=values)

    def _completed(self, event: ev.StepCompleted) -> ev.StepCompleted:
        if not event.sampled and not event.prompt_logprobs:
            return event
        sampled = [self._sampled(token, event.rank) for token in event.sampled]
        reports = [self._prompt_report(report, event.rank) for report in event.prompt_logprobs]
        return _replace(event, sampled=sampled, prompt_logprobs=reports)

    def _sampled(self, token: ev.SampledToken, rank: int) -> ev.SampledToken:
        """Only rank 0's samples reach a request; any other is logged unlinked (the core drops it)."""
        req = self.reqs.get(token.req_id) if rank == 0 else None
        logprobs = None if token.logprobs is None else _blank_logprobs(token.logprobs)
        if req is None:
            self._num_unlinked += 1  # below MIN_DIGEST: never a chain's digest, so never a prefix
            return ev.SampledToken(token.req_id, self.digest(self._num_unlinked, token.token_id), logprobs)
        digest = self.digest(req.head, token.token_id)
        _, stop_token_id = check_stop(
            token.token_id, req.num_outputs + 1, 0, req.sampling, self.eos_token_ids, _NEVER_LONG
        )
        value = token.token_id if stop_token_id is not None else digest
        req.sampled = (value, digest, token.token_id, token.logprobs)
        return ev.SampledToken(token.req_id, value, logprobs)

    def _prompt_report(self, report: ev.PromptLogprobs, rank: int) -> ev.PromptLogprobs:
        req = self.reqs.get(report.req_id) if rank == 0 else None
        if req is not None:
            req.prompt_report = report
        return ev.PromptLogprobs(
            report.req_id,
            report.start,
            [0.0] * len(report.logprobs),
            [0] * len(report.ranks),
            [[0] * len(ids) for ids in report.top_token_ids],
            [[0.0] * len(values) for values in report.top_logprobs],
        )

    # ------------------------------------------------------------------ outbound

    def _plan(self, plan: ev.StepPlan) -> ev.StepPlan:
        if not plan.new_reqs and not plan.cached_reqs:
            return plan
        new_reqs = [_replace(r, token_ids=self._token_ids(r.req_id, r.token_ids)) for r in plan.new_reqs]
        cached_reqs = [_replace(r, new_token_ids=self._token_ids(r.req_id, r.new_token_ids)) for r in plan.cached_reqs]
        return _replace(plan, new_reqs=new_reqs, cached_reqs=cached_reqs)

    def _token_ids(self, req_id: str, values: list[int]) -> list[int]:
        req = self._live(req_id)
        try:
            return [req.real[v] if v >= MIN_DIGEST else v for v in values]
        except KeyError as exc:
            raise RuntimeError(f"request {req_id!r}: the core sent a digest the shell never made") from exc

    def _emitted(self, out: ev.TokensEmitted) -> ev.TokensEmitted:
        if not out.new_token_ids and out.prompt_logprobs is None:
            return out  # an abort's or a stop string's finish: nothing to restore
        req = self._live(out.req_id)
        token_ids, logprobs = out.new_token_ids, out.logprobs
        if token_ids:
            if req.sampled is None or token_ids != [req.sampled[0]]:
                raise RuntimeError(f"request {out.req_id!r}: the core emitted {token_ids}, not its latest sample")
            _, req.head, token_id, real_logprobs = req.sampled
            req.real[req.head] = token_id
            req.num_outputs += 1
            req.sampled = None
            token_ids = [token_id]
            logprobs = None if logprobs is None else [real_logprobs]
        prompt = out.prompt_logprobs
        if prompt is not None:
            prompt = _slice_like(req.prompt_report, prompt)
        return _replace(out, new_token_ids=token_ids, logprobs=logprobs, prompt_logprobs=prompt)

    def _live(self, req_id: str) -> _Req:
        req = self.reqs.get(req_id)
        if req is None:
            raise RuntimeError(f"request {req_id!r}: no content table for a request the core holds")
        return req


def _blank_logprobs(logprobs: ev.TokenLogprobs) -> ev.TokenLogprobs:
    return ev.TokenLogprobs(0.0, [0] * len(logprobs.top_token_ids), [0.0] * len(logprobs.top_logprobs))


def _slice_like(real: ev.PromptLogprobs | None, sent: ev.PromptLogprobs) -> ev.PromptLogprobs:
    """The positions of `real` (the report the core took, blanked) that the core passes on in `sent`."""
    if real is None or sent.start < real.start:
        raise RuntimeError(f"request {sent.req_id!r}: prompt logprobs the shell never received")
    skip, end = sent.start - real.start, sent.start - real.start + len(sent.logprobs)
    return ev.PromptLogprobs(
        real.req_id,
        sent.start,
        real.logprobs[skip:end],
        real.ranks[skip:end],
        real.top_token_ids[skip:end],
        real.top_logprobs[skip:end],
    )
