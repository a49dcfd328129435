"""The launcher: resolve the config, start the process group, wait for every ready
handshake, supervise, and stop the whole group on a signal or on any child's death."""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import logging
import os
import shutil
import socket
import sys
import time
from typing import Any

from ledgerserve import model_source, startup_checks
from ledgerserve.cli import given_settings, vllm_flag_notices
from ledgerserve.demo_model import demo_adapters
from ledgerserve.listen_socket import bind_http_sockets
from ledgerserve.process_group import Child, ProcessGroup
from ledgerserve.shared import env, ipc
from ledgerserve.shared.config import DEFAULT_EVENT_LOG_DIR, EngineConfig, cuda_defaults, default_of
from ledgerserve.shared.tp_layout import tp_layout

log = logging.getLogger("launcher")


def serve(args: argparse.Namespace) -> int:
    """Run the group. The HTTP address is bound first, before anything slow; the run directory is
    removed however it ends, a failed start included."""
    logging.basicConfig(level=env.log_level(), format="%(asctime)s launcher %(levelname)s %(message)s")
    started = time.monotonic()
    try:
        sockets = bind_http_sockets(_setting(args, "host"), _setting(args, "port"))
    except ValueError as e:
        return _refused(e)
    run_dir = ipc.make_run_dir()
    try:
        return _serve_in(args, run_dir, started, sockets)
    except KeyboardInterrupt:
        print("ledgerserve: interrupted during start-up", file=sys.stderr)
        return 130
    finally:
        for sock in sockets:
            sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def _serve_in(args: argparse.Namespace, run_dir: str, started: float, sockets: list[socket.socket]) -> int:
    """Resolve and check everything that can be checked before a child starts, then run the group."""
    try:
        config = resolve_config(args, run_dir)
        config = dataclasses.replace(config, port=sockets[0].getsockname()[1])  # --port 0: the one bound
        hf_config = startup_checks.read_hf_config(config.model_dir)
        base = startup_checks.check_model_config(config.model_dir, hf_config)
        startup_checks.check_startup_adapters(config, base)
    except (ValueError, OSError) as e:
        return _refused(e)
    if config.is_demo_model:
        log.warning("serving the DEMO model, a tiny model trained on a small corpus (%s)", config.model_dir)
    group = ProcessGroup(config, children(config, api_key(args), admin_api_key(args), [s.fileno() for s in sockets]))
    return group.run(started)


def _refused(error: Exception) -> int:
    print(f"ledgerserve: error: {error}", file=sys.stderr)
    return 2


def _setting(args: argparse.Namespace, name: str) -> Any:
    """A setting's flag value, else its default (for the few read before the config is resolved)."""
    value = getattr(args, name, None)
    return default_of(name) if value is None else value


def children(
    config: EngineConfig, key: str = "", admin_key: str = "", http_fds: list[int] | None = None
) -> list[Child]:
    """The processes of the group. Only the HTTP process gets the API keys, through its
    environment: they are never in the config file, the event log or another child. It also gets
    the bound HTTP sockets (`http_fds`), and serves on them."""
    cfg_path = os.path.join(config.run_dir, "config.json")
    with open(cfg_path, "wb") as f:
        f.write(config.to_json())
    py = sys.executable
    keyless = env.without_api_key()
    procs = [Child("scheduler", [py, "-m", "ledgerserve.scheduler_proc.main", "--config", cfg_path], keyless)]
    for rank in range(config.tensor_parallel_size):
        argv = [py, "-m", "ledgerserve.worker_proc.main", "--config", cfg_path, "--rank", str(rank)]
        procs.append(Child(f"worker-{rank}", argv, {**keyless, **env.TP_WORKER_ENV}))
    keys = {name: value for name, value in ((env.API_KEY, key), (env.ADMIN_API_KEY, admin_key)) if value}
    tokenizer_env = {**keyless, **keys}
    fds = http_fds or []
    argv = [py, "-m", "ledgerserve.tokenizer_proc.main", "--config", cfg_path, *[f"--listen-fd={fd}" for fd in fds]]
    procs.append(Child("tokenizer", argv, tokenizer_env, pass_fds=tuple(fds)))
    return procs


