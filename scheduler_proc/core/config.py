"""The core's slice of the engine configuration."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ledgerserve.shared.config import EngineConfig


@dataclass(frozen=True)
class CoreConfig:
    """Built from the engine config (`from_engine`): the fields it shares with EngineConfig take its
    values, so their defaults are written there only."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int
    tensor_parallel_size: int
    max_loras: int  # GPU slots = distinct adapters per step
    max_cpu_loras: int  # adapter versions kept in the workers' CPU tier
    enable_lora: bool
    lora_max_wait_steps: int  # steps a cap-blocked request waits before nothing may overtake it
    max_steps_in_flight: int  # 2: async scheduling, step s + 1 planned while step s runs
    # True: slots are loaded ahead (prefetch from the waiting queue) and a request runs once its
    # slot is ready on every rank (AdapterLoadCompleted). False, the reference path: a step's
    # slots are assigned as it is planned and the workers load them in command order before it.
    lora_overlap_loading: bool
    max_on_demand_loras: int  # adapters registered on demand at once; past it the LRU idle one goes
    # True only to replay schema 1 logs: an evicted prefix namespace then stays in the state
    # (and in every StateDigest) for good, instead of leaving once its version is dropped.
    keep_dropped_namespaces: bool = False
    # With overlapped loading: a waiting request whose adapter can have no slot gets one slot
    # drained for it (drain.py). False only to replay schema 3 logs: once it has waited
    # lora_max_wait_steps, no adapter request behind it is admitted until it has a slot.
    lora_targeted_drain: bool = True
    # True only to replay logs of schema 4 and before: every AdapterOpReplied carried the whole
    # registry after the op (now what an op changed goes to the HTTP process unlogged).
    op_reply_registry: bool = False
    # True only to replay logs of schema 5 and before: with overlapped loading, each StateDigest
    # also hashed the ranks that had reported each slot load in flight and each CPU-tier staging
    # (reports nothing waits on, so their timing made two runs of the same traffic differ).
    digest_load_reports: bool = False

    @property
    def drains_slots(self) -> bool:
        """Whether the targeted-drain policy is on (it needs overlapped loading)."""
        return self.lora_overlap_loading and self.lora_targeted_drain

    def __post_init__(self) -> None:
        """EngineConfig validated the fields that come from it; the core's own are checked here."""
        if self.max_steps_in_flight not in (1, 2):
            raise ValueError(f"CoreConfig.max_steps_in_flight must be 1 or 2, got {self.max_steps_in_flight}")

    @staticmethod
    def from_engine(cfg: EngineConfig) -> CoreConfig:
        shared = {name: getattr(cfg, name) for name in _FROM_ENGINE}
        return CoreConfig(**shared, max_steps_in_flight=2 if cfg.async_scheduling else 1)


_FROM_ENGINE = [f.name for f in fields(CoreConfig) if f.name in EngineConfig.__dataclass_fields__]
