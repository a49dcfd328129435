"""The OpenAI-compatible HTTP app: `build_app(engine, tokenizer, config)`."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware

from ledgerserve.shared.adapter_format import BaseShapes
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import AdapterInfo
from ledgerserve.tokenizer_proc import adapters
from ledgerserve.tokenizer_proc.adapter_labels import series_bound
from ledgerserve.tokenizer_proc.adapter_routes import (
    StartupAdapterError,
    add_adapter_routes,
    load_startup_adapters,
    validate_startup_adapters,
)
from ledgerserve.tokenizer_proc.auth import ADMIN_STATE, AuthMiddleware, Keys, keys_from_env
from ledgerserve.tokenizer_proc.body_bounds import BodyBounds, bounded_route
from ledgerserve.tokenizer_proc.chat_template import ChatTemplate
from ledgerserve.tokenizer_proc.engine_client import EngineClientBase
from ledgerserve.tokenizer_proc.errors import ApiError, error_response, install_error_handlers
from ledgerserve.tokenizer_proc.generate_routes import Served, add_generate_routes
from ledgerserve.tokenizer_proc.generation_defaults import load_defaults, log_defaults
from ledgerserve.tokenizer_proc.host_check import HostCheckMiddleware, is_loopback
from ledgerserve.tokenizer_proc.lora_resolver import LoraResolver
from ledgerserve.tokenizer_proc.metrics import CONTENT_TYPE_LATEST, Metrics
from ledgerserve.tokenizer_proc.security import BodyLimitMiddleware
from ledgerserve.tokenizer_proc.tokenize_routes import add_tokenize_routes
from ledgerserve.tokenizer_proc.vllm_metrics import served_model_label

VERSION = "0.1.0"
logger = logging.getLogger(__name__)


def build_app(
    engine: EngineClientBase, tokenizer: Any, config: EngineConfig, chat_template: ChatTemplate | None = None
) -> FastAPI:
    """Raises StartupAdapterError if a `--lora-modules` adapter is refused, and StartupRefused
    if an API key is required but its variable is empty (or the admin key equals the API key)
    or the `--generation-config` file is unreadable or invalid (GenerationConfigError)."""
    keys = keys_from_env(config)
    template = chat_template if chat_template is not None else _chat_template(config)
    base = adapters.load_base_shapes(config.model_dir) if config.enable_lora else None
    served = _served(engine, tokenizer, config, template, base)
    startup = validate_startup_adapters(config, base)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            await load_startup_adapters(engine, config, startup)  # before the server reports ready
        except StartupAdapterError as e:
            logger.error("%s", e)
            raise
        yield
        await engine.close()
        if template is not None:
            template.close()  # its render workers

    app = FastAPI(title="ledgerserve", version=VERSION, lifespan=lifespan)
    # every route added below bounds its body's lists, then refuses bodies that are not valid text
    app.router.route_class = bounded_route(BodyBounds.for_config(config))
    _add_info_routes(app, served)
    add_generate_routes(app, served)
    add_tokenize_routes(app, served)
    add_adapter_routes(app, engine, config, base)
    add_unsupported_routes(app)
    _add_middleware(app, config, keys)
    return app


def _served(
    engine: EngineClientBase, tokenizer: Any, config: EngineConfig, template: ChatTemplate, base: BaseShapes | None
) -> Served:
    """What the routes serve with, listening to the engine's finishes, loads and adapter registry."""
    registry = adapters.AdapterRegistry()
    resolver = LoraResolver(engine, config, registry, base)
    label = served_model_label(config.served_model_name)
    max_series = series_bound(config.max_cpu_loras)
    metrics = Metrics(engine, config.max_loras, label, config.max_model_len, max_adapter_series=max_series)
    defaults = load_defaults(config.generation_config, config.model_dir, len(tokenizer))
    log_defaults(defaults, config.generation_config)
    served = Served(
        engine, tokenizer, config, template, len(tokenizer), int(time.time()), metrics, registry, resolver, defaults
    )
    engine.finished_listeners.append(metrics.on_finished)
    engine.load_listeners.append(metrics.on_load)
    engine.request_observer = metrics.vllm

    def on_adapters(infos: list[AdapterInfo]) -> None:  # the core's registry, after every adapter op
        registry.refresh(infos)
        metrics.on_adapters(infos)

    engine.on_adapters = on_adapters
    return served


def _add_middleware(app: FastAPI, config: EngineConfig, keys: Keys) -> None:
    """OpenAI-shaped errors for every failure, the request-body limit, the API keys, CORS and,
    outermost, the Host check of a loopback-bound server."""
    install_error_handlers(app, secret_paths=(config.model_dir, config.run_dir))
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)
    app.add_middleware(AuthMiddleware, keys=keys)  # also marks requests holding the admin key
    if config.allowed_origins:  # outermost: preflights are answered, and a 401 carries the CORS headers too
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=list(config.allowed_methods or ("*",)),
            allow_headers=list(config.allowed_headers or ("*",)),
            allow_credentials=config.allow_credentials,
        )
    if is_loopback(config.host):
        app.add_middleware(HostCheckMiddleware, allowed_hosts=config.allowed_hosts)


def _chat_template(config: EngineConfig) -> ChatTemplate | None:
    """--chat-template, else the tokenizer's own."""
    return ChatTemplate.for_tokenizer(config.tokenizer_dir, config.chat_template)


def _add_info_routes(app: FastAPI, served: Served) -> None:
    @app.get("/health")
    async def health() -> Response:
        reason = served.engine.unavailable_reason()
        if reason is None and served.engine.is_ready:
            return Response(status_code=200)
        return error_response(503, reason or "the engine is not ready")

    app.add_api_route("/ping", health, methods=["GET", "POST"], include_in_schema=False)  # vLLM's /health alias

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.render(served.engine), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    def cards(request: Request) -> list[dict[str, Any]]:
        shows_paths = getattr(request.state, ADMIN_STATE, False)  # server paths only to the admin key
        rows = served.engine.adapter_rows
        return adapters.model_cards(served.config, served.adapters, served.created, rows, shows_paths)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": cards(request)}

    @app.get("/v1/models/{model_id:path}")  # an adapter's id may hold `/`
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        for card in cards(request):
            if card["id"] == model_id:
                return card
        raise ApiError(404, f"The model `{model_id}` does not exist.", "model")


UNSUPPORTED_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def add_unsupported_routes(app: FastAPI) -> None:
    """The OpenAI routes not built yet answer 501 in the OpenAI error shape, whatever the method."""

    async def responses_api() -> Response:
        return error_response(501, "The Responses API (/v1/responses) is not supported yet; use /v1/chat/completions.")

    for path in ("/v1/responses", "/v1/responses/{rest:path}"):
        app.add_api_route(path, responses_api, methods=UNSUPPORTED_METHODS, include_in_schema=False)
