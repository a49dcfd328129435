"""Turn a validated request into prompt token ids and SamplingParams (raising 400s)."""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.tokenizer_proc.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ReservedVariable,
    render_char_budget,
)
from ledgerserve.tokenizer_proc.generation_defaults import GenerationDefaults
from ledgerserve.tokenizer_proc.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidParam,
    SamplingFields,
    TokenizeChatRequest,
)

# Tokenizing and detokenizing run on these threads, never on the event loop: the Rust tokenizer
# releases the GIL, so other requests (and /health) go on while a long prompt is tokenized.
NUM_TOKENIZER_THREADS = 4
_TOKENIZER_THREADS = ThreadPoolExecutor(NUM_TOKENIZER_THREADS, thread_name_prefix="tokenizer")
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,12}")  # logit_bias keys: token ids written in decimal
T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on a tokenizer thread."""
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREADS, functools.partial(fn, *args))


async def encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return await off_loop(_encode, tokenizer, text, add_special_tokens)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


async def completion_prompt_ids(req: CompletionRequest, tokenizer: Any, max_model_len: int) -> list[list[int]]:
    """Each of the request's prompts as token ids."""
    return [await _prompt_ids(prompt, tokenizer, max_model_len) for prompt in req.prompts()]


async def _prompt_ids(prompt: str | list[int], tokenizer: Any, max_model_len: int) -> list[int]:
    if isinstance(prompt, str):
        return await text_prompt_ids(prompt, tokenizer, max_model_len, add_special_tokens=True)
    check_token_ids(prompt, len(tokenizer), "prompt")
    return list(prompt)


async def text_prompt_ids(text: str, tokenizer: Any, max_model_len: int, add_special_tokens: bool) -> list[int]:
    budget = render_char_budget(max_model_len)
    if len(text) > budget:  # far past max_model_len tokens: refuse before tokenizing
        raise InvalidParam(f"the prompt is longer than {budget} characters", "prompt")
    return await encode(tokenizer, text, add_special_tokens)


async def chat_prompt_ids(
    req: ChatCompletionRequest | TokenizeChatRequest,
    tokenizer: Any,
    template: ChatTemplate | None,
    max_model_len: int,
    add_special_tokens: bool = False,
) -> list[int]:
    """The rendered chat's token ids; the template writes any BOS/special tokens as text, so none
    are added unless `add_special_tokens` (a /tokenize request may ask)."""
    if template is None:
        raise InvalidParam("this model has no chat template; use /v1/completions", "messages")
    messages = [_message_dict(m) for m in req.messages]
    try:
        text = await template.render_isolated(
            messages, req.add_generation_prompt, req.chat_template_kwargs, max_chars=render_char_budget(max_model_len)
        )
    except ReservedVariable as exc:
        raise InvalidParam(str(exc), "chat_template_kwargs") from exc
    except ChatTemplateError as exc:
        raise InvalidParam(str(exc), "messages") from exc
    return await encode(tokenizer, text, add_special_tokens)


def _message_dict(message: Any) -> dict[str, Any]:
    data = message.model_dump(exclude_none=True)
    data["content"] = message.text()
    return data


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> None:
    for token_id in token_ids:
        if token_id < 0 or token_id >= vocab_size:
            raise InvalidParam(f"token id {token_id} is out of range [0, {vocab_size})", param)


def logit_bias_pairs(bias: Mapping[str | int, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """A request's logit_bias as (token id, bias) pairs in id order, zero biases left out."""
    by_id: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if isinstance(key, str) and not _TOKEN_ID_KEY.fullmatch(key):
            raise InvalidParam("logit_bias keys must be token ids, written in decimal", "logit_bias")
        token_id = int(key)
        if token_id in by_id:
            raise InvalidParam(f"logit_bias names token id {token_id} more than once", "logit_bias")
        check_token_ids([token_id], vocab_size, "logit_bias")
        by_id[token_id] = float(value)
    return tuple((token_id, value) for token_id, value in sorted(by_id.items()) if value != 0.0)


def sampling_params(
    req: SamplingFields,
    max_tokens: int | None,
    num_logprobs: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    vocab_size: int,
    defaults: GenerationDefaults,
) -> SamplingParams:
    """The request's sampling fields; a field it leaves out takes `defaults` (`--generation-config`),
    else the engine's own."""
    prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    if num_prompt_tokens >= max_model_len:
        raise InvalidParam(
            f"This model's maximum context length is {max_model_len} tokens, "
            f"but the prompt has {num_prompt_tokens} tokens.",
            prompt_param,
        )
    room = max_model_len - num_prompt_tokens
    if max_tokens is not None and max_tokens > room:
        raise InvalidParam(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens} in the completion).",
            "max_tokens",
        )
    stop_token_ids = tuple(req.stop_token_ids or ())
    check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    if req.top_k is not None and req.top_k > vocab_size:  # a default's top_k was checked at start-up
        raise InvalidParam(f"top_k must be -1, 0 (off) or at most the vocabulary size {vocab_size}", "top_k")
    resolved_max = max_tokens if max_tokens is not None else min(_or(defaults.max_tokens, room), room)
    if req.min_tokens > resolved_max:
        raise InvalidParam("min_tokens must not exceed max_tokens", "min_tokens")
    return SamplingParams(
        max_tokens=resolved_max,
        temperature=_or(req.temperature, _or(defaults.temperature, 1.0)),
        top_p=_or(req.top_p, _or(defaults.top_p, 1.0)),
        top_k=max(_or(req.top_k, _or(defaults.top_k, 0)), 0),  # -1 (vLLM) and 0 both disable top-k
        min_p=_or(req.min_p, _or(defaults.min_p, 0.0)),
        seed=req.seed,
        presence_penalty=_or(req.presence_penalty, 0.0),
        frequency_penalty=_or(req.frequency_penalty, 0.0),
        repetition_penalty=_or(req.repetition_penalty, _or(defaults.repetition_penalty, 1.0)),
        stop_token_ids=stop_token_ids,
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=num_logprobs,
        prompt_logprobs=req.prompt_logprobs,
        logit_bias=logit_bias_pairs(req.logit_bias, vocab_size),
    )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value
