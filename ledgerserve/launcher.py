"""The launcher: resolve the config, start the process group, wait for every ready
handshake, supervise, and stop the whole group on a signal or on any child's death."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time

from ledgerserve.process_group import Child, ProcessGroup
from ledgerserve.shared import env, ipc
from ledgerserve.shared.config import EngineConfig

log = logging.getLogger("launcher")


def serve(args: argparse.Namespace) -> int:
    """Run the group; the run directory is removed however it ends, a failed start included."""
    logging.basicConfig(level=env.log_level(), format="%(asctime)s launcher %(levelname)s %(message)s")
    started = time.monotonic()
    run_dir = ipc.make_run_dir()
    try:
        return _serve_in(args, run_dir, started)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _serve_in(args: argparse.Namespace, run_dir: str, started: float) -> int:
    try:
        config = resolve_config(args, run_dir)
    except (ValueError, FileNotFoundError) as e:
        print(f"ledgerserve: error: {e}", file=sys.stderr)
        return 2
    if config.is_demo_model:
        log.warning("serving the DEMO model: its weights are RANDOM, its output is gibberish (%s)", config.model_dir)
    group = ProcessGroup(config, children(config, api_key(args)))
    return group.run(started)


def children(config: EngineConfig, key: str = "") -> list[Child]:
    """The processes of the group. Only the HTTP process gets the API key, through its
    environment: it is never in the config file, the event log or another child."""
    cfg_path = os.path.join(config.run_dir, "config.json")
    with open(cfg_path, "wb") as f:
        f.write(config.to_json())
    py = sys.executable
    keyless = env.without_api_key()
    procs = [Child("scheduler", [py, "-m", "ledgerserve.scheduler_proc.main", "--config", cfg_path], keyless)]
    for rank in range(config.tensor_parallel_size):
        argv = [py, "-m", "ledgerserve.worker_proc.main", "--config", cfg_path, "--rank", str(rank)]
        procs.append(Child(f"worker-{rank}", argv, keyless))
    tokenizer_env = {**keyless, env.API_KEY: key} if key else keyless
    procs.append(Child("tokenizer", [py, "-m", "ledgerserve.tokenizer_proc.main", "--config", cfg_path], tokenizer_env))
    return procs


def resolve_config(args: argparse.Namespace, run_dir: str) -> EngineConfig:
    is_demo = args.model_dir is None
    model_dir = _demo_model_dir() if is_demo else os.path.abspath(args.model_dir)
    hf_config = _read_hf_config(model_dir)
    device = _resolve_device(args.device)
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    max_pos = int(hf_config.get("max_position_embeddings", 2048))
    max_model_len = max_pos if args.max_model_len is None else args.max_model_len
    modules = [parse_lora_module(spec) for spec in args.lora_modules]
    if max_model_len > max_pos:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {max_pos}")
    return EngineConfig(
        model_dir=model_dir,
        served_model_name=args.served_model_name or os.path.basename(model_dir.rstrip("/")),
        max_model_len=max_model_len,
        host=args.host,
        port=args.port,
        dtype=dtype,
        device=device,
        max_num_seqs=(256 if device == "cuda" else 64) if args.max_num_seqs is None else args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        load_format=args.load_format,
        seed=args.seed,
        event_log_dir=os.path.abspath(args.event_log_dir or _default_log_dir()),
        shutdown_timeout_s=args.shutdown_timeout,
        tensor_parallel_size=args.tensor_parallel_size,
        run_dir=run_dir,
        is_demo_model=is_demo,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        max_request_bytes=args.max_request_bytes,
        max_n=args.max_n,
        max_waiting_requests=args.max_waiting_requests,
        api_key_required=bool(api_key(args)),
        event_log_fsync=args.event_log_fsync,
        event_log_max_bytes=args.event_log_max_bytes,
        event_log_max_total_bytes=args.event_log_max_total_bytes,
        enable_lora=args.enable_lora or bool(args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=max(32, args.max_loras) if args.max_cpu_loras is None else args.max_cpu_loras,
        lora_modules=tuple((name, path) for name, path, _ in modules),
        pinned_lora_modules=tuple(name for name, _, pinned in modules if pinned),
        lora_allowed_dirs=tuple(os.path.realpath(d) for d in args.lora_allowed_dir),
        lora_overlap_loading=args.lora_overlap_loading,
        lora_max_wait_steps=args.lora_max_wait_steps,
        lora_resolve_dir=os.path.realpath(args.lora_resolve_dir) if args.lora_resolve_dir else "",
        max_on_demand_loras=args.max_on_demand_loras,
    )


def api_key(args: argparse.Namespace) -> str:
    """--api-key, else LEDGERSERVE_API_KEY ('' when neither is set)."""
    return args.api_key or env.api_key()


def parse_lora_module(spec: str) -> tuple[str, str, bool]:
    """`NAME=PATH` (unpinned) or JSON `{"name": NAME, "path": PATH, "pinned": BOOL}` -> (name,
    absolute path, pinned)."""
    pinned = False
    if spec.lstrip().startswith("{"):
        try:
            obj = json.loads(spec)
            name, path, pinned = obj["name"], obj["path"], obj.get("pinned", False)
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(f'--lora-modules: {spec!r} is not JSON of the form {{"name": ..., "path": ...}}') from None
        if not isinstance(pinned, bool):
            raise ValueError(f"--lora-modules: {spec!r}: pinned must be true or false")
    else:
        name, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules: {spec!r} is not NAME=PATH")
    if not name or not path:
        raise ValueError(f"--lora-modules: {spec!r} needs a name and a path")
    return str(name), os.path.abspath(str(path)), pinned


def _demo_model_dir() -> str:
    from ledgerserve.demo_model import ensure_demo_model

    return ensure_demo_model()


def _read_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    with open(path) as f:
        return json.load(f)


def _resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _default_log_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "ledgerserve", "events")
