"""The model's chat template, rendered in a jinja2 immutable sandbox.

Only the template shipped with the tokenizer (tokenizer_config.json, or chat_template.jinja
beside it), or the one the server was started with (--chat-template), is ever rendered;
templates supplied by a request are refused upstream.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 2.0  # wall-clock budget for one render, checked between output chunks
MIN_RENDER_CHARS = 1 << 20  # the size budget is max(this, 16 x max_model_len) characters
CHARS_PER_TOKEN_BUDGET = 16


def render_char_budget(max_model_len: int) -> int:
    """Most characters a rendered prompt may have: far more than max_model_len tokens need."""
    return max(MIN_RENDER_CHARS, CHARS_PER_TOKEN_BUDGET * max_model_len)


RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


class ChatTemplateError(ValueError):
    """The messages could not be rendered (bad content, or the template raised)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = _tojson
        self._template = env.from_string(source)
        self._bos_token = bos_token or ""
        self._eos_token = eos_token or ""

    @classmethod
    def from_model_dir(cls, model_dir: str) -> ChatTemplate | None:
        config = _read_tokenizer_config(Path(model_dir))
        source = _template_source(Path(model_dir), config)
        if source is None:
            return None
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    @classmethod
    def for_tokenizer(cls, tokenizer_dir: str, override: str = "") -> ChatTemplate | None:
        """The tokenizer's template, or `override` (--chat-template: a file, or the template itself)
        in its place; ValueError if the override cannot be read or does not compile."""
        if not override:
            return cls.from_model_dir(tokenizer_dir)
        config = _read_tokenizer_config(Path(tokenizer_dir))
        try:
            return cls(
                read_override(override), _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
            )
        except TemplateError as exc:
            raise ValueError(f"--chat-template does not compile: {exc}") from None

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
        max_chars: int = MIN_RENDER_CHARS,
        max_seconds: float = RENDER_SECONDS,
    ) -> str:
        """Render in the sandbox; ChatTemplateError past `max_chars` or `max_seconds`."""
        variables = {k: v for k, v in (extra or {}).items() if k not in RESERVED_VARIABLES}
        try:
            chunks = self._template.generate(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self._bos_token,
                eos_token=self._eos_token,
                **variables,
            )
            return _within_budget(chunks, max_chars, max_seconds)
        except ChatTemplateError:
            raise
        except TemplateError as exc:  # includes SecurityError from the sandbox
            raise ChatTemplateError(f"chat template failed: {exc}") from exc


def _within_budget(chunks: Iterator[str], max_chars: int, max_seconds: float) -> str:
    deadline = time.monotonic() + max_seconds
    parts: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        parts.append(chunk)
        if size > max_chars:
            raise ChatTemplateError(f"the rendered chat is longer than {max_chars} characters")
        if time.monotonic() > deadline:
            raise ChatTemplateError(f"rendering the chat template took longer than {max_seconds:g} s")
    return "".join(parts)


def read_override(value: str) -> str:
    """--chat-template's text: the file `value` names, else `value` itself when it reads as a
    template (it holds `{`, `}` or a newline), as vLLM takes it."""
    if os.path.isfile(value):
        try:
            return Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--chat-template {value!r} cannot be read: {exc}") from None
    if any(ch in value for ch in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a template (a template holds {{ or }})")


def _read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "tokenizer_config.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text(encoding="utf-8"))


def _template_source(model_dir: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):  # AddedToken serialised as a dict
        return token.get("content")
    return token if isinstance(token, str) else None
