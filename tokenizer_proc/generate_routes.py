"""`/v1/completions` and `/v1/chat/completions`: validate, admit, fan out n choices (of each prompt), answer."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse

from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import RequestArrived
from ledgerserve.tokenizer_proc import adapters, inputs, request_ids, streaming
from ledgerserve.tokenizer_proc.chat_template import ChatTemplate
from ledgerserve.tokenizer_proc.disconnect import ClientGone, until_disconnect
from ledgerserve.tokenizer_proc.engine_client import EngineClientBase, EngineDeadError
from ledgerserve.tokenizer_proc.errors import RETRY_AFTER_S, ApiError
from ledgerserve.tokenizer_proc.fanout import choice_params, choice_req_id, collect_all, total_usage
from ledgerserve.tokenizer_proc.generation import Delta, RequestRun
from ledgerserve.tokenizer_proc.generation_defaults import GenerationDefaults
from ledgerserve.tokenizer_proc.lora_resolver import LoraResolver, ResolvedAdapter
from ledgerserve.tokenizer_proc.metrics import Metrics
from ledgerserve.tokenizer_proc.prompt_logprobs import PromptLogprobsBody, check_response_size, prompt_logprobs_body
from ledgerserve.tokenizer_proc.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from ledgerserve.tokenizer_proc.responses import (
    chat_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    envelope,
    json_response,
)


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
    resolver: LoraResolver  # the adapter a request names, loaded on its first request
    defaults: GenerationDefaults  # `--generation-config`: what a request's unset sampling fields take
    req_ids: request_ids.Counter = field(default_factory=lambda: request_ids.Counter(request_ids.COUNTED_PREFIX))


def add_generate_routes(app: FastAPI, served: Served) -> None:
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        adapter = await check_request(req, served)
        prompt_ids = await inputs.completion_prompt_ids(req, served.tokenizer, served.config.max_model_len)
        ids = _request_id(served, raw, "cmpl", len(prompt_ids) * req.n)
        runs = start_runs(served, req, prompt_ids, req.max_tokens, req.logprobs, ids.logged, adapter)
        if req.stream:
            return _sse(streaming.completion_stream(ids.response, runs, req, served.tokenizer), ids)
        deltas = await _collect_or_gone(raw, runs)
        if deltas is None:
            return Response(status_code=499)
        choices = _completion_choices(served, req, deltas, prompt_ids)
        body = envelope(ids.response, "text_completion", int(time.time()), req.model, choices, total_usage(runs, req.n))
        if req.return_token_ids and len(prompt_ids) == 1:  # several prompts: each choice carries its own
            body["prompt_token_ids"] = prompt_ids[0]
        return _with_id(json_response(body), ids)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        adapter = await check_request(req, served)
        prompt_ids = await inputs.chat_prompt_ids(
            req, served.tokenizer, served.chat_template, served.config.max_model_len
        )
        max_tokens, num_logprobs = req.max_output_tokens(), req.num_logprobs()
        ids = _request_id(served, raw, "chatcmpl", req.n)
        runs = start_runs(served, req, [prompt_ids], max_tokens, num_logprobs, ids.logged, adapter)
        if req.stream:
            return _sse(streaming.chat_stream(ids.response, runs, req, served.tokenizer), ids)
        deltas = await _collect_or_gone(raw, runs)
        if deltas is None:
            return Response(status_code=499)
        choices = [_chat_choice(served, req, delta, i) for i, delta in enumerate(deltas)]
        body = envelope(ids.response, "chat.completion", int(time.time()), req.model, choices, total_usage(runs, req.n))
        if (prompt := _prompt_logprobs(served, prompt_ids, deltas[0])) is not None:
            body["prompt_logprobs"] = prompt  # vLLM puts them on the response
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt_ids
        return _with_id(json_response(body), ids)


def _completion_choices(
    served: Served, req: CompletionRequest, deltas: list[Delta], prompt_ids: list[list[int]]
) -> list[dict[str, Any]]:
    """Choice i * n + j: prompt i's choice j. Prompt logprobs go on each choice of their prompt, as
    in vLLM; the prompt's first choice computed them."""
    prompts = [_prompt_logprobs(served, ids, deltas[i * req.n]) for i, ids in enumerate(prompt_ids)]
    choices = []
    for index, delta in enumerate(deltas):
        prompt_index = index // req.n
        choice = _completion_choice(served, req, delta, index, prompt_ids[prompt_index])
        if prompts[prompt_index] is not None:
            choice["prompt_logprobs"] = prompts[prompt_index]
        choices.append(choice)
    return choices


def _completion_choice(
    served: Served, req: CompletionRequest, delta: Delta, index: int, prompt_ids: list[int]
) -> dict[str, Any]:
    logprobs = completion_logprobs(served.tokenizer, delta.token_ids, delta.logprobs, 0)
    choice = completion_choice(delta, logprobs, req.return_token_ids, index)
    if req.return_token_ids:
        choice["prompt_token_ids"] = prompt_ids
    return choice


