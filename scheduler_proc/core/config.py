"""The core's slice of the engine configuration."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ledgerserve.scheduler_proc.core.policy import Policy
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
    # What this engine does where older schemas' engines did otherwise (policy.py): today's, or for
    # replay the one of the log's schema.
    policy: Policy = field(default_factory=Policy.current)

    @property
    def drains_slots(self) -> bool:
        """Whether the targeted-drain policy is on (it needs overlapped loading)."""
        return self.lora_overlap_loading and self.policy.targeted_drain

    def __post_init__(self) -> None:
        """EngineConfig validated the fields that come from it; the core's own are checked here."""
        if self.max_steps_in_flight not in (1, 2):
            raise ValueError(f"CoreConfig.max_steps_in_flight must be 1 or 2, got {self.max_steps_in_flight}")
        if self.lora_overlap_loading and not self.policy.overlap_loading:
            raise ValueError("CoreConfig.lora_overlap_loading needs a policy with overlapped loading")

    @staticmethod
    def from_engine(cfg: EngineConfig, policy: Policy | None = None) -> CoreConfig:
        """`policy`: today's unless given (replay gives its log's); overlapped loading is on where the
        engine config asks for it and the policy has it."""
        policy = policy if policy is not None else Policy.current()
        shared = {name: getattr(cfg, name) for name in _FROM_ENGINE}
        shared["lora_overlap_loading"] = cfg.lora_overlap_loading and policy.overlap_loading
        return CoreConfig(**shared, max_steps_in_flight=2 if cfg.async_scheduling else 1, policy=policy)


_FROM_ENGINE = [f.name for f in fields(CoreConfig) if f.name in EngineConfig.__dataclass_fields__]
