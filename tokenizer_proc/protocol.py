"""OpenAI (and vLLM-extension) request schemas for completions and chat completions.

Responses are plain dicts built in `responses.py`; requests are validated here. Field
constraints produce pydantic errors that the app turns into 400s naming the `param`.
A field no model declares is kept aside by pydantic and refused in `check` (request_fields.py
says which are known but not supported yet).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt
from pydantic_core import PydanticCustomError

from ledgerserve.tokenizer_proc.request_fields import refusal, shown_name

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_SEED = (1 << 63) - 1  # seeds are int64; choice i of n uses seed + i, wrapped into range
MIN_SEED = -(1 << 63)
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_METADATA = 16  # OpenAI's bounds on `metadata`: pairs, key and value lengths
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class InvalidParam(ValueError):
    """A request that parses but makes no sense; becomes a 400 naming `param`."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


PositiveInt = Annotated[StrictInt, Field(ge=1)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
# the sampling fields' bounds, shared with the defaults of `--generation-config` (generation_defaults.py)
Temperature = Annotated[float, Field(ge=0.0, le=100.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[StrictInt, Field(ge=-1)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=100.0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: StrictBool = False


BiasValue = Annotated[float, Field(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]
MetadataKey = Annotated[str, Field(max_length=MAX_METADATA_KEY_CHARS)]
MetadataValue = Annotated[str, Field(max_length=MAX_METADATA_VALUE_CHARS)]


class SamplingFields(BaseModel):
    """Fields shared by both endpoints. Undeclared fields land in `model_extra` and are refused
    by `check` unless they ask for nothing; the schema says none are allowed."""

    model_config = ConfigDict(allow_inf_nan=False, extra="allow", json_schema_extra={"additionalProperties": False})

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    seed: Annotated[StrictInt, Field(ge=MIN_SEED, le=MAX_SEED)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = (
        None
    )
    ignore_eos: StrictBool = False
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    n: Annotated[StrictInt, Field(ge=1)] = 1  # at most config.max_n, checked in check_n
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # token id (a decimal string in JSON) -> bias added to its logit before sampling
    logit_bias: Annotated[dict[str | StrictInt, BiasValue], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    return_token_ids: StrictBool = False
    skip_special_tokens: StrictBool = True
    lora_path: str | None = None  # extension: a loaded adapter's name or path
    prompt_logprobs: Annotated[StrictInt, Field(ge=-1, le=MAX_LOGPROBS)] | None = None  # vLLM extension
    # accepted and not acted on: identifiers of the caller, and tool-call options without tools
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA)] | None = None
    parallel_tool_calls: StrictBool | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check(self) -> None:
        """Undeclared fields, then cross-field checks that pydantic's per-field constraints can't express."""
        for name, value in (self.model_extra or {}).items():
            if (message := refusal(name, value)) is not None:
                raise InvalidParam(message, shown_name(name))
        if self.stream_options is not None and not self.stream:
            raise InvalidParam("stream_options is only allowed when stream is true", "stream_options")
        stops = self.stop_list()
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidParam(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
        if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in stops):
            raise InvalidParam(f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters", "stop")
        if self.prompt_logprobs == -1:
            raise InvalidParam(
                f"prompt_logprobs=-1 (the whole vocabulary) is not supported; ask for at most {MAX_LOGPROBS}",
                "prompt_logprobs",
            )

    def num_choices(self) -> int:
        """The engine requests this request becomes."""
        return self.n

    def check_n(self, max_n: int) -> None:
        if self.num_choices() > max_n:
            raise InvalidParam(f"n must be at most {max_n}", "n")


TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class CompletionRequest(SamplingFields):
    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: PositiveInt | None = None  # only best_of == n (no server-side ranking)

    def check(self) -> None:
        super().check()
        if any(prompt in ("", []) for prompt in self.prompts()):
            raise InvalidParam("prompt must not be empty", "prompt")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParam("best_of must equal n (ranking choices is not supported)", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: a list of strings or of token-id lists holds several (`[]`: one, empty)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]  # type: ignore[list-item]

    def num_choices(self) -> int:
        """n choices for each prompt: prompt i's choice j is choice i * n + j, as in OpenAI's API."""
        return self.n * len(self.prompts())

    def check_n(self, max_n: int) -> None:
        num_prompts = len(self.prompts())
        if num_prompts > 1 and self.num_choices() > max_n:
            raise InvalidParam(
                f"n times the number of prompts ({self.n} x {num_prompts}) must be at most {max_n}", "prompt"
            )
        super().check_n(max_n)


NON_TEXT_PARTS = {  # content part type -> what it carries
    "image_url": "image",
    "input_image": "image",
    "image": "image",
    "image_embeds": "image",
    "input_audio": "audio",
    "audio_url": "audio",
    "video_url": "video",
    "file": "file",
    "input_file": "file",
}


def _text_only(part: Any) -> Any:
    kind = part.get("type") if isinstance(part, dict) else None
    if isinstance(kind, str) and kind in NON_TEXT_PARTS:
        raise PydanticCustomError(
            "content_part_not_supported", "{kind} content parts are not supported yet", {"kind": NON_TEXT_PARTS[kind]}
        )
    return part


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


ContentPart = Annotated[TextPart, BeforeValidator(_text_only)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. tool_calls of earlier turns: the template renders them

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True
    chat_template: str | None = None  # request-supplied templates are refused
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.chat_template is not None:
            raise InvalidParam("request-supplied chat templates are not allowed", "chat_template")
        if self.top_logprobs and not self.logprobs:
            raise InvalidParam("top_logprobs requires logprobs to be true", "top_logprobs")

    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeFields(BaseModel):
    """vLLM's /tokenize and /detokenize bodies: `model` may be left out, or name the base model or
    an adapter (they share the tokenizer). Undeclared fields are refused as in SamplingFields."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"additionalProperties": False})

    model: str | None = None

    def check(self) -> None:
        for name, value in (self.model_extra or {}).items():
            if (message := refusal(name, value)) is not None:
                raise InvalidParam(message, shown_name(name))


class TokenizeCompletionRequest(TokenizeFields):
    prompt: str
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(TokenizeFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False  # the template writes the special tokens
    return_token_strs: StrictBool = False
    chat_template: str | None = None  # request-supplied templates are refused
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.chat_template is not None:
            raise InvalidParam("request-supplied chat templates are not allowed", "chat_template")


class DetokenizeRequest(TokenizeFields):
    tokens: TokenIds
