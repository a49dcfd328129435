"""The OpenAI-compatible HTTP app: `build_app(engine, tokenizer, config)`."""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from shared.config import EngineConfig
from shared.events import RequestArrived
from tokenizer_proc import adapters, inputs, streaming
from tokenizer_proc.adapter_routes import (
    StartupAdapterError,
    add_adapter_routes,
    load_startup_adapters,
    validate_startup_adapters,
)
from tokenizer_proc.chat_template import ChatTemplate
from tokenizer_proc.disconnect import ClientGone, until_disconnect
from tokenizer_proc.engine_client import EngineClientBase, EngineDeadError
from tokenizer_proc.errors import error_response, install_error_handlers
from tokenizer_proc.generation import RequestRun, collect
from tokenizer_proc.metrics import CONTENT_TYPE_LATEST, Metrics
from tokenizer_proc.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from tokenizer_proc.responses import chat_choice, chat_logprobs, completion_choice, completion_logprobs, envelope

VERSION = "0.1.0"
logger = logging.getLogger(__name__)


@dataclass
class Served:
    engine: EngineClientBase
    tokenizer: Any
    config: EngineConfig
    chat_template: ChatTemplate | None
    vocab_size: int
    created: int
    metrics: Metrics
    adapters: adapters.AdapterRegistry


def build_app(
    engine: EngineClientBase, tokenizer: Any, config: EngineConfig, chat_template: ChatTemplate | None = None
) -> FastAPI:
    """Raises StartupAdapterError if a `--lora-modules` adapter is refused."""
    template = chat_template if chat_template is not None else ChatTemplate.from_model_dir(config.model_dir)
    registry = adapters.AdapterRegistry()
    served = Served(engine, tokenizer, config, template, len(tokenizer), int(time.time()), Metrics(), registry)
    engine.finished_listeners.append(served.metrics.on_finished)
    engine.on_adapters = registry.refresh
    base = adapters.load_base_shapes(config.model_dir) if config.enable_lora else None
    startup = validate_startup_adapters(config, base)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            await load_startup_adapters(engine, startup)  # before the server reports ready
        except StartupAdapterError as e:
            logger.error("%s", e)
            raise
        yield
        await engine.close()

    app = FastAPI(title="ledgerserve", version=VERSION, lifespan=lifespan)
    install_error_handlers(app)
    _add_info_routes(app, served)
    _add_generate_routes(app, served)
    add_adapter_routes(app, engine, config, base)
    return app


def _add_info_routes(app: FastAPI, served: Served) -> None:
    @app.get("/health")
    async def health() -> Response:
        reason = served.engine.unavailable_reason()
        if reason is None and served.engine.is_ready:
            return Response(status_code=200)
        return error_response(503, reason or "the engine is not ready")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(served.metrics.render(served.engine), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": adapters.model_cards(served.config, served.adapters, served.created)}


def _add_generate_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        lora_name = _check_request(req, served)
        prompt_ids = inputs.completion_prompt_ids(req, served.tokenizer)
        run = _start_run(served, req, prompt_ids, req.max_tokens, req.logprobs, "cmpl", lora_name)
        if req.stream:
            return _sse(streaming.completion_stream(run, req, served.tokenizer, served.config.served_model_name))
        delta = await _collect_or_gone(raw, run)
        if delta is None:
            return Response(status_code=499)
        logprobs = completion_logprobs(served.tokenizer, delta.token_ids, delta.logprobs, 0)
        choice = completion_choice(delta, logprobs, req.return_token_ids)
        if req.return_token_ids:
            choice["prompt_token_ids"] = prompt_ids
        body = envelope(run.req_id, "text_completion", int(time.time()), req.model, [choice], run.usage)
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return JSONResponse(body)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        lora_name = _check_request(req, served)
        prompt_ids = inputs.chat_prompt_ids(req, served.tokenizer, served.chat_template)
        run = _start_run(served, req, prompt_ids, req.max_output_tokens(), req.num_logprobs(), "chatcmpl", lora_name)
        if req.stream:
            return _sse(streaming.chat_stream(run, req, served.tokenizer))
        delta = await _collect_or_gone(raw, run)
        if delta is None:
            return Response(status_code=499)
        logprobs = chat_logprobs(served.tokenizer, delta.token_ids, delta.logprobs)
        choice = chat_choice(delta, logprobs, req.return_token_ids, stream=False)
        body = envelope(run.req_id, "chat.completion", int(time.time()), req.model, [choice], run.usage)
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return JSONResponse(body)


def _check_request(req: SamplingFields, served: Served) -> str | None:
    """Check the request; return the adapter it asks for (None: the base model)."""
    lora_name = adapters.resolve_lora(req.model, req.lora_path, served.config, served.adapters)
    req.check()
    if (reason := served.engine.unavailable_reason()) is not None:
        raise EngineDeadError(reason)
    return lora_name


def _start_run(
    served: Served,
    req: SamplingFields,
    prompt_ids: list[int],
    max_tokens: int | None,
    num_logprobs: int | None,
    prefix: str,
    lora_name: str | None,
) -> RequestRun:
    params = inputs.sampling_params(
        req, max_tokens, num_logprobs, len(prompt_ids), served.config.max_model_len, served.vocab_size
    )
    arrived = RequestArrived(
        req_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt_token_ids=prompt_ids,
        sampling=params,
        arrival_time_s=time.time(),
        lora_name=lora_name,
    )
    return RequestRun(served.engine, served.tokenizer, arrived, req.stop_list(), req.skip_special_tokens)


async def _collect_or_gone(raw: Request, run: RequestRun) -> Any:
    try:
        return await until_disconnect(raw, collect(run))
    except ClientGone:
        return None


def _sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
