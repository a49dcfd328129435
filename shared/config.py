"""Engine configuration: one frozen dataclass, built by the launcher from the CLI, written into the
run directory, read by every child and logged in the event-log header. Each setting is written once,
on its field: default, help and `Flag`, from which ledgerserve/cli.py generates the serve flags.
Facts found at start-up (KV capacity, vocab size) travel in WorkerReady, never here."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from typing import Any

import msgspec

from ledgerserve.shared.adapter_files import is_inside
from ledgerserve.shared.flag_values import (
    CORS_LIST,
    dtype_name,
    generation_config_source,
    human_readable_int,
    revision_name,
)

DEFAULT_EVENT_LOG_DIR = "~/.cache/ledgerserve/events"
MiB = 1024 * 1024
GiB = 1024 * MiB
EVENT_LOG_CONTENTS = ("tokens", "hashed")  # what the event log keeps of each request's content
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class Flag:
    """A field's flag: `name` (default `--` + the field's name, dashed) and `aliases`; its text
    becomes the value through `parse` (default: the field's type); a tuple field collects a repeated
    flag (unless `repeat` is off). Not given, an `auto` setting is found at start-up (`auto` says
    how, `{default}` standing for the default, which is the CPU's and what a config built in code
    gets); `on_cuda`: its CUDA value."""

    help: str
    name: str = ""
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    parse: Callable[[str], Any] | None = None
    auto: str = ""
    on_cuda: Any = None
    nargs: str | None = None  # "+": the flag takes one or more values
    repeat: bool = True  # False: a tuple field's `parse` gives the whole tuple from one flag

    @property
    def auto_text(self) -> str:
        return self.auto or ("" if self.on_cuda is None else f"{self.on_cuda} on CUDA, {{default}} on CPU")


def setting(default: Any = MISSING, help: str = "", **flag: Any) -> Any:
    """A field with a flag of its own (`flag`: the other keys of `Flag`)."""
    return dataclasses.field(default=default, metadata={"flag": Flag(help, **flag)})


def unflagged(default: Any = MISSING, *, set_by: str) -> Any:
    """A field that no flag of its own sets; `set_by` says what does."""
    return dataclasses.field(default=default, metadata={"set_by": set_by})


def _real_path(path: str) -> str:
    return os.path.realpath(path) if path else ""


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str = unflagged(set_by="the MODEL_DIR argument, else the demo model")
    served_model_name: str = setting(
        help="the model id in the API; more names are accepted too", auto="the model id as given", nargs="+"
    )
    max_model_len: int = setting(
        help="longest prompt + output (32k = 32000, 32K = 32768)",
        auto="the model's max_position_embeddings",
        parse=human_readable_int,
    )
    host: str = setting("127.0.0.1", "HTTP bind address")
    port: int = setting(8000, "HTTP port")
    dtype: str = setting(
        "float32",
        "model dtype (also vLLM's half, float)",
        choices=("float32", "bfloat16", "float16"),
        parse=dtype_name,
        on_cuda="bfloat16",
    )
    device: str = setting("cpu", "where the model runs", choices=("cpu", "cuda"), auto="cuda when available, else cpu")
    max_num_seqs: int = setting(64, "requests in one step", on_cuda=256)
    max_num_batched_tokens: int = setting(
        2048, "tokens in one step (the chunked-prefill budget)", parse=human_readable_int
    )
    block_size: int = setting(16, "tokens per KV block")
    num_kv_blocks: int | None = setting(None, "KV pool size; overrides --gpu-memory-utilization", auto="from memory")
    gpu_memory_utilization: float = setting(0.9, "share of GPU memory the worker may use")
    load_format: str = setting("auto", "dummy: random weights (benchmarks)", choices=("auto", "safetensors", "dummy"))
    seed: int = setting(0, "seed for the weights of dummy and for unseeded sampling")
    event_log_dir: str = setting(
        "",
        "where the event log goes (a 0700 directory, 0600 files); it holds every prompt and output token id "
        "unless --event-log-content hashed",
        auto=DEFAULT_EVENT_LOG_DIR,
    )
    shutdown_timeout_s: float = setting(30.0, "seconds to finish requests on SIGTERM", name="--shutdown-timeout")
    tensor_parallel_size: int = setting(1, "worker ranks", aliases=("-tp",))
    run_dir: str = unflagged("", set_by="the launcher: the 0700 directory holding the ipc sockets")
    is_demo_model: bool = unflagged(False, set_by="the launcher: no MODEL_DIR given")
    enable_lora: bool = setting(False, "serve LoRA adapters (implied by --lora-modules)")
    max_loras: int = setting(8, "GPU adapter slots = distinct adapters per step")
    max_lora_rank: int = setting(64, "larger adapters are refused")
    max_cpu_loras: int = setting(32, "adapter versions kept in (pinned) CPU memory", auto="max({default}, --max-loras)")
    lora_modules: tuple[tuple[str, str], ...] = unflagged((), set_by="--lora-modules: (name, path) loaded at start-up")
    lora_allowed_dirs: tuple[str, ...] = setting(
        (), "a root run-time adapter loads must lie in (repeatable)", name="--lora-allowed-dir", parse=os.path.realpath
    )
    enforce_eager: bool = setting(False, "no CUDA graphs: run every step eagerly")
    max_request_bytes: int = setting(8 * MiB, "largest HTTP request body; larger ones get 413")
    max_n: int = setting(16, "most choices (n) per request")
    max_waiting_requests: int = setting(1024, "queue bound; past it, 503 with Retry-After")
    api_key_required: bool = unflagged(False, set_by="--api-key or LEDGERSERVE_API_KEY (the key never enters config)")
    admin_api_key_required: bool = unflagged(False, set_by="--admin-api-key or LEDGERSERVE_ADMIN_API_KEY")
    event_log_fsync: str = setting("step", "step: one fsync per step", choices=("never", "step", "always"))
    event_log_max_bytes: int = setting(256 * MiB, "rotate log segments past this size")
    async_scheduling: bool = setting(
        False,
        "plan step s + 1 while step s runs, so the GPU never waits on the host (on the CPU the forward runs inside "
        "the launch: nothing to overlap)",
        on_cuda=True,
    )
    event_log_max_total_bytes: int = setting(4 * GiB, "bound of the event-log directory (0: unlimited)")
    lora_overlap_loading: bool = setting(True, "load adapters beside the running steps, ahead of use")
    lora_max_wait_steps: int = setting(16, "steps an adapter request may be passed before a slot is drained for it")
    lora_resolve_dir: str = setting("", "load the adapter DIR/N for a request of unknown model N", parse=_real_path)
    max_on_demand_loras: int = setting(64, "adapters registered on demand at once (then LRU)")
    pinned_lora_modules: tuple[str, ...] = unflagged((), set_by="--lora-modules entries with pinned: true")
    served_model_aliases: tuple[str, ...] = unflagged((), set_by="--served-model-name: its names after the first")
    revision: str = setting("", "branch, tag or commit of a Hugging Face model id (none: main)", parse=revision_name)
    tokenizer: str = setting("", "tokenizer directory or Hugging Face id", auto="the model's")
    tokenizer_revision: str = setting(
        "", "branch, tag or commit of a Hugging Face tokenizer id (none: main)", parse=revision_name
    )
    download_dir: str = setting("", "Hugging Face cache for model ids (none: $HF_HUB_CACHE, else $HF_HOME/hub)")
    chat_template: str = setting("", "a chat template file, or the template itself, instead of the tokenizer's")
    uvicorn_log_level: str = setting("info", "uvicorn's log level", choices=UVICORN_LOG_LEVELS)
    root_path: str = setting("", "the path prefix a proxy serves the API under (FastAPI root_path)")
    allowed_origins: tuple[str, ...] = setting((), "CORS origins, a JSON list (none: no CORS)", **CORS_LIST)
    allowed_methods: tuple[str, ...] = setting((), 'CORS methods, a JSON list (none: ["*"])', **CORS_LIST)
    allowed_headers: tuple[str, ...] = setting((), 'CORS headers, a JSON list (none: ["*"])', **CORS_LIST)
    allow_credentials: bool = setting(False, "CORS: allow credentials")
    allowed_hosts: tuple[str, ...] = setting((), "Host names a loopback server also answers (JSON list)", **CORS_LIST)
    ssl_keyfile: str = setting("", "TLS private key file (HTTPS, with --ssl-certfile)", parse=_real_path)
    ssl_certfile: str = setting("", "TLS certificate file (HTTPS, with --ssl-keyfile)", parse=_real_path)
    generation_config: str = setting(
        "auto",
        "sampling defaults: auto (the model's generation_config.json), vllm (none) or a DIR holding one",
        parse=generation_config_source,
    )
    tp_collective_timeout_s: float = setting(
        60.0,
        "seconds a tensor-parallel rank waits in a collective for the others before it fails the engine",
        name="--tp-collective-timeout",
    )
    disable_custom_all_reduce: bool = setting(
        False,
        "tensor parallel on CUDA: send every all-reduce through NCCL, none through the one-shot symmetric-memory path",
    )
    event_log_content: str = setting(
        "tokens",
        "what the event log keeps of requests. tokens: every prompt and sampled token id and its logprobs; "
        "hashed: keyed digests of each token's prefix in their place (the key is drawn per run and never "
        "stored), zeros for logprobs, the id only of a stop token that ended a request; replay --verify "
        "checks either. Both keep sampling parameters (stop ids, logit_bias) and token counts",
        choices=EVENT_LOG_CONTENTS,
    )
    tp_layout: str = unflagged("", set_by="the launcher: how the model is split over the ranks (shared/tp_layout.py)")
    profile_dir: str = setting(
        "",
        "write each process's timing spans here, for the serving-path profile (scripts/serving/profile_serving.py); "
        "off when empty",
        parse=_real_path,
    )

    @property
    def served_model_names(self) -> tuple[str, ...]:
        """Every name the API accepts for the base model, the one it reports first."""
        return (self.served_model_name, *self.served_model_aliases)

    @property
    def tokenizer_dir(self) -> str:
        return self.tokenizer or self.model_dir

    def __post_init__(self) -> None:
        _validate(self)

    def to_json(self) -> bytes:
        return msgspec.json.encode(dataclasses.asdict(self))

    @staticmethod
    def from_json(data: bytes) -> EngineConfig:
        return msgspec.json.decode(data, type=EngineConfig)


def default_of(name: str) -> Any:
    """A field's default (the one place it is written is its field above)."""
    return EngineConfig.__dataclass_fields__[name].default


def cuda_defaults() -> dict[str, Any]:
    """The values that replace the defaults on CUDA, for the settings no flag gave."""
    flags = [(f.name, f.metadata.get("flag")) for f in dataclasses.fields(EngineConfig)]
    return {name: flag.on_cuda for name, flag in flags if flag and flag.on_cuda is not None}


ANY_ORIGIN_WITH_CREDENTIALS = (
    "--allowed-origins '[\"*\"]' with --allow-credentials is refused: any web page could then read responses "
    "sent with its visitors' credentials; list the origins that may send credentials instead"
)


def _validate(cfg: EngineConfig) -> None:
    checks = [
        (cfg.max_model_len > 0, f"max_model_len must be > 0, got {cfg.max_model_len}"),
        (cfg.max_num_seqs > 0, f"max_num_seqs must be > 0, got {cfg.max_num_seqs}"),
        (cfg.max_num_batched_tokens > 0, "max_num_batched_tokens must be > 0"),
        (cfg.block_size > 0, "block_size must be > 0"),
        (cfg.num_kv_blocks is None or cfg.num_kv_blocks > 0, "num_kv_blocks must be > 0"),
        (0.0 < cfg.gpu_memory_utilization <= 1.0, "gpu_memory_utilization must be in (0, 1]"),
        (cfg.shutdown_timeout_s >= 0, "shutdown_timeout must be >= 0"),
        (cfg.tensor_parallel_size >= 1, "tensor_parallel_size must be >= 1"),
        (cfg.tp_collective_timeout_s > 0, f"tp_collective_timeout must be > 0, got {cfg.tp_collective_timeout_s}"),
        (cfg.max_loras >= 1, "max_loras must be >= 1"),
        (cfg.max_lora_rank >= 1, "max_lora_rank must be >= 1"),
        (cfg.max_cpu_loras >= cfg.max_loras, "max_cpu_loras must be >= max_loras"),
        (cfg.lora_max_wait_steps >= 1, "lora_max_wait_steps must be >= 1"),
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
        (bool(cfg.ssl_keyfile) == bool(cfg.ssl_certfile), "--ssl-keyfile and --ssl-certfile go together"),
        (not ("*" in cfg.allowed_origins and cfg.allow_credentials), ANY_ORIGIN_WITH_CREDENTIALS),
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
    for f in dataclasses.fields(cfg):
        value, choices = getattr(cfg, f.name), f.metadata["flag"].choices if "flag" in f.metadata else ()
        checks.append((not choices or value in choices, f"unknown {f.name} {value!r}: one of {', '.join(choices)}"))
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
