"""`/v1/load_lora_adapter`, `/v1/unload_lora_adapter` and the start-up adapters.

Each op is validated here, sent to the core with the next op_id (`lora-op-N`, counted by the
engine client), and answered from the
core's `AdapterOpReplied` (duplicates: the core's 400; unknown unloads: its 404; a pin past
max_loras - 1: its 400). A load carries the content digest of the files as validated: every
later read must match it. Unknown fields in either body are refused with 400.

Run-time updates (both routes) are on with a --lora-allowed-dir or with vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; off, either op gets a 400 naming both. A load must still lie
inside an allowed dir, so with the variable alone unloads work and loads are refused, naming the flag.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, StrictBool

from ledgerserve.shared import env
from ledgerserve.shared.adapter_format import AdapterError, AdapterManifest, BaseShapes, read_manifest
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import AdapterLoadRequested, AdapterUnloadRequested
from ledgerserve.tokenizer_proc import adapters
from ledgerserve.tokenizer_proc.engine_client import EngineClientBase
from ledgerserve.tokenizer_proc.errors import ApiError, error_response

logger = logging.getLogger(__name__)


class StartupAdapterError(RuntimeError):
    """A `--lora-modules` adapter was refused: start-up stops."""


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    load_inplace: StrictBool = False
    pinned: StrictBool = False  # keep a GPU slot until unloaded (SGLang's pinned adapters)


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str


def add_adapter_routes(app: FastAPI, engine: EngineClientBase, config: EngineConfig, base: BaseShapes | None) -> None:
    updating = runtime_updates_allowed(config)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoraRequest) -> Response:
        adapters.require_lora(config)
        require_runtime_updates(updating, "Loading", "lora_path")
        require_allowed_dir(config)
        adapters.check_name(req.lora_name, config)
        real = adapters.allowed_real_path(req.lora_path, config.lora_allowed_dirs)
        if base is None:  # enable_lora implies base shapes; kept for the type checker
            raise RuntimeError("LoRA is enabled but the base shapes are unknown")
        manifest = await asyncio.to_thread(adapters.validate, real, base, config)
        event = load_event(engine.next_op_id(), req.lora_name, manifest, req.load_inplace, pinned=req.pinned)
        reply = await engine.adapter_op(event)
        if reply.code != 200:
            return error_response(reply.code, reply.message, "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoraRequest) -> Response:
        adapters.require_lora(config)
        require_runtime_updates(updating, "Unloading", "lora_name")
        reply = await engine.adapter_op(AdapterUnloadRequested(op_id=engine.next_op_id(), name=req.lora_name))
        if reply.code != 200:
            return error_response(reply.code, reply.message, "lora_name")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def runtime_updates_allowed(config: EngineConfig) -> bool:
    """Whether /v1/load_lora_adapter and /v1/unload_lora_adapter may change the adapters."""
    return bool(config.lora_allowed_dirs) or env.runtime_lora_updating()


def require_runtime_updates(allowed: bool, verb: str, param: str) -> None:
    if not allowed:
        raise ApiError(
            400,
            f"{verb} adapters at run time is disabled; start the server with --lora-allowed-dir DIR "
            f"(adapters under DIR may be loaded) or with {env.ALLOW_RUNTIME_LORA_UPDATING}=1.",
            param,
        )


def require_allowed_dir(config: EngineConfig) -> None:
    """Run-time updates on through the variable alone: loads still need a root to lie in."""
    if not config.lora_allowed_dirs:
        raise ApiError(
            400,
            f"{env.ALLOW_RUNTIME_LORA_UPDATING} allows run-time updates, but a loaded adapter must lie inside a "
            "--lora-allowed-dir; start the server with --lora-allowed-dir DIR to load adapters under DIR.",
            "lora_path",
        )


def validate_startup_adapters(config: EngineConfig, base: BaseShapes | None) -> list[tuple[str, AdapterManifest]]:
    """Check every `--lora-modules` adapter before serving (trusted: its directory may lie
    outside every --lora-allowed-dir, and its files then link anywhere)."""
    if config.lora_modules and not config.enable_lora:
        raise StartupAdapterError("--lora-modules needs --enable-lora")
    checked = []
    for name, path in config.lora_modules:
        if base is None:
            raise StartupAdapterError("LoRA is enabled but the base shapes are unknown")
        try:
            adapters.check_name(name, config)
        except ApiError as e:
            raise StartupAdapterError(f"start-up adapter {name!r} at {path}: {e.message}") from None
        try:
            checked.append(
                (
                    name,
                    read_manifest(
                        path,
                        base,
                        config.max_lora_rank,
                        config.lora_allowed_dirs,
                        check_weights=True,
                        model_dtype=config.dtype,
                    ),
                )
            )
        except AdapterError as e:
            raise StartupAdapterError(f"start-up adapter '{name}' at {path}: {e.message}") from None
    return checked


async def load_startup_adapters(
    engine: EngineClientBase, config: EngineConfig, checked: list[tuple[str, AdapterManifest]]
) -> None:
    """Register the start-up adapters with the core, one at a time, before serving."""
    for name, manifest in checked:
        pinned = name in config.pinned_lora_modules
        reply = await engine.adapter_op(load_event(engine.next_op_id(), name, manifest, pinned=pinned))
        if reply.code != 200:
            raise StartupAdapterError(
                f"start-up adapter '{name}' at {manifest.path}: the engine refused it ({reply.code}): {reply.message}"
            )
        logger.info("adapter '%s' loaded from %s (version %d)", name, manifest.path, reply.version_id)
    if config.lora_overlap_loading:  # the core stages each registered version while the CPU tier has room
        await engine.wait_staged([name for name, _ in checked], config.max_cpu_loras)


def load_event(
    op_id: str,
    name: str,
    manifest: AdapterManifest,
    load_inplace: bool = False,
    pinned: bool = False,
    on_demand: bool = False,
) -> AdapterLoadRequested:
    return AdapterLoadRequested(
        op_id=op_id,
        name=name,
        path=manifest.path,
        max_rank=manifest.max_rank,
        num_bytes=manifest.num_bytes,
        load_inplace=load_inplace,
        content_sha256=manifest.content_sha256,
        on_demand=on_demand,
        pinned=pinned,
    )
