"""Per-request sampling over a batch of logits, with vLLM semantics.

Order: raw logprobs (log_softmax of the model's logits) -> logit_bias -> penalties ->
min_tokens stop masking -> greedy argmax, or temperature -> min_p -> top_k -> top_p -> draw.
Rows that none of the middle steps touch (no bias, penalty or min_tokens) are read as they are.
A seeded request draws with a generator derived from (seed, output position), so its
tokens do not depend on the rest of the batch and survive a preemption unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch
import xxhash

from ledgerserve.kernels import ops
from ledgerserve.shared.events import TokenLogprobs
from ledgerserve.shared.sampling import SamplingParams


@dataclass(frozen=True)
class SamplingReq:
    """What the sampler needs to know about one request at this step."""

    params: SamplingParams
    token_ids: Sequence[int]  # the prompt, then the outputs so far (held by the worker, not copied)
    num_prompt_tokens: int
    # 1 when this step's input is a placeholder: an output sampled but not yet on the host, which
    # counts towards the position being sampled (never for penalties, which need its id)
    num_pending_tokens: int = 0

    @property
    def num_output_tokens(self) -> int:  # the output position being sampled
        return len(self.token_ids) + self.num_pending_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> Sequence[int]:  # a copy: penalties alone ask for it
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> Sequence[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprobs: TokenLogprobs | None


@dataclass(frozen=True)
class HostCopy:
    """Device tensors copied to the host without blocking: readable once `ready` completed.
    Waiting on the copy's own event, not on the stream, lets a step launched after it run on."""

    tensors: tuple[torch.Tensor, ...]
    ready: torch.cuda.Event | None  # None on CPU: the tensors are the host tensors

    @staticmethod
    def of(*tensors: torch.Tensor) -> HostCopy:
        if tensors[0].device.type != "cuda":
            return HostCopy(tensors, None)
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return HostCopy(host, ready)

    def is_ready(self) -> bool:
        return self.ready is None or self.ready.query()

    def wait(self) -> tuple[torch.Tensor, ...]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensors


@dataclass(frozen=True)
class PendingSample:
    """Sampling queued on the device, not yet read back (Sampler.launch -> Sampler.finish)."""

    token_ids: torch.Tensor  # [num_reqs] int64, on the device (the next step's placeholders read it there)
    # on its way to the host: token ids [num_reqs], and with logprobs asked for, the sampled
    # token's logprob [num_reqs] and the top-k logprobs and ids [num_reqs, k], k the largest asked
    host: HostCopy
    reqs: Sequence[SamplingReq]


def token_seed(seed: int, output_pos: int) -> int:
    """A generator seed that depends only on the request's seed and output position."""
    return xxhash.xxh64_intdigest(msgspec.msgpack.encode([seed, output_pos])) & ((1 << 63) - 1)


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int], seed: int, device: torch.device) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)  # for unseeded requests

    def sample(self, logits: torch.Tensor, reqs: Sequence[SamplingReq]) -> list[SampleResult]:
        """logits: [num_reqs, vocab] float32 (not modified)."""
        return self.finish(self.launch(logits, reqs))

    def launch(self, logits: torch.Tensor, reqs: Sequence[SamplingReq]) -> PendingSample:
        """Queue the sampling of `logits` [num_reqs, vocab] float32 (not modified); nothing waits on the device."""
        if logits.shape[0] != len(reqs):
            raise ValueError(f"{logits.shape[0]} logits rows for {len(reqs)} requests")
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(r.params.logprobs is not None for r in reqs) else None
        if any(edits_logits(r) for r in reqs):  # else the logits are read as they are, no copy
            logits = logits.clone()
            apply_logit_bias(logits, reqs)
            apply_penalties(logits, reqs)
            mask_stop_tokens(logits, reqs, self.eos_token_ids)
        token_ids = self._choose(logits, reqs)
        if raw_logprobs is None:
            return PendingSample(token_ids, HostCopy.of(token_ids), reqs)
        num_top = min(max(r.params.logprobs or 0 for r in reqs), raw_logprobs.shape[1])
        top_values, top_ids = raw_logprobs.topk(num_top, dim=-1)  # [num_reqs, num_top]
        chosen = raw_logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [num_reqs]
        return PendingSample(token_ids, HostCopy.of(token_ids, chosen, top_values, top_ids), reqs)

    def finish(self, pending: PendingSample) -> list[SampleResult]:
        """The sampled tokens (and logprobs): the step's one wait, on its own copy to the host."""
        host = pending.host.wait()
        token_ids: list[int] = host[0].tolist()
        if len(host) == 1:
            return [SampleResult(t, None) for t in token_ids]
        chosen, top_values, top_ids = host[1].tolist(), host[2].tolist(), host[3].tolist()
        return [
            SampleResult(t, token_logprobs(chosen[i], top_ids[i], top_values[i], req.params.logprobs))
            for i, (t, req) in enumerate(zip(token_ids, pending.reqs))
        ]

    def _choose(self, logits: torch.Tensor, reqs: Sequence[SamplingReq]) -> torch.Tensor:  # [num_reqs]
        token_ids = ops.argmax(logits)
        random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if random_rows:
            rows = to_device(random_rows, torch.long, logits.device)
            probs = filtered_probs(logits[rows], [reqs[i].params for i in random_rows])  # [num_random, vocab]
            noise = torch.stack([self._exponential(reqs[i], logits.shape[1]) for i in random_rows])
            token_ids[rows] = (probs / noise).argmax(dim=-1)
        return token_ids

    def _exponential(self, req: SamplingReq, vocab_size: int) -> torch.Tensor:  # [vocab]
        gen = self.generator
        if req.params.seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(token_seed(req.params.seed, req.num_output_tokens))
        return torch.empty(vocab_size, device=self.device).exponential_(generator=gen)


