"""ModelRunner: the worker's compute core. Holds per-request state across steps, runs one
forward pass per StepPlan over a flat batch, samples, moves adapters into the CPU tier and
LoRA slots as told (beside the steps with overlapped loading: worker_proc/lora/loader.py),
and digests what it applied (block tables and the slot table as the commands set it). A step is launched (queued
on the device) and later completed (its sampled tokens read back), so that the next plan can
be launched in between (async scheduling, placeholders: worker_proc/requests.py)."""

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
from ledgerserve.shared.events import FailedReq, RankDigest, SampledToken, StepCompleted, StepPlan, WorkerReady
from ledgerserve.worker_proc import prompt_logprobs
from ledgerserve.worker_proc.adapter_commands import AdapterCommands
from ledgerserve.worker_proc.cuda_graphs import DecodeGraphs
from ledgerserve.worker_proc.forward import Forward
from ledgerserve.worker_proc.kv_cache import KVCache, num_kv_blocks
from ledgerserve.worker_proc.lora.manager import LoraManager
from ledgerserve.worker_proc.mixed_graphs import MixedGraphs
from ledgerserve.worker_proc.models.config import load_eos_token_ids, load_model_config
from ledgerserve.worker_proc.models.loader import build_model
from ledgerserve.worker_proc.parallel import TpGroup, use_rank_device, with_one_shot
from ledgerserve.worker_proc.pinned_staging import PinnedStaging
from ledgerserve.worker_proc.requests import Requests
from ledgerserve.worker_proc.sampler import PendingSample, Sampler
from ledgerserve.worker_proc.step_inputs import StepInputBuilder, build_step_inputs
from ledgerserve.worker_proc.warm_up import serving_batches, warm_up_batches

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
        self.fault_token_id = env.fault_token_id()  # test-only: see requests.check_fault
        self.requests = Requests(config, num_blocks, self.lora, self.fault_token_id)
        self.prev_token_ids: torch.Tensor | None = None  # [num_sampling] int64: the last launched step's, on the device
        self.staging = PinnedStaging(self.device) if self.device.type == "cuda" else None
        self.graphs, self.mixed = self._build_graphs(num_blocks) if use_graphs else (None, None)
        self.inputs = StepInputBuilder(config.block_size, self.device, self.staging, self.graphs, self.mixed)
        vocab_size = self.model_cfg.vocab_size
        graphs = (self.graphs, self.mixed)
        self.forward = Forward(self.model, self.kv_cache, graphs, self.lora, rank, self.group.size, vocab_size)
        if self.device.type == "cuda":
            self.warm_up()

    def _build_graphs(self, num_blocks: int) -> tuple[DecodeGraphs, MixedGraphs | None]:
        """Capture the decode CUDA graphs (worker_proc/cuda_graphs.py) over this rank's KV cache, and
        on one rank the mixed-step graphs (worker_proc/mixed_graphs.py) in the same memory pool.
        Not under tensor parallelism: its all-reduces in a mixed step are not captured yet."""
        cfg = self.config
        width, scratch_kv_slot = -(-cfg.max_model_len // cfg.block_size), num_blocks * cfg.block_size
        graphs = DecodeGraphs(
            self.model,
            self.kv_cache.layers,
            scratch_kv_slot,
            width,
            cfg.max_num_seqs,
            cfg.enable_lora,
            self.device,
            cfg.max_loras,
        )
        graphs.capture()
        if self.group.size > 1:
            return graphs, None
        limits, max_loras = (cfg.max_num_batched_tokens, cfg.max_num_seqs), cfg.max_loras if cfg.enable_lora else 0
        group = self.model_cfg.num_local_heads // self.model_cfg.num_local_kv_heads
        mixed = MixedGraphs(
            self.model, self.kv_cache.layers, scratch_kv_slot, width, limits, max_loras, group, self.device
        )
        graphs.pool = mixed.capture(graphs.pool)
        return graphs, mixed

    def _build_lora(self) -> LoraManager:
        with open(os.path.join(self.config.model_dir, "config.json"), encoding="utf-8") as f:
            base = BaseShapes.from_hf_config(json.load(f))
        return LoraManager(self.model, self.config, base, self.dtype, self.device, self.rank)

    def warm_up(self) -> None:
        """Run worker_proc/warm_up.py's batches through the forward pass and the sampler, and drop
        them: the Triton kernels of prefill, mixed batches and sampling are compiled, and the GEMMs
        and allocator of serving-sized steps that run eagerly (no mixed graph holds them) warmed,
        before the first request, not during it."""
        lora_slot = 0 if self.lora is not None else -1
        shape = (self.config.block_size, self.kv_cache.num_blocks, self.config.max_model_len, self.model_cfg.vocab_size)
        batches = warm_up_batches(*shape, lora_slot)
        max_tokens = self.config.max_num_batched_tokens
        if self.mixed is None or max_tokens > self.mixed.token_buckets[-1]:
            batches += serving_batches(*shape, lora_slot, max_tokens)
        with self.lora.zero_adapter(lora_slot) if self.lora is not None else contextlib.nullcontext():
            for reqs in batches:  # eager: the graphs compiled theirs
                inputs = build_step_inputs(reqs, self.config.block_size, self.device, self.staging)
                logits, _ = self.forward.logits(inputs)
                if logits is not None:
                    self.sampler.sample(logits, [r.sampling_req() for r in reqs if r.samples])

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
        batch = self.requests.apply(plan)  # per-request state, checks, placeholders
        inputs = self.inputs.build(batch, self.prev_token_ids)  # the step's tensors, or a graph's row
        out = self.forward.run(batch, inputs)  # logits (and prompt logprobs), queued
        pending = self.sampler.launch(out.logits, batch.sampling_reqs) if out.logits is not None else None
        self.prev_token_ids = pending.token_ids if pending is not None else None
        digest = RankDigest(plan.step, self.rank, self.digest())  # on the host while the device runs the step
        return InFlightStep(plan.step, [r.req_id for r in batch.sampling], pending, batch.failed, digest, out.prompt)

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
        reqs = self.requests.reqs
        tables = [[req_id, reqs[req_id].block_ids] for req_id in sorted(reqs)]
        slots = self.lora.digest_table() if self.lora is not None else []
        return xxhash.xxh64_intdigest(msgspec.msgpack.encode([tables, slots]))


def num_weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of the weights a rank holds: every parameter of its model, by element (projections,
    biases, norms, embedding; a tied lm_head once; padded vocabulary rows and a row-parallel bias held
    as zeros included). The loader fills each parameter from the checkpoint, and the model registers
    no buffers. Not weights: the KV cache and LoRA slot buffers (outside the parameters; a stacked
    layer's weight views only its own rows of the tensor it shares with LoRA A) and the rotary cache."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
