"""Every message between processes, and every record in the event log.

One tagged union per channel (docs/architecture.md, "Events per channel"). Structs are
frozen, tagged by class name and encoded as msgpack arrays. New fields go at the end with
a default; fields are never reordered or removed, so old logs still decode.
"""

from __future__ import annotations

from typing import Union

import msgspec

from ledgerserve.shared.sampling import SamplingParams


class Event(msgspec.Struct, frozen=True, tag=True, array_like=True, omit_defaults=True):
    """Base of every event; the tag is the class name."""


# ---------------------------------------------------------------- tokenizer -> scheduler


class RequestArrived(Event):
    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time_s: float = 0.0  # wall clock, stamped by the tokenizer process
    lora_name: str | None = None  # None: the base model
    lora_version_id: int = 0  # the version lora_name had when the HTTP process resolved it; 0: unchecked
    # lora_name was registered on demand: the load that registers it again, should it have been
    # unregistered (least recently used) after the HTTP process resolved it and before this arrived
    on_demand: OnDemandLoad | None = None


class OnDemandLoad(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """An on-demand adapter's load as the HTTP process validated it (AdapterLoadRequested's fields)."""

    path: str  # real path of the adapter directory
    max_rank: int
    num_bytes: int
    content_sha256: str = ""  # SHA-256 of the files as the HTTP process read them, hex


class RequestAborted(Event):
    """The client went away (`reason="abort"`) or a stop string matched (`"stop"`)."""

    req_id: str
    reason: str = "abort"


class AdapterLoadRequested(Event):
    """Register a new version of adapter `name`, already validated by the HTTP process
    (`shared.adapter_format.read_manifest`). The core assigns the version id."""

    op_id: str
    name: str
    path: str  # real path of the adapter directory
    max_rank: int
    num_bytes: int
    load_inplace: bool = False
    content_digest: int = 0  # older logs: xxh64 of the files; passed through, never checked again
    on_demand: bool = False  # loaded by a request naming it; the core may unregister it when idle (max_on_demand_loras)
    pinned: bool = False  # keeps a GPU slot from registration to unload; never unregistered implicitly
    content_sha256: str = ""  # SHA-256 of the files as the HTTP process read them (shared.adapter_digest), hex


class AdapterUnloadRequested(Event):
    op_id: str
    name: str


# ---------------------------------------------------------------- scheduler -> tokenizer


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    logprob: float  # of the sampled token
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """vLLM's prompt logprobs of one request for the prompt positions `start` (>= 1) onward that one
    step computed: at each, the log-softmax of the logits at the position before (raw, unmodified
    by sampling), read at the prompt token there and at the top k. Finite: -inf is sent as -9999.0."""

    req_id: str
    start: int  # prompt position of the first entry
    logprobs: list[float]  # of the prompt token, per position
    ranks: list[int]  # of the prompt token (1 = most likely; ties count against it), per position
    top_token_ids: list[list[int]] = []  # per position, the k most likely tokens (k = prompt_logprobs)
    top_logprobs: list[list[float]] = []


class TokensEmitted(Event):
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    logprobs: list[TokenLogprobs] | None = None  # one per new token when asked for
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    stop_token_id: int | None = None  # the stop/EOS id that finished it, if any
    prompt_logprobs: PromptLogprobs | None = None  # positions not sent before; they precede the first token


class RequestRejected(Event):
    """The core refuses a request it can never serve (e.g. it can't fit in the KV pool)."""

    req_id: str
    message: str
    code: int = 400
    param: str | None = None


class AdapterOpReplied(Event):
    """The core's answer to an adapter load/unload: `code` 200 on success, else an HTTP
    status with `message`. What the op changed in the registry reaches the HTTP process just
    before it, in AdapterRegistryChanged."""

    op_id: str
    code: int
    message: str = ""
    version_id: int = 0
    adapters: list[AdapterInfo] = []  # empty; logs of schema 4 and before: the whole registry after the op


class AdapterInfo(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    name: str
    version_id: int
    path: str
    pinned: bool = False
    on_demand: bool = False


class EngineReady(Event):
    """Every worker rank is up; the engine can serve."""

    num_kv_blocks: int
    vocab_size: int


class EngineStats(Event):
    """Gauges of the core's state, sent after each step and when the engine goes idle.
    Derived from logged state, so not logged itself."""

    step: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    num_pinned_slots: int = 0
    num_deferred_evictions: int = 0
    num_cached_blocks: int = 0  # in the prefix cache, reclaimable when unlocked
    num_loading_slots: int = 0  # adapter slot loads in flight (overlapped loading)
    num_cpu_tier_versions: int = 0  # adapter versions in the workers' CPU tier
    cpu_tier_bytes: int = 0  # their bytes (as registered)
    num_lora_wait_steps: int = 0  # cumulative: steps that left a request waiting only on its adapter's load
    adapter_rows: list[AdapterRow] = []  # the registered adapters whose row changed since the last EngineStats
    num_used_slots: int = 0  # adapter slots holding a version (loading, loaded or pinned)
    lora_wait_ms: float = 0.0  # cumulative: adapter requests' waits for their adapter's load, where timed
    num_available_blocks: int = 0  # free blocks plus cached blocks no request holds (reclaimable)


class AdapterRow(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """One registered adapter as the event log tells it (scheduler_proc.views.adapter_stats):
    where its current version is, its requests now, and its token counts since it was registered."""

    name: str
    version_id: int
    tier: str  # "gpu" (in a slot loaded on every rank), "cpu" (staged on every rank) or "disk"
    pinned: bool = False
    num_running: int = 0
    num_waiting: int = 0
    num_prompt_tokens: int = 0  # of its finished requests
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache


class AdapterLoadObserved(Event):
    """A slot load of a registered adapter ended on every rank (derived from the logged
    AdapterLoadCompleted inputs, so not logged itself): the slowest rank's duration, and
    "disk" if any rank read the files."""

    name: str
    version_id: int
    source_tier: str
    duration_ms: float


class AdapterRegistryChanged(Event):
    """Names whose registration one input's decisions changed (an op, an on-demand registration
    unregistering the least recently used one, a failed load), as they stand after it: the new
    current version, or gone. Derived from logged state (the core's registry), so not logged
    itself; sent before that input's decisions, so the HTTP process's mirror of the registry is
    current when an op's reply reaches it."""

    registered: list[AdapterInfo] = []
    unregistered: list[str] = []


class EngineFailed(Event):
    """The engine can't go on; every in-flight request gets this error."""

    message: str


# ---------------------------------------------------------------- scheduler -> workers


class NewReq(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """A request the worker has not seen (or saw before a preemption), sent in full."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far (outputs exist after a preemption)
    num_prompt_tokens: int
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in block_ids (prefix cache)
    num_scheduled_tokens: int  # tokens to compute this step, from num_computed_tokens
    lora_slot: int = -1  # adapter GPU slot; -1 = base model


class CachedReq(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    """A request the worker already holds, as a delta since the previous step."""

    req_id: str
    new_token_ids: list[int]  # tokens sampled since the worker last saw it
    new_block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    lora_slot: int = -1


class StepPlan(Event):
    """One forward pass. A request samples a token when its scheduled tokens reach the
    end of its known tokens (prefill complete, or decode)."""

    step: int
    new_reqs: list[NewReq] = []
    cached_reqs: list[CachedReq] = []
    finished_req_ids: list[str] = []  # drop their state (finished or aborted)
    preempted_req_ids: list[str] = []  # drop their state; they come back as NewReq


class AdapterSlotAssigned(Event):
    """Load adapter `version_id` (from `path`, or from the worker's CPU copy) into GPU
    `slot`, which is free. Sent before the StepPlan that first uses it; with overlapped
    loading a plan uses the slot only once every rank reported AdapterLoadCompleted."""

    slot: int
    version_id: int
    path: str
    content_digest: int = 0  # older logs' xxh64 (the workers check content_sha256)
    content_sha256: str = ""  # what the files must still hash to ("": not checked)


class AdapterPrefetched(Event):
    """Stage `version_id` into the workers' CPU tier (disk -> pinned memory) ahead of use:
    at registration, or for a request near the head of the waiting queue."""

    version_id: int
    path: str
    content_digest: int = 0  # older logs' xxh64
    content_sha256: str = ""  # what the files must still hash to ("": not checked)


class AdapterEvicted(Event):
    """Free GPU `slot` (it held `version_id`)."""

    slot: int
    version_id: int


class AdapterCpuEvicted(Event):
    """Drop the worker's CPU copy of `version_id` (CPU tier LRU)."""

    version_id: int


class Shutdown(Event):
    reason: str = ""


# ---------------------------------------------------------------- workers -> scheduler


class WorkerReady(Event):
    rank: int
    num_kv_blocks: int  # capacity found at start-up
    vocab_size: int
    eos_token_ids: list[int]
    device: str
    dtype: str
    num_weight_bytes: int = 0  # the weights this rank holds (worker_proc/runner.num_weight_bytes); 0: not reported


class AdapterLoadCompleted(Event):
    """One rank finished a load: into GPU `slot`, or into its CPU tier (`slot` -1, an
    AdapterPrefetched). Wall-clock facts of the load travel with it, as input."""

    rank: int
    slot: int
    version_id: int
    source_tier: str = ""  # where the bytes came from: "disk" or "cpu"
    duration_ms: float = 0.0  # from the command's arrival on the worker to the load's end
    num_bytes: int = 0  # bytes moved
    end_time_s: float = 0.0  # wall clock at the load's end, as the worker saw it (0: not known)


class AdapterLoadFailed(Event):
    """A worker could not load an adapter version (file gone, truncated, its content no
    longer the registered version's, ...); `slot` -1: a CPU-tier staging failed."""

    rank: int
    slot: int
    version_id: int
    message: str


class SampledToken(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    req_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None


class StepCompleted(Event):
    step: int
    rank: int
    sampled: list[SampledToken] = []  # rank 0 only
    failed: list[FailedReq] = []  # requests that failed alone (isolated faults)
    prompt_logprobs: list[PromptLogprobs] = []  # rank 0 only: of the requests that ask, for this step's positions


class FailedReq(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    req_id: str
    message: str


class RankDigest(Event):
    """xxhash64 of what one rank applied after a step (its block tables and slot table)."""

    step: int
    rank: int
    digest: int


class WorkerFailed(Event):
    rank: int
    message: str


# ---------------------------------------------------------------- core decisions (logged)


class RequestFinished(Event):
    req_id: str
    finish_reason: str
    num_output_tokens: int


class RequestPreempted(Event):
    req_id: str
    step: int


class StateDigest(Event):
    """xxhash64 of a canonical encoding of the core's state after a step."""

    step: int
    digest: int


class AdapterRegistered(Event):
    name: str
    version_id: int
    path: str
    replaced_version_id: int = 0  # the version a load_inplace superseded, 0 if none
    content_digest: int = 0  # older logs' xxh64
    content_sha256: str = ""


class AdapterUnloaded(Event):
    name: str
    version_id: int
    reason: str = ""  # "": an unload or a failed load; "lru": the least recently used idle on-demand adapter made room


class AdapterEvictionDeferred(Event):
    """`version_id` was unloaded while requests still use its slot; the slot is freed
    (AdapterEvicted) when the last of them ends."""

    version_id: int
    slot: int
    num_reqs: int


class PrefixCached(Event):
    """Full KV blocks of `req_id` entered its namespace's radix tree. Each hash is
    chained from the namespace seed (the adapter version id; 0 = base) through the
    block's tokens, so equal tokens under different namespaces hash differently."""

    req_id: str
    namespace: int
    block_ids: list[int]
    block_hashes: list[int]


class NamespaceEvicted(Event):
    """An unloaded adapter version's cached blocks left the prefix cache: `num_blocks`
    at once; `num_locked` more are freed as their requests finish."""

    namespace: int
    num_blocks: int
    num_locked: int = 0


class DigestMismatch(Event):
    """Tensor-parallel ranks applied different state after `step`; the engine stops."""

    step: int
    digests: list[int]  # by rank
    odd_ranks: list[int]  # ranks that differ from rank 0


class AdapterDrainStarted(Event):
    """GPU `slot`, holding `version_id` for running requests, drains for waiting `for_version_id`,
    which can have no other slot: no more requests of `version_id` queued behind that version's
    oldest waiting request are admitted until the slot is free. `num_remaining_tokens`: at most
    how many tokens its running requests may still generate (why it was chosen)."""

    slot: int
    version_id: int
    for_version_id: int
    num_remaining_tokens: int = 0


class AdapterDrainCancelled(Event):
    """The drain of `slot` for `for_version_id` ends before the slot is free (`reason`);
    requests of `version_id` are admitted again."""

    slot: int
    version_id: int
    for_version_id: int
    reason: str = ""


class LogClosed(Event):
    """Last record of a log the scheduler closed: why it stopped, and which process's death
    stopped it ("launcher", "tokenizer", "worker-<rank>"; "" when none died, as on SIGTERM)."""

    reason: str = ""
    dead_process: str = ""
    exit_code: int | None = None  # the dead process's exit status, as the launcher saw it; None: not known


# ---------------------------------------------------------------- channel unions

ToScheduler = RequestArrived | RequestAborted | AdapterLoadRequested | AdapterUnloadRequested
FromScheduler = (
    TokensEmitted
    | RequestRejected
    | EngineFailed
    | EngineReady
    | EngineStats
    | AdapterOpReplied
    | AdapterLoadObserved
    | AdapterRegistryChanged
)
ToWorker = StepPlan | Shutdown | AdapterSlotAssigned | AdapterEvicted | AdapterCpuEvicted | AdapterPrefetched
FromWorker = WorkerReady | StepCompleted | RankDigest | WorkerFailed | AdapterLoadCompleted | AdapterLoadFailed
# What the core takes in, and what it decides; the log holds both, and LogClosed.
INPUT_TYPES: tuple[type, ...] = (
    RequestArrived,
    RequestAborted,
    WorkerReady,
    StepCompleted,
    RankDigest,
    WorkerFailed,
    AdapterLoadRequested,
    AdapterUnloadRequested,
    AdapterLoadCompleted,
    AdapterLoadFailed,
)
DECISION_TYPES: tuple[type, ...] = (
    StepPlan,
    TokensEmitted,
    RequestRejected,
    EngineFailed,
    RequestFinished,
    RequestPreempted,
    StateDigest,
    Shutdown,
    AdapterOpReplied,
    AdapterRegistered,
    AdapterUnloaded,
    AdapterSlotAssigned,
    AdapterEvicted,
    AdapterEvictionDeferred,
    AdapterCpuEvicted,
    DigestMismatch,
    PrefixCached,
    NamespaceEvicted,
    AdapterPrefetched,
    AdapterDrainStarted,
    AdapterDrainCancelled,
)
CoreInput = Union[INPUT_TYPES]  # type: ignore[valid-type]  # noqa: UP007
Decision = Union[DECISION_TYPES]  # type: ignore[valid-type]  # noqa: UP007
LogEvent = Union[INPUT_TYPES + DECISION_TYPES + (LogClosed,)]  # type: ignore[valid-type]  # noqa: UP007
