"""The core's slice of the engine configuration."""

from __future__ import annotations

from dataclasses import dataclass

from ledgerserve.shared.config import EngineConfig

_POSITIVE = (
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "max_model_len",
    "tensor_parallel_size",
    "max_loras",
    "max_cpu_loras",
    "lora_max_wait_steps",
    "max_steps_in_flight",
    "max_on_demand_loras",
)


@dataclass(frozen=True)
class CoreConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int
    tensor_parallel_size: int = 1
    max_loras: int = 8  # GPU slots = distinct adapters per step
    max_cpu_loras: int = 32  # adapter versions kept in the workers' CPU tier
    enable_lora: bool = False
    lora_max_wait_steps: int = 16  # steps a cap-blocked request waits before nothing may overtake it
    max_steps_in_flight: int = 1  # 2: async scheduling, step s + 1 planned while step s runs
    # True only to replay schema 1 logs: an evicted prefix namespace then stays in the state
    # (and in every StateDigest) for good, instead of leaving once its version is dropped.
    keep_dropped_namespaces: bool = False
    # True: slots are loaded ahead (prefetch from the waiting queue) and a request runs once its
    # slot is ready on every rank (AdapterLoadCompleted). False, the reference path: a step's
    # slots are assigned as it is planned and the workers load them in command order before it.
    lora_overlap_loading: bool = False
    # With overlapped loading: a waiting request whose adapter can have no slot gets one slot
    # drained for it (drain.py). False only to replay schema 3 logs: once it has waited
    # lora_max_wait_steps, no adapter request behind it is admitted until it has a slot.
    lora_targeted_drain: bool = True

    @property
    def drains_slots(self) -> bool:
        """Whether the targeted-drain policy is on (it needs overlapped loading)."""
        return self.lora_overlap_loading and self.lora_targeted_drain

    max_on_demand_loras: int = 64  # adapters registered on demand at once; past it the LRU idle one goes

    def __post_init__(self) -> None:
        for name in _POSITIVE:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"CoreConfig.{name} must be a positive int, got {value!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"CoreConfig.max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.max_steps_in_flight > 2:
            raise ValueError(f"CoreConfig.max_steps_in_flight must be 1 or 2, got {self.max_steps_in_flight}")
        for name in ("enable_lora", "keep_dropped_namespaces", "lora_overlap_loading", "lora_targeted_drain"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"CoreConfig.{name} must be a bool, got {getattr(self, name)!r}")

    @staticmethod
    def from_engine(cfg: EngineConfig) -> CoreConfig:
        return CoreConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            tensor_parallel_size=cfg.tensor_parallel_size,
            max_loras=cfg.max_loras,
            max_cpu_loras=cfg.max_cpu_loras,
            enable_lora=cfg.enable_lora,
            lora_max_wait_steps=cfg.lora_max_wait_steps,
            max_steps_in_flight=2 if cfg.async_scheduling else 1,
            lora_overlap_loading=cfg.lora_overlap_loading,
            max_on_demand_loras=cfg.max_on_demand_loras,
        )