def resolve_config(args: argparse.Namespace, run_dir: str) -> EngineConfig:
    """The flags' settings, the auto ones no flag gave resolved for this machine and checkpoint;
    every other field keeps its EngineConfig default. Logs one line per vLLM flag accepted with a notice."""
    for notice in vllm_flag_notices(args):
        log.info("%s", notice)
    given = given_settings(args)
    spec = _model_spec(args)
    model_dir = _demo_model_dir() if spec is None else _model_dir(spec, given)
    hf_config = startup_checks.read_hf_config(model_dir)
    modules = [parse_lora_module(entry) for entry in args.lora_modules]
    if spec is None:  # the demo adapters, as --lora-modules would register them
        named = {name for name, _, _ in modules}
        modules += [(name, path, False) for name, path in demo_adapters(model_dir) if name not in named]
    auto = _auto_settings(given, spec or model_dir, hf_config)
    settings = {**given, **auto, **_resolved_paths(given, model_dir), "model_dir": model_dir, "run_dir": run_dir}
    settings.update(is_demo_model=spec is None, api_key_required=bool(api_key(args)))
    settings["admin_api_key_required"] = bool(admin_api_key(args))
    settings["tp_layout"] = tp_layout(hf_config, given.get("tensor_parallel_size", 1))
    if modules:  # they imply --enable-lora
        settings.update(enable_lora=True, lora_modules=tuple((name, path) for name, path, _ in modules))
        settings["pinned_lora_modules"] = tuple(name for name, _, pinned in modules if pinned)
    return EngineConfig(**settings)


def _model_spec(args: argparse.Namespace) -> str | None:
    """MODEL, given as the argument or as --model (vLLM takes both); None: the demo model."""
    if args.model_dir and args.model and args.model_dir != args.model:
        raise ValueError(f"two models given: {args.model_dir!r} and --model {args.model!r}")
    return args.model_dir or args.model


def _model_dir(spec: str, given: dict[str, Any]) -> str:
    """The directory of MODEL: a local directory, or a Hugging Face id's snapshot with safetensors weights."""
    revision = given.get("revision", "")
    model_dir = model_source.resolve(spec, revision, given.get("download_dir", ""))
    if given.get("load_format") != "dummy" and not os.path.isdir(spec):
        model_source.require_safetensors(model_dir, spec, revision)
    return model_dir


def _resolved_paths(given: dict[str, Any], model_dir: str) -> dict[str, str]:
    """The tokenizer's directory, the chat template's file made absolute, the cache's directory;
    the TLS files must exist."""
    sources = {}
    if given.get("tokenizer"):
        revision, download_dir = given.get("tokenizer_revision", ""), given.get("download_dir", "")
        sources["tokenizer"] = model_source.resolve(given["tokenizer"], revision, download_dir, what="tokenizer")
    if given.get("chat_template"):
        tokenizer_dir = sources.get("tokenizer", model_dir)
        sources["chat_template"] = chat_template_source(given["chat_template"], tokenizer_dir)
    for flag in ("ssl_keyfile", "ssl_certfile"):
        if given.get(flag) and not os.path.isfile(given[flag]):
            raise FileNotFoundError(f"--{flag.replace('_', '-')} {given[flag]}: no such file")
    if given.get("download_dir"):
        sources["download_dir"] = os.path.abspath(os.path.expanduser(given["download_dir"]))
    return sources


def chat_template_source(value: str, tokenizer_dir: str) -> str:
    """--chat-template: an existing file (made absolute), else the template itself; one that
    cannot be read or does not compile fails the start."""
    from ledgerserve.tokenizer_proc.chat_template import ChatTemplate

    if os.path.isfile(value):
        value = os.path.abspath(value)
    ChatTemplate.for_tokenizer(tokenizer_dir, value)
    return value


