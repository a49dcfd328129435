"""vLLM's `/tokenize` and `/detokenize`: the served tokenizer (and chat template) without generating.

`/tokenize` takes a completion's `prompt` or a chat's `messages` and answers
`{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` null unless
`return_token_strs`); `/detokenize` takes `tokens` and answers `{"prompt"}`, special tokens
kept. `model` may be left out or name the base model or a registered adapter (all share the
tokenizer); any other name is a 404. Prompts have the same size bound as a completion's, and
neither route takes more than `max_model_len` tokens (400), as vLLM's. The tokenizer runs on
the tokenizer threads, off the event loop.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI
from pydantic import Discriminator, Tag

from ledgerserve.tokenizer_proc import inputs
from ledgerserve.tokenizer_proc.errors import ApiError
from ledgerserve.tokenizer_proc.generate_routes import Served
from ledgerserve.tokenizer_proc.protocol import (
    DetokenizeRequest,
    InvalidParam,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeFields,
)


def _kind(body: Any) -> str:
    """Which of vLLM's two /tokenize bodies this is: the one with `messages` is a chat's."""
    return "chat" if isinstance(body, dict) and "messages" in body else "completion"


TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("completion")] | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(_kind),
]


def add_tokenize_routes(app: FastAPI, served: Served) -> None:
    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        check_request(req, served)
        max_model_len = served.config.max_model_len
        if isinstance(req, TokenizeChatRequest):
            template = served.chat_template
            ids = await inputs.chat_prompt_ids(req, served.tokenizer, template, max_model_len, req.add_special_tokens)
        else:
            ids = await inputs.text_prompt_ids(req.prompt, served.tokenizer, max_model_len, req.add_special_tokens)
        check_length(len(ids), max_model_len, "messages" if isinstance(req, TokenizeChatRequest) else "prompt")
        strs = await inputs.off_loop(_token_strs, served.tokenizer, ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, str]:
        check_request(req, served)
        check_length(len(req.tokens), served.config.max_model_len, "tokens")
        inputs.check_token_ids(req.tokens, served.vocab_size, "tokens")
        return {"prompt": await inputs.off_loop(served.tokenizer.decode, req.tokens)}


def check_length(num_tokens: int, max_model_len: int, param: str) -> None:
    if num_tokens > max_model_len:
        raise InvalidParam(
            f"This model's maximum context length is {max_model_len} tokens, but the request has {num_tokens} tokens.",
            param,
        )


def _token_strs(tokenizer: Any, ids: list[int]) -> list[str]:
    return list(tokenizer.convert_ids_to_tokens(ids))


def check_request(req: TokenizeFields, served: Served) -> None:
    """Its fields, then its model: none, the base model or a registered adapter."""
    req.check()
    model = req.model
    if model is None or model == served.config.served_model_name:
        return
    if served.config.enable_lora and served.adapters.get(model) is not None:
        return
    raise ApiError(404, f"The model `{model}` does not exist.", "model")
