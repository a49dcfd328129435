"""Engine configuration: one frozen dataclass, built by the launcher from the CLI,
written into the run directory, read by every child and logged in the event-log header.

Facts found at start-up (KV capacity, vocab size) travel in WorkerReady, never here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import msgspec

from ledgerserve.shared.adapter_files import is_inside


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    served_model_name: str
    max_model_len: int
    host: str = "127.0.0.1"
    port: int = 8000
    dtype: str = "float32"  # resolved: float32 | bfloat16 | float16
    device: str = "cpu"  # resolved: cpu | cuda
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: size the pool from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"  # auto | safetensors | dummy
    seed: int = 0
    event_log_dir: str = ""
    shutdown_timeout_s: float = 30.0
    tensor_parallel_size: int = 1
    run_dir: str = ""  # the 0700 directory holding the ipc sockets
    is_demo_model: bool = False
    enable_lora: bool = False
    max_loras: int = 8  # GPU slots = distinct adapters per step
    max_lora_rank: int = 64
    max_cpu_loras: int = 32  # adapter versions kept in (pinned) CPU memory
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) loaded at start-up, trusted
    lora_allowed_dirs: tuple[str, ...] = ()  # roots for adapters loaded at run time
    enforce_eager: bool = False  # True: no CUDA graphs
    max_request_bytes: int = 8 * 1024 * 1024  # larger HTTP bodies get 413
    max_n: int = 16  # most choices per request
    max_waiting_requests: int = 1024  # past it, new requests get 503 with Retry-After
    api_key_required: bool = False  # the key itself travels in LEDGERSERVE_API_KEY, never in config or logs
    event_log_fsync: str = "step"  # never | step | always
    event_log_max_bytes: int = 256 * 1024 * 1024  # rotate segments past this size
    async_scheduling: bool = False  # plan step s + 1 while step s runs, so the GPU never waits on the host
    event_log_max_total_bytes: int = 4 * 1024**3  # retention bound of the log directory; 0: unlimited
    lora_overlap_loading: bool = True  # adapter loads run beside the steps; False: in command order (the reference)
    lora_max_wait_steps: int = 16  # steps a waiting adapter request may be overtaken before nothing may pass it
    lora_resolve_dir: str = ""  # a request's unknown model name N loads DIR/N on demand; inside an allowed dir
    max_on_demand_loras: int = 64  # adapters registered on demand at once; past it the LRU idle one is unregistered
    pinned_lora_modules: tuple[str, ...] = ()  # names of lora_modules that keep a GPU slot (at most max_loras - 1)

    def __post_init__(self) -> None:
        _validate(self)

    def to_json(self) -> bytes:
        return msgspec.json.encode(dataclasses.asdict(self))

    @staticmethod
    def from_json(data: bytes) -> EngineConfig:
        return msgspec.json.decode(data, type=EngineConfig)


def _validate(cfg: EngineConfig) -> None:
    checks = [
        (cfg.max_model_len > 0, f"max_model_len must be > 0, got {cfg.max_model_len}"),
        (cfg.max_num_seqs > 0, f"max_num_seqs must be > 0, got {cfg.max_num_seqs}"),
        (cfg.max_num_batched_tokens > 0, "max_num_batched_tokens must be > 0"),
        (cfg.block_size > 0, "block_size must be > 0"),
        (cfg.num_kv_blocks is None or cfg.num_kv_blocks > 0, "num_kv_blocks must be > 0"),
        (0.0 < cfg.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
        (cfg.dtype in ("float32", "bfloat16", "float16"), f"unknown dtype {cfg.dtype!r}"),
        (cfg.device in ("cpu", "cuda"), f"unknown device {cfg.device!r}"),
        (cfg.load_format in ("auto", "safetensors", "dummy"), f"unknown load format {cfg.load_format!r}"),
        (cfg.shutdown_timeout_s >= 0, "shutdown_timeout must be >= 0"),
        (cfg.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
        (cfg.max_loras >= 1, "max_loras must be >= 1"),
        (cfg.max_lora_rank >= 1, "max_lora_rank must be >= 1"),
        (cfg.max_cpu_loras >= cfg.max_loras, "max_cpu_loras must be >= max_loras"),
        (cfg.lora_max_wait_steps >= 1, "lora_max_wait_steps must be >= 1"),
        (cfg.event_log_fsync in ("never", "step", "always"), f"unknown event_log_fsync {cfg.event_log_fsync!r}"),
        (cfg.event_log_max_bytes >= 4096, "event_log_max_bytes must be >= 4096"),
        (
            cfg.event_log_max_total_bytes == 0 or cfg.event_log_max_total_bytes >= 2 * cfg.event_log_max_bytes,
            f"event_log_max_total_bytes must be 0 (unlimited) or at least twice event_log_max_bytes "
            f"({2 * cfg.event_log_max_bytes}): room for the segment being written and the one before it; "
            f"got {cfg.event_log_max_total_bytes}",
        ),
        (cfg.max_request_bytes >= 1024, "max_request_bytes must be >= 1024"),
        (cfg.max_n >= 1, "max_n must be >= 1"),
        (cfg.max_waiting_requests >= 1, "max_waiting_requests must be >= 1"),
        (cfg.max_on_demand_loras >= 1, f"max_on_demand_loras must be >= 1, got {cfg.max_on_demand_loras}"),
        (
            not cfg.lora_resolve_dir or is_inside(os.path.realpath(cfg.lora_resolve_dir), cfg.lora_allowed_dirs),
            f"lora_resolve_dir {cfg.lora_resolve_dir!r} must lie inside a --lora-allowed-dir",
        ),
        (
            set(cfg.pinned_lora_modules) <= {name for name, _ in cfg.lora_modules},
            "pinned_lora_modules must name adapters of lora_modules",
        ),
        (
            len(cfg.pinned_lora_modules) <= cfg.max_loras - 1,
            f"at most max_loras - 1 = {cfg.max_loras - 1} adapters may be pinned (--max-loras {cfg.max_loras}), "
            f"got {len(cfg.pinned_lora_modules)}",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