def _auto_settings(given: dict[str, Any], model: str, hf_config: dict) -> dict[str, Any]:
    """The auto settings: what a flag gave, else what this machine and checkpoint resolve."""
    max_pos = hf_config.get("max_position_embeddings", 2048)
    if not isinstance(max_pos, int) or isinstance(max_pos, bool) or max_pos < 1:
        raise ValueError(f"the model's config.json: max_position_embeddings must be a positive integer: {max_pos!r}")
    max_model_len = given.get("max_model_len", max_pos)
    if max_model_len > max_pos:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings {max_pos}")
    max_loras = given.get("max_loras", default_of("max_loras"))
    names = tuple(dict.fromkeys(given.get("served_model_name") or (_default_served_name(model),)))
    auto = {
        "served_model_name": names[0],
        "served_model_aliases": tuple(names[1:]),
        "max_model_len": max_model_len,
        "device": given.get("device") or _detected_device(),
        "event_log_dir": os.path.abspath(given.get("event_log_dir") or os.path.expanduser(DEFAULT_EVENT_LOG_DIR)),
        "max_cpu_loras": given.get("max_cpu_loras", max(default_of("max_cpu_loras"), max_loras)),
    }
    if auto["device"] == "cuda":
        auto.update({name: value for name, value in cuda_defaults().items() if name not in given})
    return auto


def _default_served_name(model: str) -> str:
    """A directory's name, or a Hugging Face id as given (ORG/NAME), as vLLM names it."""
    return os.path.basename(model.rstrip("/")) if os.path.isdir(model) else model


def api_key(args: argparse.Namespace) -> str:
    """--api-key, else LEDGERSERVE_API_KEY ('' when neither is set)."""
    return args.api_key or env.api_key()


def admin_api_key(args: argparse.Namespace) -> str:
    """--admin-api-key, else LEDGERSERVE_ADMIN_API_KEY ('' when neither is set); it must differ
    from the API key, or the adapter routes would be no better guarded than inference."""
    key = getattr(args, "admin_api_key", None) or env.admin_api_key()
    if key and key == api_key(args):
        raise ValueError("--admin-api-key must differ from --api-key")
    return key


LORA_MODULE_KEYS = ("name", "path", "base_model_name", "pinned")  # vLLM's, and pinned (SGLang's)


def parse_lora_module(spec: str) -> tuple[str, str, bool]:
    """`NAME=PATH` (unpinned) or JSON `{"name": NAME, "path": PATH, "pinned": BOOL}` -> (name,
    absolute path, pinned). The JSON form takes vLLM's `base_model_name` too (the parent of every
    adapter is the served model); any other key is refused, naming it."""
    if not spec.lstrip().startswith("{"):
        name, sep, path = spec.partition("=")
        if not sep:
            raise ValueError(f"--lora-modules: {spec!r} is not NAME=PATH")
        pinned = False
    else:
        name, path, pinned = _lora_module_json(spec)
    if not name or not path:
        raise ValueError(f"--lora-modules: {spec!r} needs a name and a path")
    return name, os.path.abspath(path), pinned


def _lora_module_json(spec: str) -> tuple[str, str, bool]:
    try:
        obj = json.loads(spec)
    except json.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict) or "name" not in obj or "path" not in obj:
        raise ValueError(f'--lora-modules: {spec!r} is not JSON of the form {{"name": ..., "path": ...}}')
    unknown = [key for key in obj if key not in LORA_MODULE_KEYS]
    if unknown:
        raise ValueError(f"--lora-modules: {spec!r}: unknown key {unknown[0]!r} (known: {', '.join(LORA_MODULE_KEYS)})")
    for key in ("name", "path", "base_model_name"):
        if key in obj and not isinstance(obj[key], str):
            raise ValueError(f"--lora-modules: {spec!r}: {key} must be a string")
    pinned = obj.get("pinned", False)
    if not isinstance(pinned, bool):
        raise ValueError(f"--lora-modules: {spec!r}: pinned must be true or false")
    return obj["name"], obj["path"], pinned


def _demo_model_dir() -> str:
    from ledgerserve.demo_model import ensure_demo_model

    return ensure_demo_model()


def _detected_device() -> str:
    """cuda when torch sees a GPU, else cpu. Without the NVIDIA driver's library torch cannot see
    one, so a machine without it answers without importing torch (seconds before any child starts)."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
