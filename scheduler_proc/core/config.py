"""The core's slice of the engine configuration."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import EngineConfig


@dataclass(frozen=True)
class CoreConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_model_len", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"CoreConfig.{name} must be a positive int, got {value!r}")

    @staticmethod
    def from_engine(cfg: EngineConfig) -> "CoreConfig":
        return CoreConfig(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            tensor_parallel_size=cfg.tensor_parallel_size,
        )