def to_device(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`. On CUDA it goes through pinned memory without
    blocking, so queuing a step's sampling never waits for the device to drain its stream."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def edits_logits(req: SamplingReq) -> bool:
    """Whether apply_logit_bias, apply_penalties or mask_stop_tokens may change this request's row."""
    p = req.params
    return p.penalised or bool(p.logit_bias) or req.num_output_tokens < p.min_tokens


def apply_logit_bias(logits: torch.Tensor, reqs: Sequence[SamplingReq]) -> None:
    """Each request's logit_bias added to its row, in place: one scatter for the whole batch."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, req in enumerate(reqs):
        for token_id, bias in req.params.logit_bias:
            if 0 <= token_id < vocab_size:  # ids past the model's vocabulary were refused upstream
                rows.append(i)
                token_ids.append(token_id)
                biases.append(bias)
    if not rows:
        return
    device = logits.device
    index = (to_device(rows, torch.long, device), to_device(token_ids, torch.long, device))  # [num_biases] each
    logits.index_put_(index, to_device(biases, logits.dtype, device), accumulate=True)


def apply_penalties(logits: torch.Tensor, reqs: Sequence[SamplingReq]) -> torch.Tensor:
    """vLLM penalties, in place: repetition over prompt+output tokens, presence/frequency over outputs."""
    for i, req in enumerate(reqs):
        p = req.params
        if not p.penalised:
            continue
        vocab_size = logits.shape[1]
        out_ids = to_device(list(req.output_token_ids), torch.long, logits.device)
        out_counts = torch.bincount(out_ids, minlength=vocab_size)[:vocab_size].to(logits.dtype)  # [vocab]
        if p.repetition_penalty != 1.0:
            prompt_ids = to_device(list(req.prompt_token_ids), torch.long, logits.device)
            seen = torch.bincount(prompt_ids, minlength=vocab_size)[:vocab_size] > 0
            seen |= out_counts > 0
            row = logits[i]
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            logits[i] = torch.where(seen, scaled, row)
        logits[i] -= p.frequency_penalty * out_counts + p.presence_penalty * (out_counts > 0).to(logits.dtype)
    return logits


def mask_stop_tokens(logits: torch.Tensor, reqs: Sequence[SamplingReq], eos_token_ids: Sequence[int]) -> None:
    """Until a request has min_tokens outputs, its EOS (unless ignore_eos) and stop ids can't be drawn."""
    for i, req in enumerate(reqs):
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            continue
        stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))
        stop_ids = [t for t in stop_ids if 0 <= t < logits.shape[1]]
        if stop_ids:
            logits[i].index_fill_(0, to_device(stop_ids, torch.long, logits.device), float("-inf"))


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """logits: [num_reqs, vocab] -> probabilities after temperature, min_p, top_k, top_p."""
    device, vocab_size = logits.device, logits.shape[1]
    temperature = to_device([p.temperature for p in params], torch.float32, device)[:, None]
    logits = logits / temperature
    min_p = to_device([p.min_p for p in params], torch.float32, device)[:, None]
    probs = torch.softmax(logits, dim=-1)
    logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    top_k = to_device([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.long, device)
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (top_k - 1)[:, None])  # [num_reqs, 1]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = to_device([p.top_p for p in params], torch.float32, device)[:, None]
    return torch.softmax(apply_top_p(logits, top_p), dim=-1)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability sums to at least top_p (always >= 1 token)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)  # [num_reqs, vocab]
    drop = cum <= 1 - top_p
    drop[:, -1] = False
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def token_logprobs(
    chosen: float, top_ids: list[int], top_values: list[float], num_top: int | None
) -> TokenLogprobs | None:
    """One request's logprobs from the step's host copies: its sampled token's, and the first
    `num_top` of the step's top-k (the largest k any request asked for), all from the log_softmax
    of the unmodified logits. None when the request asked for none."""
    if num_top is None:
        return None
    if num_top == 0:
        return TokenLogprobs(logprob=chosen)
    return TokenLogprobs(chosen, top_ids[:num_top], top_values[:num_top])
