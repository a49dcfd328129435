"""Text is validated at the edge: a lone UTF-16 surrogate anywhere in a body is a 400 naming
where it is (never a 500), and long prompts are tokenized off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from ledgerserve.tokenizer_proc.text_check import first_bad_text
from tests.tokenizer_proc.app_client import (
    CLIENT_TIMEOUT_S,
    GOOD_COMPLETION,
    MODEL,
    app_client,
    assert_error,
    assert_still_serves,
)
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
HIGH, LOW = "\ud800", "\udfff"
LONG_CHARS = 64 << 10  # a text this long is held in encode until released
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}


@pytest.fixture
async def client(engine, tokenizer, demo_model_dir: str, tmp_path) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(engine, tokenizer, demo_model_dir, enable_lora=True, lora_allowed_dirs=(str(tmp_path),)) as c:
        yield c


async def _post_escaped(client: httpx.AsyncClient, route: str, body: Any) -> httpx.Response:
    """json.dumps escapes a lone surrogate as `\\ud800`, as a client in another language would send it."""
    content = json.dumps(body).encode("ascii")
    return await client.post(route, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    ("route", "body", "param", "where"),
    [
        ("/v1/completions", {**GOOD_COMPLETION, "prompt": HIGH}, "prompt", "`prompt`"),
        ("/v1/completions", {**GOOD_COMPLETION, "prompt": ["ok " + LOW]}, "prompt", "`prompt.0`"),
        ("/v1/completions", {**GOOD_COMPLETION, "model": HIGH}, "model", "`model`"),
        ("/v1/completions", {**GOOD_COMPLETION, "stop": "a" + HIGH}, "stop", "`stop`"),
        ("/v1/completions", {**GOOD_COMPLETION, "stop": ["ok", LOW]}, "stop", "`stop.1`"),
        ("/v1/completions", {**GOOD_COMPLETION, "user": HIGH}, "user", "`user`"),
        ("/v1/completions", {**GOOD_COMPLETION, "lora_path": HIGH}, "lora_path", "`lora_path`"),
        ("/v1/completions", {**GOOD_COMPLETION, "metadata": {"k": HIGH}}, "metadata", "`metadata.k`"),
        ("/v1/completions", {**GOOD_COMPLETION, "logit_bias": {HIGH: 1}}, "logit_bias", "a key of `logit_bias`"),
        ("/v1/completions", {**GOOD_COMPLETION, HIGH: 1}, None, "a field name"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": HIGH}]},
            "messages",
            "`messages.0.content`",
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "messages": [
                    MESSAGES[0],
                    {"role": "user", "content": [{"type": "text", "text": "fine"}, {"type": "text", "text": LOW}]},
                ],
            },
            "messages",
            "`messages.1.content.1.text`",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "x", "name": HIGH}]},
            "messages",
            "`messages.0.name`",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "chat_template_kwargs": {"enable_thinking": HIGH}},
            "chat_template_kwargs",
            "`chat_template_kwargs.enable_thinking`",
        ),
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [{"function": {"description": LOW}}]},
            "tools",
            "`tools.0.function.description`",
        ),
        ("/v1/load_lora_adapter", {"lora_name": HIGH, "lora_path": "x"}, "lora_name", "`lora_name`"),
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/tmp/" + LOW}, "lora_path", "`lora_path`"),
        ("/v1/unload_lora_adapter", {"lora_name": HIGH}, "lora_name", "`lora_name`"),
    ],
)
async def test_a_lone_surrogate_is_refused_naming_the_field(client, engine, route, body, param, where) -> None:
    message = assert_error(await _post_escaped(client, route, body), 400, param)
    assert message.startswith(where) and "not valid UTF-8" in message, message
    assert engine.received == []
    await assert_still_serves(client)


async def test_a_surrogate_in_raw_bytes_is_refused(client) -> None:
    """Python's JSON decoder turns the bytes ED A0 80 (a UTF-8-encoded surrogate) into one."""
    content = b'{"model": "demo", "max_tokens": 2, "prompt": "ok \xed\xa0\x80"}'
    r = await client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert_error(r, 400, "prompt")
    await assert_still_serves(client)


async def test_paired_surrogates_and_other_edge_text_are_served(client, engine) -> None:
    text = "\ud83d\ude00 a\u0301 \u200f\u05e9 \u2028\u2029\x85 \x00 \U0001f600"  # emoji written as a pair
    r = await _post_escaped(client, "/v1/completions", {**GOOD_COMPLETION, "prompt": text, "stop": ["\u2028"]})
    assert r.status_code == 200, r.text
    assert engine.arrivals[0].prompt_token_ids  # tokenized as given


def test_walk_reaches_any_depth() -> None:
    deep: Any = "fine"
    for _ in range(5000):
        deep = [deep]
    assert first_bad_text({"a": deep}) is None
    assert first_bad_text({"a": [deep, {"b": ["x", HIGH]}]}) == (("a", 1, "b", 1), False)


class GatedTokenizer:
    """The demo tokenizer; long texts wait in encode until `release` is set, noting the thread."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.release = threading.Event()
        self.long_started = threading.Event()
        self.long_finished = False
        self.threads: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        long = len(text) > LONG_CHARS
        self.threads["long" if long else "short"] = threading.get_ident()
        if long:
            self.long_started.set()
            self.release.wait(timeout=5.0)
        ids = self._tokenizer.encode(text, **kwargs)
        self.long_finished = self.long_finished or long
        return ids


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_a_long_prompt_is_tokenized_off_the_event_loop(tokenizer, demo_model_dir: str, route: str) -> None:
    """While a long prompt is being tokenized, a short request is answered (within the client
    timeout); the long one then ends with its own answer (here: too long for the model)."""
    gated = GatedTokenizer(tokenizer)
    text = "The river ran past the mill. " * (LONG_CHARS // 16)
    long_body = (
        {**GOOD_COMPLETION, "prompt": text}
        if route == "/v1/completions"
        else {**CHAT, "messages": [{"role": "user", "content": text}]}
    )
    async with app_client(FakeEngine(), gated, demo_model_dir) as client:
        long_request = asyncio.ensure_future(client.post(route, json=long_body))
        while not gated.long_started.is_set():
            assert not long_request.done(), long_request.result().text
            await asyncio.sleep(0.01)
        async with asyncio.timeout(CLIENT_TIMEOUT_S):
            short = await client.post("/v1/completions", json=GOOD_COMPLETION)
        assert short.status_code == 200 and not gated.long_finished  # answered while the long one tokenizes
        gated.release.set()
        assert_error(await long_request, 400, "messages" if "chat" in route else "prompt")
    assert threading.get_ident() not in (gated.threads["long"], gated.threads["short"])  # neither on the loop
