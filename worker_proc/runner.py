"""ModelRunner: the worker's compute core. Holds per-request state across steps, runs one
forward pass per StepPlan over a flat batch, samples, moves adapters into the CPU tier and
LoRA slots as told (beside the steps with overlapped loading: worker_proc/lora/loader.py),
and digests what it applied (block tables and the slot table as the commands set it). A step is launched (queued
on the device) and later completed (its sampled tokens read back), so that the next plan can
be launched in between (async scheduling, worker_proc/placeholders.py)."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass

import msgspec
import torch
import xxhash

from ledgerserve.kernels import ops
from ledgerserve.shared import env
from ledgerserve.shared.adapter_format import BaseShapes
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import (
    CachedReq,
    FailedReq,
    NewReq,
    RankDigest,
    SampledToken,
    StepCompleted,
    StepPlan,
    WorkerReady,
)
from ledgerserve.worker_proc import prompt_logprobs
from ledgerserve.worker_proc.adapter_commands import AdapterCommands
from ledgerserve.worker_proc.batch import ReqState, check_fault, validate_req
from ledgerserve.worker_proc.cuda_graphs import DecodeGraphs
from ledgerserve.worker_proc.kv_cache import KVCache, num_kv_blocks
from ledgerserve.worker_proc.lora.manager import LoraManager
from ledgerserve.worker_proc.models import build_model, load_eos_token_ids, load_model_config
from ledgerserve.worker_proc.parallel import TpGroup, use_rank_device, with_one_shot
from ledgerserve.worker_proc.placeholders import SampledRows, mark_placeholder
from ledgerserve.worker_proc.sampler import PendingSample, Sampler, SamplingReq
from ledgerserve.worker_proc.step_inputs import PinnedStaging, build_step_inputs
from ledgerserve.worker_proc.warm_up import warm_up_batches

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class InFlightStep:
    """A launched step whose sampled tokens are not read back yet (ModelRunner.launch -> complete)."""

    step: int
    sampling_req_ids: list[str]  # in the order of the sampled tokens
    pending: PendingSample | None  # None when no request samples
    failed: list[FailedReq]  # requests that failed at launch
    digest: RankDigest
    prompt: prompt_logprobs.PendingPromptLogprobs | None = None  # rank 0, when a request asks for them

    def is_done(self) -> bool:
        """Whether reading the step back would not wait: its tokens (and prompt logprobs) reached the host."""
        return all(p is None or p.host.is_ready() for p in (self.pending, self.prompt))


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, group: TpGroup | None = None) -> None:
        """`group`: the tensor-parallel group (worker_proc/parallel.py), made by the worker process
        before the runner; the model, KV cache and LoRA slots hold its rank's shard. None: one rank."""
        self.config = config
        self.rank = rank
        self.device = use_rank_device(config.device, rank)
        self.dtype = DTYPES[config.dtype]
        self.group = with_one_shot(group or TpGroup(), self.dtype, self.device, not config.disable_custom_all_reduce)
        torch.manual_seed(config.seed)
        self.model_cfg = load_model_config(config.model_dir)
        window = self.model_cfg.sliding_window
        if window is not None and config.max_model_len > window:
            raise ValueError(f"sliding-window attention ({window}) is not supported; use max_model_len <= {window}")
        self.eos_token_ids = load_eos_token_ids(config.model_dir)
        self.model = build_model(
            self.model_cfg, config.model_dir, config.load_format, self.dtype, self.device, config.seed, rank, self.group
        )
        self.lora = self._build_lora() if config.enable_lora else None  # before KV sizing: its buffers count
        self.adapters = AdapterCommands(config, rank, self.lora)  # the adapter commands, beside the steps
        num_blocks = num_kv_blocks(config, self.model.cfg, self.dtype, self.device)  # of this rank's KV heads
        use_graphs = self.device.type == "cuda" and not config.enforce_eager and self.dtype in ops.TRITON_DTYPES
        self.kv_cache = KVCache(
            self.model.cfg,
            num_blocks,
            config.block_size,
            self.dtype,
            self.device,
            scratch_blocks=1 if use_graphs else 0,
        )
        self.sampler = Sampler(self.eos_token_ids, config.seed, self.device)
        self.reqs: dict[str, ReqState] = {}
        self.prev_sampled = SampledRows()  # the last launched step's, for placeholders
        self.staging = PinnedStaging(self.device) if self.device.type == "cuda" else None
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            width = -(-config.max_model_len // config.block_size)
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_cache.layers,
                num_blocks * config.block_size,
                width,
                config.max_num_seqs,
                config.enable_lora,
                self.device,
                config.max_loras,
            )
            self.graphs.capture()
        if self.device.type == "cuda":
            self.warm_up()
        self.fault_token_id = env.fault_token_id()  # test-only: see batch.check_fault

    def _build_lora(self) -> LoraManager:
        with open(os.path.join(self.config.model_dir, "config.json"), encoding="utf-8") as f:
            base = BaseShapes.from_hf_config(json.load(f))
        return LoraManager(self.model, self.config, base, self.dtype, self.device, self.rank)

    def warm_up(self) -> None:
        """Run worker_proc/warm_up.py's batches through the forward pass and the sampler, and drop
        them: the Triton kernels of prefill, mixed batches and sampling are compiled before the
        first request, not during it."""
        lora_slot = 0 if self.lora is not None else -1
        batches = warm_up_batches(
            self.config.block_size,
            self.kv_cache.num_blocks,
            self.config.max_model_len,
            self.model_cfg.vocab_size,
            lora_slot,
        )
        with self.lora.zero_adapter(lora_slot) if self.lora is not None else contextlib.nullcontext():
            for reqs in batches:
                logits, sampling, _ = self._forward(reqs, use_graphs=False)  # the graphs compiled theirs
                if logits is not None:
                    self.sampler.sample(logits, [_sampling_req(r) for r in sampling])

    def ready(self) -> WorkerReady:
        return WorkerReady(
            rank=self.rank,
            num_kv_blocks=self.kv_cache.num_blocks,
            vocab_size=self.model_cfg.vocab_size,
            eos_token_ids=list(self.eos_token_ids),
            device=str(self.device),
            dtype=self.config.dtype,
            num_weight_bytes=num_weight_bytes(self.model),
        )

    def close(self) -> None:
        if self.lora is not None:
            self.lora.close()

    def execute(self, plan: StepPlan) -> tuple[StepCompleted, RankDigest]:
        """One step, launched and read back at once (a scheduler in step)."""
        return self.complete(self.launch(plan))

    def launch(self, plan: StepPlan) -> InFlightStep:
        """Apply the plan and queue its forward pass and sampling; nothing waits on the device.
        The sampled tokens stay on the device for the next step's placeholders."""
        for req_id in [*plan.finished_req_ids, *plan.preempted_req_ids]:
            self.reqs.pop(req_id, None)
        scheduled, failed = self._apply_plan(plan)
        lora_slots = sorted({r.lora_slot for r in scheduled if r.lora_slot >= 0})
        if self.lora is not None:  # the compute stream waits for the copies of the slots it reads
            self.lora.prepare(lora_slots)
        logits, sampling, hidden = self._forward(scheduled) if scheduled else (None, [], None)
        pending = None
        if logits is not None:
            pending = self.sampler.launch(logits, [_sampling_req(r) for r in sampling])
        self.prev_sampled = SampledRows.of(pending.token_ids, sampling) if pending is not None else SampledRows()
        prompt = self._launch_prompt_logprobs(scheduled, hidden)
        if self.lora is not None:  # a write into these slots now waits for this step
            self.lora.note_step(lora_slots)
        digest = RankDigest(plan.step, self.rank, self.digest())  # on the host while the device runs the step
        return InFlightStep(plan.step, [r.req_id for r in sampling], pending, failed, digest, prompt)

    def complete(self, step: InFlightStep) -> tuple[StepCompleted, RankDigest]:
        """Read back a launched step's sampled tokens (its one device -> host sync)."""
        sampled = []
        if step.pending is not None:
            sampled = [
                SampledToken(req_id, s.token_id, s.logprobs)
                for req_id, s in zip(step.sampling_req_ids, self.sampler.finish(step.pending))
            ]
        prompt, failed = prompt_logprobs.finish(step.prompt) if step.prompt is not None else ([], [])
        completed = StepCompleted(step.step, self.rank, sampled if self.rank == 0 else [], step.failed + failed, prompt)
        return completed, step.digest

    def digest(self) -> int:
        """xxhash64 of the block tables (sorted by req_id) and the slot table as the commands set it
        (slot -> version_id, content digest; sorted by slot; not when loads end), as canonical msgpack."""
        tables = [[req_id, self.reqs[req_id].block_ids] for req_id in sorted(self.reqs)]
        slots = self.lora.digest_table() if self.lora is not None else []
        return xxhash.xxh64_intdigest(msgspec.msgpack.encode([tables, slots]))

    def _apply_plan(self, plan: StepPlan) -> tuple[list[ReqState], list[FailedReq]]:
        """Update held state from the plan; a request whose update is invalid fails alone."""
        scheduled: list[ReqState] = []
        failed: list[FailedReq] = []
        updates: list[NewReq | CachedReq] = [*plan.new_reqs, *plan.cached_reqs]
        for update in updates:
            req_id = update.req_id
            try:
                req = self._update_req(update)
                new_blocks = update.block_ids if isinstance(update, NewReq) else update.new_block_ids
                validate_req(
                    req, new_blocks, self.config.block_size, self.kv_cache.num_blocks, self.config.max_model_len
                )
                self._check_lora_slot(req.lora_slot)
                check_fault(req, self.fault_token_id)
            except ValueError as e:
                self.reqs.pop(req_id, None)
                failed.append(FailedReq(req_id, str(e)))
                continue
            if req.num_scheduled_tokens > 0:
                scheduled.append(req)
        return scheduled, failed

    def _check_lora_slot(self, slot: int) -> None:
        """Raise ValueError unless `slot` is the base model (-1) or holds a loaded adapter (a load
        still under way for it finishes its host side first)."""
        if slot == -1:
            return
        if self.lora is None:
            raise ValueError(f"LoRA slot {slot} requested but LoRA is not enabled")
        if 0 <= slot < self.config.max_loras:
            self.lora.loader.ensure_ready(slot)
            if self.lora.loader.failure(slot):
                raise ValueError(self.lora.loader.failure(slot))
        if slot not in self.lora.slots:
            raise ValueError(f"LoRA slot {slot} holds no loaded adapter")

    def _update_req(self, update: NewReq | CachedReq) -> ReqState:
        if isinstance(update, NewReq):
            if update.req_id in self.reqs:
                raise ValueError(f"request {update.req_id!r} sent as new but already held")
            req = ReqState.from_new(update)
            self.reqs[req.req_id] = req
            return req
        req = self.reqs.get(update.req_id)
        if req is None:
            raise ValueError(f"request {update.req_id!r} sent as cached but not held")
        req.apply_delta(update)
        mark_placeholder(req, self.prev_sampled)
        return req

    def _forward(
        self, scheduled: list[ReqState], use_graphs: bool = True
    ) -> tuple[torch.Tensor | None, list[ReqState], torch.Tensor | None]:
        """Queue the step's forward pass: the logits [num_sampling, vocab] float32 of the requests
        that sample this step (None if none does), those requests, and the final hidden states
        [num_tokens, hidden] (None from a CUDA graph: a pure decode step has no prompt rows)."""
        prev = self.prev_sampled.token_ids
        if use_graphs and self.graphs is not None and self.staging is not None and self.graphs.fits(scheduled):
            return self.graphs.run(scheduled, self.config.block_size, self.staging, prev), scheduled, None
        inputs = build_step_inputs(scheduled, self.config.block_size, self.device, self.staging, prev)
        hidden = self.model(inputs, self.kv_cache.layers)
        if not inputs.sample_indices.numel():
            return None, [], hidden
        logits = self.model.compute_logits(hidden[inputs.sample_indices], inputs.sample_lora)
        return logits, [r for r in scheduled if r.samples], hidden

    def _launch_prompt_logprobs(
        self, scheduled: list[ReqState], hidden: torch.Tensor | None
    ) -> prompt_logprobs.PendingPromptLogprobs | None:
        """Rank 0's prompt logprobs; the other ranks of a group run lm_head with it (its gather)."""
        if self.rank != 0 and self.group.size == 1:  # a replica: rank 0 alone scores them
            return None
        rows = prompt_logprobs.prompt_rows(scheduled)
        if not rows.spans:
            return None
        if hidden is None:
            raise RuntimeError("prompt rows in a step run by a CUDA graph, which holds pure decode steps only")
        if self.rank != 0:
            prompt_logprobs.join(self.model, hidden, rows)
            return None
        return prompt_logprobs.launch(self.model, hidden, rows, self.model_cfg.vocab_size)


def num_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of the weights a rank holds: every parameter of its model, by element (projections,
    biases, norms, embedding; a tied lm_head once; padded vocabulary rows and a row-parallel bias held
    as zeros included). The loader fills each parameter from the checkpoint, and the model registers
    no buffers. Not weights: the KV cache and LoRA slot buffers (outside the parameters; a stacked
    layer's weight views only its own rows of the tensor it shares with LoRA A) and the rotary cache."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _sampling_req(req: ReqState) -> SamplingReq:
    return SamplingReq(req.sampling, req.token_ids, req.num_prompt_tokens, int(req.placeholder_row >= 0))
