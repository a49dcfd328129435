"""The model's chat template, rendered in a jinja2 immutable sandbox.

Only the template shipped with the tokenizer (tokenizer_config.json, or chat_template.jinja
beside it), or the one the server was started with (--chat-template), is ever rendered;
templates supplied by a request are refused upstream. The HTTP process renders through
`render_isolated`: in a worker process that is killed at the time limit (render_pool.py), since
a template can loop without output, or compute one huge number, where no check can run.
A request's `chat_template_kwargs` may not set a name the renderer sets (RENDERER_VARIABLES)
or a global of the template's environment (`range`, `raise_exception`, ...).
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

from ledgerserve.tokenizer_proc.render_pool import RenderFailed, RenderPool, RenderRequest, RenderSetup

RENDER_SECONDS = 2.0  # wall-clock budget for one render, checked between output chunks
MIN_RENDER_CHARS = 1 << 20  # the size budget is max(this, 16 x max_model_len) characters
CHARS_PER_TOKEN_BUDGET = 16


def render_char_budget(max_model_len: int) -> int:
    """Most characters a rendered prompt may have: far more than max_model_len tokens need."""
    return max(MIN_RENDER_CHARS, CHARS_PER_TOKEN_BUDGET * max_model_len)


RENDERER_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "self"})


class ChatTemplateError(ValueError):
    """The messages could not be rendered (bad content, or the template raised)."""


class ReservedVariable(ChatTemplateError):
    """`chat_template_kwargs` names a variable the renderer sets."""


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
        self.source = source
        self._bos_token = bos_token or ""
        self._eos_token = eos_token or ""
        self.reserved = RENDERER_VARIABLES | frozenset(env.globals)
        self._pool: RenderPool | None = None

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
        """Render in the sandbox, in this process; ChatTemplateError past `max_chars` (or
        `max_seconds`, checked between output chunks) and for anything the template raises."""
        self.check_extra(extra)
        variables = {
            **(extra or {}),
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self._bos_token,
            "eos_token": self._eos_token,
        }
        try:
            return _within_budget(self._template.generate(variables), max_chars, max_seconds)
        except ChatTemplateError:
            raise
        except TemplateError as exc:  # includes SecurityError from the sandbox
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        except Exception as exc:  # the template's own errors: a call of a non-callable, 1/0, ...
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc

    async def render_isolated(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        extra: Mapping[str, Any] | None = None,
        max_chars: int = MIN_RENDER_CHARS,
        max_seconds: float = RENDER_SECONDS,
    ) -> str:
        """As `render`, in a worker process killed at `max_seconds` whatever the template does."""
        self.check_extra(extra)
        if self._pool is None:
            self._pool = RenderPool(RenderSetup(self.source, self._bos_token, self._eos_token))
        request = RenderRequest(list(messages), add_generation_prompt, dict(extra or {}), max_chars, max_seconds)
        try:
            return await self._pool.render(request)
        except RenderFailed as exc:
            raise ChatTemplateError(str(exc)) from None

    def check_extra(self, extra: Mapping[str, Any] | None) -> None:
        """ReservedVariable naming the first of `extra`'s keys the renderer sets itself."""
        for key in extra or {}:
            if key in self.reserved:
                raise ReservedVariable(
                    f"chat_template_kwargs may not set `{key}`: the chat template renderer sets it itself"
                )

    def close(self) -> None:
        """Stop the render workers (a later render starts new ones)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None


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
