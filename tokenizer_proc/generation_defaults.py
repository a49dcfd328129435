"""Default sampling fields from a `generation_config.json` (`--generation-config`), as vLLM applies them.

`auto` reads the model directory's file (none there: no defaults), `vllm` reads nothing, any other
value is a directory whose `generation_config.json` is read (missing: the server refuses to start).
Of the file, only the sampling fields the engine has are used: temperature, top_p, top_k, min_p,
repetition_penalty, and max_new_tokens as the default max_tokens. Like vLLM, a field at
transformers' own default (temperature 1.0, top_p 1.0, top_k 50, repetition_penalty 1.0) is left
out, so such a value changes nothing. A request's own fields override every default. The file is
read as JSON (never through transformers, never executing anything); a value out of the request
fields' bounds refuses the start-up, naming the file and the field.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ledgerserve.tokenizer_proc.protocol import PositiveInt, Probability, RepetitionPenalty, Temperature, TopK, TopP
from ledgerserve.tokenizer_proc.security import StartupRefused

FILE_NAME = "generation_config.json"
MAX_FILE_BYTES = 1 << 20  # a generation config is a few hundred bytes
TRANSFORMERS_DEFAULTS: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0}
logger = logging.getLogger(__name__)


class GenerationConfigError(StartupRefused):
    """The generation config cannot be read or holds a value no request could send."""


class GenerationDefaults(BaseModel):
    """The defaults that apply (None: the engine's own); `max_tokens` is the file's max_new_tokens."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False, extra="forbid")

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    repetition_penalty: RepetitionPenalty | None = None
    max_tokens: PositiveInt | None = None

    def applied(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class _FileFields(BaseModel):
    """The file's fields of interest, each checked as a request's would be; the rest are ignored."""

    model_config = ConfigDict(allow_inf_nan=False, extra="ignore")

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    repetition_penalty: RepetitionPenalty | None = None
    max_new_tokens: PositiveInt | None = None


def config_path(setting: str, model_dir: str) -> str | None:
    """The generation_config.json `--generation-config` names (None: none applies)."""
    if setting == "vllm":
        return None
    if setting == "auto":
        path = os.path.join(model_dir, FILE_NAME)
        return path if model_dir and os.path.isfile(path) else None
    path = os.path.join(setting, FILE_NAME)
    if not os.path.isfile(path):
        raise GenerationConfigError(f"--generation-config {setting}: there is no {FILE_NAME} in that directory")
    return path


def load_defaults(setting: str, model_dir: str, vocab_size: int) -> GenerationDefaults:
    """The defaults `--generation-config` gives; GenerationConfigError for an unreadable or invalid file."""
    path = config_path(setting, model_dir)
    if path is None:
        return GenerationDefaults()
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise GenerationConfigError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise GenerationConfigError(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    return parse_defaults(data, path, vocab_size)


def parse_defaults(data: bytes, path: str, vocab_size: int) -> GenerationDefaults:
    """The defaults a generation_config.json's bytes give (`path` names it in errors)."""
    try:
        fields = _FileFields.model_validate_json(data)
    except ValidationError as exc:
        raise GenerationConfigError(f"{path}: {_first_error(exc)}") from None
    if fields.top_k is not None and fields.top_k > vocab_size:
        raise GenerationConfigError(
            f"{path}: top_k must be -1, 0 (off) or at most the vocabulary size {vocab_size}, got {fields.top_k}"
        )
    values = fields.model_dump(exclude_none=True, exclude={"max_new_tokens"})
    kept = {name: value for name, value in values.items() if TRANSFORMERS_DEFAULTS.get(name) != value}
    return GenerationDefaults(**kept, max_tokens=fields.max_new_tokens)


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error.get("loc", ()))
    return f"{where}: {error['msg']}" if where else str(error["msg"])


def log_defaults(defaults: GenerationDefaults, setting: str) -> None:
    """Once at start-up, as vLLM does: which defaults apply, and how to turn them off."""
    applied = defaults.applied()
    if not applied:
        return
    source = "the model's generation_config.json" if setting == "auto" else f"{setting}/{FILE_NAME}"
    logger.info(
        "Using default sampling params from %s: %s (a request's own fields override them; "
        "start with --generation-config vllm to ignore the file)",
        source,
        applied,
    )
