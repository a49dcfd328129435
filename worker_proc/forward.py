"""A step's forward pass over its inputs: a CUDA graph's replay for a pure decode step (logits
included) or for another step within the mixed graphs' buckets (hidden states), else the
model eagerly, then the logits of the rows that sample and (rank 0, or every rank of a TP group for
lm_head's gather) the prompt logprobs asked for. The LoRA slots the step reads are fenced around it:
the compute stream first waits for their copies, and a later write into them waits for the step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ledgerserve.worker_proc import prompt_logprobs
from ledgerserve.worker_proc.cuda_graphs import DecodeGraphs
from ledgerserve.worker_proc.kv_cache import KVCache
from ledgerserve.worker_proc.lora.manager import LoraManager
from ledgerserve.worker_proc.mixed_graphs import MixedGraphs, MixedStep
from ledgerserve.worker_proc.requests import ReqState, StepBatch
from ledgerserve.worker_proc.step_inputs import GraphStep, StepInputs


@dataclass(frozen=True)
class Forwarded:
    """What a step's forward pass queued on the device."""

    logits: torch.Tensor | None  # [num_sampling, vocab] float32; None when no request samples
    prompt: prompt_logprobs.PendingPromptLogprobs | None  # rank 0, when a request asks for them


class Forward:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        graphs: tuple[DecodeGraphs | None, MixedGraphs | None],
        lora: LoraManager | None,
        rank: int,
        group_size: int,
        vocab_size: int,
    ) -> None:
        self.model, self.kv_cache, self.lora = model, kv_cache, lora
        self.graphs, self.mixed = graphs
        self.rank, self.group_size, self.vocab_size = rank, group_size, vocab_size

    def run(self, batch: StepBatch, inputs: StepInputs | GraphStep | MixedStep | None) -> Forwarded:
        """Queue the step's forward pass (`inputs` None: the step computes nothing); nothing waits on the device."""
        if self.lora is not None:  # the compute stream waits for the copies of the slots it reads
            self.lora.prepare(batch.lora_slots)
        logits, hidden = self.logits(inputs) if inputs is not None else (None, None)
        prompt = self._prompt_logprobs(batch.scheduled, hidden)
        if self.lora is not None:  # a write into these slots now waits for this step
            self.lora.note_step(batch.lora_slots)
        return Forwarded(logits, prompt)

    def logits(self, inputs: StepInputs | GraphStep | MixedStep) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The logits [num_sampling, vocab] float32 of the rows that sample (None if none does), and the
        final hidden states [num_tokens, hidden] (None from a decode graph: a pure decode step has no prompt rows)."""
        if isinstance(inputs, GraphStep):
            assert self.graphs is not None
            return self.graphs.replay(inputs), None
        if isinstance(inputs, MixedStep):
            assert self.mixed is not None
            hidden = self.mixed.replay(inputs)  # [num_tokens, hidden]
        else:
            hidden = self.model(inputs, self.kv_cache.layers)  # [num_tokens, hidden]
        if not inputs.sample_indices.numel():
            return None, hidden
        return self.model.compute_logits(hidden[inputs.sample_indices], inputs.sample_lora), hidden

    def _prompt_logprobs(
        self, scheduled: Sequence[ReqState], hidden: torch.Tensor | None
    ) -> prompt_logprobs.PendingPromptLogprobs | None:
        """Rank 0's prompt logprobs; the other ranks of a group run lm_head with it (its gather)."""
        if self.rank != 0 and self.group_size == 1:  # a replica: rank 0 alone scores them
            return None
        rows = prompt_logprobs.prompt_rows(scheduled)
        if not rows.spans:
            return None
        if hidden is None:
            raise RuntimeError("prompt rows in a step run by a CUDA graph, which holds pure decode steps only")
        if self.rank != 0:
            prompt_logprobs.join(self.model, hidden, rows)
            return None
        return prompt_logprobs.launch(self.model, hidden, rows, self.vocab_size)