def _prompt_logprobs(served: Served, prompt_ids: list[int], first: Delta) -> PromptLogprobsBody | None:
    """The prompt logprobs of choice 0's delta, if the request asked for them."""
    if first.prompt_logprobs is None:
        return None
    return prompt_logprobs_body(served.tokenizer, prompt_ids, first.prompt_logprobs)


def _chat_choice(served: Served, req: ChatCompletionRequest, delta: Delta, index: int) -> dict[str, Any]:
    logprobs = chat_logprobs(served.tokenizer, delta.token_ids, delta.logprobs)
    return chat_choice(delta, logprobs, req.return_token_ids, stream=False, index=index)


async def check_request(req: SamplingFields, served: Served) -> ResolvedAdapter | None:
    """Check the request and admit it; return the adapter it asks for (None: the base model),
    loaded on demand if it was not registered yet."""
    req.check()
    adapter = await served.resolver.resolve(req.model, req.lora_path)
    req.model = reported_model(req.model, served.config)
    req.check_n(served.config.max_n)
    if (reason := served.engine.unavailable_reason()) is not None:
        raise EngineDeadError(reason)
    check_capacity(served.engine, served.config, req.num_choices())
    return adapter


def reported_model(model: str, config: EngineConfig) -> str:
    """The `model` a response names, as in vLLM: the base model's first --served-model-name
    whichever of its names was asked for; an adapter its own name."""
    return config.served_model_name if model in config.served_model_aliases else model


def check_capacity(engine: EngineClientBase, config: EngineConfig, n: int) -> None:
    """503 + Retry-After once this process's in-flight engine requests would exceed
    max_num_seqs + max_waiting_requests (each of the n choices counts)."""
    limit = config.max_num_seqs + config.max_waiting_requests
    if engine.num_in_flight + n > limit:
        raise ApiError(
            503,
            f"The server is overloaded ({limit} requests in flight); retry later.",
            None,
            {"Retry-After": str(RETRY_AFTER_S)},  # error_response adds it to every 503 too
        )


def _request_id(served: Served, raw: Request, kind: str, num_choices: int) -> request_ids.RequestId:
    """The request's ids (request_ids.py); 400 if the client's X-Request-Id is in flight."""
    ids = request_ids.request_id(raw.headers.get(request_ids.HEADER), kind, served.req_ids)
    engine_ids = [choice_req_id(ids.logged, index, num_choices) for index in range(num_choices)]
    request_ids.refuse_in_flight([i for i in engine_ids if served.engine.is_in_flight(i)])
    return ids


def _with_id(response: Response, ids: request_ids.RequestId) -> Response:
    response.headers[request_ids.HEADER] = ids.logged
    return response


def start_runs(
    served: Served,
    req: SamplingFields,
    prompt_ids: list[list[int]],
    max_tokens: int | None,
    num_logprobs: int | None,
    req_id: str,
    adapter: ResolvedAdapter | None,
) -> list[RequestRun]:
    """One RequestRun per choice: prompt i's choice j is choice i * n + j (engine ids
    `<req_id>-<index>` when there are several). Each names the adapter's version as
    resolved: should the name be unloaded and loaded afresh before the request arrives, the core
    refuses it rather than run another adapter. Every prompt is checked before any run exists."""
    config = served.config
    copies = req.n if isinstance(req, CompletionRequest) else 1  # a chat's response carries them once
    check_response_size(req.prompt_logprobs, [len(ids) for ids in prompt_ids], copies, config.max_model_len)
    params = [
        inputs.sampling_params(
            req, max_tokens, num_logprobs, len(ids), config.max_model_len, served.vocab_size, served.defaults
        )
        for ids in prompt_ids
    ]
    num_choices = len(prompt_ids) * req.n
    runs = []
    for index in range(num_choices):
        prompt_index, choice = divmod(index, req.n)
        arrived = RequestArrived(
            req_id=choice_req_id(req_id, index, num_choices),
            prompt_token_ids=prompt_ids[prompt_index],
            sampling=choice_params(params[prompt_index], choice),
            arrival_time_s=time.time(),
            lora_name=adapter.info.name if adapter is not None else None,
            lora_version_id=adapter.info.version_id if adapter is not None else 0,
            on_demand=adapter.on_demand if adapter is not None else None,
        )
        runs.append(RequestRun(served.engine, served.tokenizer, arrived, req.stop_list(), req.skip_special_tokens))
    return runs


async def _collect_or_gone(raw: Request, runs: list[RequestRun]) -> list[Delta] | None:
    try:
        return await until_disconnect(raw, collect_all(runs))
    except ClientGone:
        return None


def _sse(chunks: AsyncIterator[str], ids: request_ids.RequestId) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", request_ids.HEADER: ids.logged}
    return StreamingResponse(chunks, media_type="text/event-stream", headers=headers)
