"""Per-request worker state across steps: what a plan says about each request (new ones in full,
running ones as deltas), its checks, and its placeholder token. `Requests.apply` turns one
StepPlan into the step's batch (worker_proc/step_inputs.py builds its tensors from it).

Placeholder tokens, for async scheduling: the scheduler may plan step N+1 before it has read step
N's sampled tokens, and so schedule a request's next decode token while no host knows its id yet.
That is legal only when this worker sampled that very token in the step it launched just before;
the token's id is then taken from that step's sampled tokens on the device, after the step's inputs
are uploaded (step_inputs.fill_placeholders), so launching never waits on the GPU."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import CachedReq, FailedReq, NewReq, StepPlan
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.lora.manager import LoraManager
from ledgerserve.worker_proc.sampler import SamplingReq


@dataclass
class ReqState:
    """What the worker holds for one request between steps (mirrors the scheduler's view)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs known so far
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    lora_slot: int
    # this step's placeholder: the row of the previous step's sampled tokens that holds the input id
    # of token len(token_ids), not yet known on the host (async scheduling); -1 when none
    placeholder_row: int = -1

    @staticmethod
    def from_new(req: NewReq) -> ReqState:
        return ReqState(
            req.req_id,
            list(req.token_ids),
            req.num_prompt_tokens,
            req.sampling,
            list(req.block_ids),
            req.num_computed_tokens,
            req.num_scheduled_tokens,
            req.lora_slot,
        )

    def apply_delta(self, delta: CachedReq) -> None:
        self.token_ids.extend(delta.new_token_ids)
        self.block_ids.extend(delta.new_block_ids)
        self.num_computed_tokens = delta.num_computed_tokens
        self.num_scheduled_tokens = delta.num_scheduled_tokens
        self.lora_slot = delta.lora_slot
        self.placeholder_row = -1

    @property
    def num_tokens_after_step(self) -> int:
        return self.num_computed_tokens + self.num_scheduled_tokens

    @property
    def num_known_tokens(self) -> int:
        """The tokens this step may compute: those on the host, and a placeholder's pending one."""
        return len(self.token_ids) + (self.placeholder_row >= 0)

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the known tokens (prefill done, or decode)."""
        return self.num_scheduled_tokens > 0 and self.num_tokens_after_step == self.num_known_tokens

    def step_input_ids(self) -> list[int]:
        """The token ids this step computes; a placeholder's is 0 here, written on the device later."""
        ids = self.token_ids[self.num_computed_tokens : self.num_tokens_after_step]
        return ids + [0] if self.placeholder_row >= 0 else ids

    def sampling_req(self) -> SamplingReq:
        """What the sampler reads of this request at this step."""
        return SamplingReq(self.sampling, self.token_ids, self.num_prompt_tokens, int(self.placeholder_row >= 0))


@dataclass(frozen=True)
class StepBatch:
    """One StepPlan applied: the requests this step computes, in plan order, and what a step reads of them."""

    step: int
    scheduled: list[ReqState]
    sampling: list[ReqState]  # those of `scheduled` that sample, in order (the rows of the logits)
    sampling_reqs: list[SamplingReq]  # theirs, for the sampler
    lora_slots: list[int]  # the distinct adapter slots the step reads, sorted
    failed: list[FailedReq]  # requests whose update was invalid: each failed alone


class Requests:
    """The requests a rank holds, by id, and the rows of the previous launched step's sampled tokens
    (req_id -> (its row, the index in the request of the token it sampled)), for placeholders."""

    def __init__(self, config: EngineConfig, num_blocks: int, lora: LoraManager | None, fault_token_id: int | None):
        self.config, self.num_blocks, self.lora, self.fault_token_id = config, num_blocks, lora, fault_token_id
        self.reqs: dict[str, ReqState] = {}
        self.prev_sampled_rows: dict[str, tuple[int, int]] = {}

    def apply(self, plan: StepPlan) -> StepBatch:
        """End the plan's finished and preempted requests and update the others; a request whose
        update is invalid fails alone. Its sampling requests' rows are kept for the next plan's placeholders."""
        for req_id in [*plan.finished_req_ids, *plan.preempted_req_ids]:
            self.reqs.pop(req_id, None)
        scheduled: list[ReqState] = []
        failed: list[FailedReq] = []
        for update in [*plan.new_reqs, *plan.cached_reqs]:
            try:
                req = self._update(update)
            except ValueError as e:
                self.reqs.pop(update.req_id, None)
                failed.append(FailedReq(update.req_id, str(e)))
                continue
            if req.num_scheduled_tokens > 0:
                scheduled.append(req)
        sampling = [r for r in scheduled if r.samples]
        self.prev_sampled_rows = {r.req_id: (i, r.num_tokens_after_step) for i, r in enumerate(sampling)}
        lora_slots = sorted({r.lora_slot for r in scheduled if r.lora_slot >= 0})
        return StepBatch(plan.step, scheduled, sampling, [r.sampling_req() for r in sampling], lora_slots, failed)

    def _update(self, update: NewReq | CachedReq) -> ReqState:
        """Apply one request's update and check it (ValueError: it fails)."""
        if isinstance(update, NewReq):
            if update.req_id in self.reqs:
                raise ValueError(f"request {update.req_id!r} sent as new but already held")
            req = self.reqs[update.req_id] = ReqState.from_new(update)
            new_blocks = update.block_ids
        else:
            held = self.reqs.get(update.req_id)
            if held is None:
                raise ValueError(f"request {update.req_id!r} sent as cached but not held")
            req = held
            req.apply_delta(update)
            mark_placeholder(req, self.prev_sampled_rows)
            new_blocks = update.new_block_ids
        validate_req(req, new_blocks, self.config.block_size, self.num_blocks, self.config.max_model_len)
        check_lora_slot(req.lora_slot, self.lora, self.config.max_loras)
        check_fault(req, self.fault_token_id)
        return req

    def block_tables(self) -> list[list[str | list[int]]]:
        """[[req_id, block_ids], ...] sorted by req_id, for the rank's digest."""
        return [[req_id, self.reqs[req_id].block_ids] for req_id in sorted(self.reqs)]


def mark_placeholder(req: ReqState, prev_rows: dict[str, tuple[int, int]]) -> None:
    """Give `req` a placeholder when its step is the one token past the known ones that the
    previous launched step sampled for it (`prev_rows`). Any other step past the known tokens is
    left as it is, for validate_req to reject. A penalised request can't take a placeholder: its
    penalties need the pending token's id on the host."""
    if req.num_scheduled_tokens != 1 or req.num_computed_tokens != len(req.token_ids):
        return
    row, sampled_index = prev_rows.get(req.req_id, (-1, -1))
    if sampled_index != len(req.token_ids):
        return
    if req.sampling.penalised:
        raise ValueError(
            f"token {len(req.token_ids)} is scheduled before its id is known, but penalties "
            "need it on the host: a penalised request can't be scheduled ahead"
        )
    req.placeholder_row = row


def validate_req(
    req: ReqState, new_block_ids: Sequence[int], block_size: int, num_blocks: int, max_model_len: int
) -> None:
    """Raise ValueError if this request's step can't be run; it fails alone. Block ids are
    range-checked as they arrive (`new_block_ids`), so a step costs O(new blocks), not O(context)."""
    end = req.num_tokens_after_step
    if req.num_computed_tokens < 0 or req.num_scheduled_tokens < 0:
        raise ValueError("negative token counts")
    if not 0 < req.num_prompt_tokens <= len(req.token_ids):
        raise ValueError(f"num_prompt_tokens {req.num_prompt_tokens} out of range for {len(req.token_ids)} tokens")
    if end > req.num_known_tokens:
        raise ValueError(f"scheduled up to token {end} but only {len(req.token_ids)} tokens are known")
    if end > max_model_len:
        raise ValueError(f"{end} tokens exceed max_model_len {max_model_len}")
    if len(req.block_ids) * block_size < end:
        raise ValueError(f"{len(req.block_ids)} blocks can't hold {end} tokens")
    if any(not 0 <= b < num_blocks for b in new_block_ids):
        raise ValueError(f"block id out of range [0, {num_blocks})")


def check_lora_slot(slot: int, lora: LoraManager | None, max_loras: int) -> None:
    """Raise ValueError unless `slot` is the base model (-1) or holds a loaded adapter (a load
    still under way for it finishes its host side first)."""
    if slot == -1:
        return
    if lora is None:
        raise ValueError(f"LoRA slot {slot} requested but LoRA is not enabled")
    if 0 <= slot < max_loras:
        lora.loader.ensure_ready(slot)
        if lora.loader.failure(slot):
            raise ValueError(lora.loader.failure(slot))
    if slot not in lora.slots:
        raise ValueError(f"LoRA slot {slot} holds no loaded adapter")


def check_fault(req: ReqState, fault_token_id: int | None) -> None:
    """Test-only fault switch: raise while preparing a request whose prompt holds
    `fault_token_id` (env LEDGERSERVE_TEST_FAULT_TOKEN_ID), so it fails alone."""
    if fault_token_id is not None and fault_token_id in req.token_ids[: req.num_prompt_tokens]:
        raise ValueError(f"test fault: the prompt holds token id {fault_token_id}")
