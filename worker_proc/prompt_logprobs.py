"""Prompt logprobs (vLLM's `prompt_logprobs`), for the requests that ask for them: the log-softmax
of the logits at every prompt position a step computes, read at the prompt token after it (with
its rank) and at the top k. Every chunk's positions are scored by the step that computes the chunk:
the worker holds the whole prompt, so the token after a chunk's last position (the next chunk's
first) is known. The last prompt position is left to the sampler, as for every request.

Only these rows go through lm_head here, a bounded number at a time; the forward pass and the
sampled rows are as without them. Queued on the device with one copy to the host, read back with
the step (`finish`): there -inf becomes -9999.0 (as vLLM reports it) and a NaN fails its request.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ledgerserve.shared.events import FailedReq, PromptLogprobs
from ledgerserve.worker_proc.lora.mapping import LoraMapping
from ledgerserve.worker_proc.requests import ReqState
from ledgerserve.worker_proc.sampler import HostCopy, to_device

MAX_ROWS = 256  # lm_head rows per pass: bounds the [rows, vocab] float32 logits (~150 MB at a 150k vocabulary)
MIN_LOGPROB = -9999.0  # what -inf is reported as


@dataclass(frozen=True)
class PromptSpan:
    req_id: str
    start: int  # prompt position of the token its first row scores
    num_rows: int
    num_top: int  # k it asked for


@dataclass(frozen=True)
class PromptRows:
    """The rows of a step's flat batch whose logits score a prompt token, in batch order."""

    indices: list[int]  # rows of the flat batch
    target_ids: list[int]  # the prompt token each row scores (the one after its position)
    lora_slots: list[int]  # each row's adapter slot, -1 = base model
    spans: list[PromptSpan]

    @property
    def num_top(self) -> int:
        return max((span.num_top for span in self.spans), default=0)


@dataclass(frozen=True)
class PendingPromptLogprobs:
    """Queued on the device (launch), not read back yet (finish)."""

    spans: list[PromptSpan]
    # prompt tokens' logprobs [num_rows], their ranks [num_rows], top logprobs and ids [num_rows, k]
    host: HostCopy


def prompt_rows(reqs: Sequence[ReqState]) -> PromptRows:
    """Which rows of the flat batch of `reqs` (worker_proc/step_inputs.host_inputs's order) score prompt tokens."""
    indices: list[int] = []
    target_ids: list[int] = []
    lora_slots: list[int] = []
    spans: list[PromptSpan] = []
    offset = 0
    for req in reqs:
        start, end = req.num_computed_tokens, req.num_tokens_after_step
        last = min(end, req.num_prompt_tokens - 1)  # rows start..last-1 score tokens start+1..last
        k = req.sampling.prompt_logprobs
        if k is not None and start < last:
            indices += range(offset, offset + last - start)
            target_ids += req.token_ids[start + 1 : last + 1]
            lora_slots += [req.lora_slot] * (last - start)
            spans.append(PromptSpan(req.req_id, start + 1, last - start, k))
        offset += end - start
    return PromptRows(indices, target_ids, lora_slots, spans)


def launch(model: torch.nn.Module, hidden: torch.Tensor, rows: PromptRows, vocab_size: int) -> PendingPromptLogprobs:
    """Queue the rows' logprobs; hidden: [num_tokens, hidden], the step's final hidden states."""
    num_top = min(rows.num_top, vocab_size)
    parts = [score(logits, targets, num_top) for logits, targets in _logits(model, hidden, rows)]
    chosen, ranks, top_values, top_ids = (torch.cat(column) for column in zip(*parts))
    return PendingPromptLogprobs(rows.spans, HostCopy.of(chosen, ranks, top_values, top_ids))


def join(model: torch.nn.Module, hidden: torch.Tensor, rows: PromptRows) -> None:
    """A tensor-parallel rank past 0: run lm_head over the rows rank 0's `launch` runs, for the
    gather of its vocabulary shard there; nothing is scored or returned."""
    for _ in _logits(model, hidden, rows):
        pass


def _logits(model: torch.nn.Module, hidden: torch.Tensor, rows: PromptRows) -> Iterator[tuple[torch.Tensor, ...]]:
    """The rows' logits [m, vocab] float32 and target ids [m], MAX_ROWS rows at a time."""
    device = hidden.device
    for a in range(0, len(rows.indices), MAX_ROWS):
        b = a + MAX_ROWS
        index = to_device(rows.indices[a:b], torch.long, device)  # [m]
        targets = to_device(rows.target_ids[a:b], torch.long, device)  # [m]
        lora_slots = rows.lora_slots[a:b]
        lora = LoraMapping.from_host(lora_slots, to_device(lora_slots, torch.long, device))
        yield model.compute_logits(hidden.index_select(0, index), lora=lora), targets


def score(logits: torch.Tensor, targets: torch.Tensor, num_top: int) -> tuple[torch.Tensor, ...]:
    """logits [m, vocab] float32, targets [m] -> each target's logprob [m] and rank [m] (vLLM's: the
    number of tokens at least as likely), the top logprobs [m, num_top] and their ids [m, num_top]."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [m, vocab]
    chosen = logprobs.gather(1, targets[:, None])  # [m, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # [m]
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [m, num_top]
    return chosen.squeeze(1).clamp(min=MIN_LOGPROB), ranks, top_values.clamp(min=MIN_LOGPROB), top_ids


def finish(pending: PendingPromptLogprobs) -> tuple[list[PromptLogprobs], list[FailedReq]]:
    """The step's prompt logprobs per request (its one wait, on its own copy), and the requests
    whose logprobs hold a NaN: those fail alone."""
    chosen, ranks, top_values, top_ids = (t.tolist() for t in pending.host.wait())
    reports: list[PromptLogprobs] = []
    failed: list[FailedReq] = []
    row = 0
    for span in pending.spans:
        end = row + span.num_rows
        values, tops = chosen[row:end], [v[: span.num_top] for v in top_values[row:end]]
        if any(math.isnan(v) for v in values) or any(math.isnan(v) for top in tops for v in top):
            last = span.start + span.num_rows - 1
            failed.append(
                FailedReq(
                    span.req_id,
                    f"the logprobs of prompt positions {span.start}..{last} hold a NaN "
                    "(the model's logits are not finite)",
                )
            )
        else:
            ids = [t[: span.num_top] for t in top_ids[row:end]] if span.num_top else []
            reports.append(
                PromptLogprobs(span.req_id, span.start, values, ranks[row:end], ids, tops if span.num_top else [])
            )
        row = end
    return reports, failed
