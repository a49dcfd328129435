"""A request's state inside the core, and its one lifecycle transition function."""

from __future__ import annotations

import enum

from ledgerserve.shared.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # transient: blocks freed, goes straight back to WAITING
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token / stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # the worker failed this request alone

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = (
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
)

_LEGAL_EDGES: dict[RequestStatus, tuple[RequestStatus, ...]] = {
    # a waiting request can end without running: an abort, a stop string matched on outputs
    # it had before a preemption, or a rejection (FINISHED_ERROR)
    RequestStatus.WAITING: (
        RequestStatus.RUNNING,
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    ),
    RequestStatus.RUNNING: (RequestStatus.PREEMPTED,) + _FINISHED,
    RequestStatus.PREEMPTED: (RequestStatus.WAITING,),
    RequestStatus.FINISHED_STOPPED: (),
    RequestStatus.FINISHED_LENGTH: (),
    RequestStatus.FINISHED_ABORTED: (),
    RequestStatus.FINISHED_ERROR: (),
}

FINISH_REASON_TO_STATUS: dict[str, RequestStatus] = {
    "stop": RequestStatus.FINISHED_STOPPED,
    "length": RequestStatus.FINISHED_LENGTH,
    "abort": RequestStatus.FINISHED_ABORTED,
    "error": RequestStatus.FINISHED_ERROR,
}


class IllegalTransition(RuntimeError):
    pass


class Request:
    """One request. `num_computed_tokens` counts tokens whose KV the workers hold (their steps
    completed); `num_in_flight_tokens` those scheduled in steps not completed yet, of which
    `num_pending_samples` are tokens still being sampled (ids unknown; async scheduling runs a
    request one step ahead of its newest token). `num_tokens_on_worker` / `num_blocks_on_worker`
    say what the workers were last sent, so a plan can send a running request as a delta."""

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        arrival_order: int,
        lora_name: str | None = None,
        version_id: int = 0,
        arrival_step: int = 0,
    ) -> None:
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling
        self.arrival_order = arrival_order  # explicit tie-break for every ordering
        self.lora_name = lora_name
        self.version_id = version_id  # adapter version, resolved at arrival; 0 = base model
        self.arrival_step = arrival_step  # the core's step counter at arrival (aging)
        self.namespace = version_id  # prefix-cache namespace: one per adapter version
        self.lora_slot = -1  # adapter GPU slot while running; -1 = base model or not running
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.num_pending_samples = 0  # 0 or 1: at most one step runs ahead of the newest token
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_shared_blocks = 0  # leading blocks of block_ids that sit in the prefix cache
        self.on_worker = False
        self.num_tokens_on_worker = 0
        self.num_blocks_on_worker = 0
        self.num_preemptions = 0
        self.num_prompt_logprobs_sent = 0  # prompt positions 1..n whose logprobs went out (a recompute repeats them)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] (0 <= start <= end), without building the whole list: the per-step
        deltas and cached blocks of a long request stay O(end - start)."""
        num_prompt = len(self.prompt_token_ids)
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def num_planned_tokens(self) -> int:
        """Tokens whose KV the workers hold or will hold once the steps in flight complete."""
        return self.num_computed_tokens + self.num_in_flight_tokens

    @property
    def num_unplanned_tokens(self) -> int:
        """Known or pending tokens not yet scheduled in any step."""
        return self.num_tokens + self.num_pending_samples - self.num_planned_tokens

    def forget_in_flight(self) -> None:
        """Steps in flight no longer count for this request (preempted: it recomputes)."""
        self.num_in_flight_tokens = 0
        self.num_pending_samples = 0

    def __repr__(self) -> str:
        tokens = f"tokens={self.num_tokens}, computed={self.num_computed_tokens}"
        return f"Request({self.req_id!r}, {self.status.name}, {tokens})"


def transition(req: Request, new_status: RequestStatus) -> None:
    """The only place a request's status changes; raises on an illegal edge."""
    if new_status not in _LEGAL_EDGES[req.status]:
        raise IllegalTransition(f"request {req.req_id!r}: illegal transition {req.status.name} -> {new_status.name}")
    req.status = new_status
