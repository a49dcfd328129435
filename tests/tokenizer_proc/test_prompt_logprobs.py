"""prompt_logprobs in responses, on the in-process app over the fake engine (which reports them in
two chunks, fake_engine.fake_prompt_logprobs): vLLM's shape, on every choice of a completion and
on the chat response, in the first chunk of a stream; choice 0 alone computes them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.app import build_app
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
MODEL = "demo"
PROMPT = [5, 9, 254, 40, 41, 7]  # token ids; 254 + 1 + j wraps past 255
MESSAGES = [{"role": "user", "content": "hi there"}]


@pytest.fixture
async def client(engine: FakeEngine, tokenizer, demo_model_dir: str) -> AsyncIterator[httpx.AsyncClient]:
    config = EngineConfig(model_dir=demo_model_dir, served_model_name=MODEL, max_model_len=64)
    app = build_app(engine, tokenizer, config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


def expected(tokenizer, prompt: list[int], k: int) -> list[dict[str, Any] | None]:
    """vLLM's entries for fake_prompt_logprobs' values, as JSON reads them back (string keys)."""
    out: list[dict[str, Any] | None] = [None]
    for p in range(1, len(prompt)):
        entry = {str(prompt[p]): {"logprob": -p / 10, "rank": p + 1, "decoded_token": tokenizer.decode([prompt[p]])}}
        for j in range(k):
            token_id = (prompt[p] + (p % 2 == 0) + j) % 256
            entry[str(token_id)] = {
                "logprob": -(j + 1) / 100,
                "rank": j + 1,
                "decoded_token": tokenizer.decode([token_id]),
            }
        out.append(entry)
    return out


def _events(text: str) -> list[dict]:
    chunks = [c[len("data: ") :] for c in text.split("\n\n") if c]
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


async def test_completion_choices_all_carry_choice_0s(client, engine, tokenizer) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "n": 3, "prompt_logprobs": 2}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    want = expected(tokenizer, PROMPT, 2)
    assert want[1]["9"]["rank"] == 1 and len(want[2]) == 3  # odd positions: the prompt token is the top one
    assert [c["prompt_logprobs"] for c in choices] == [want] * 3
    assert [a.sampling.prompt_logprobs for a in engine.arrivals] == [2, None, None]
    plain = await client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert "prompt_logprobs" not in plain.json()["choices"][0]


async def test_chat_response_carries_them_once(client, engine, tokenizer) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "n": 2, "prompt_logprobs": 0}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    prompt = list(engine.arrivals[0].prompt_token_ids)
    assert r.json()["prompt_logprobs"] == expected(tokenizer, prompt, 0)
    assert all("prompt_logprobs" not in c for c in r.json()["choices"])


async def test_completion_stream_puts_them_in_each_choices_first_chunk(client, engine, tokenizer) -> None:
    engine.prompt_delay_s = 0.05  # choice 1's tokens come first: they wait for choice 0's
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "n": 2, "prompt_logprobs": 1, "stream": True}
    r = await client.post("/v1/completions", json=body)
    events = _events(r.text)
    assert events[0]["choices"][0]["index"] == 0
    want = expected(tokenizer, PROMPT, 1)
    for index in (0, 1):
        chunks = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert chunks[0]["prompt_logprobs"] == want
        assert all("prompt_logprobs" not in c for c in chunks[1:])
        assert "".join(c["text"] for c in chunks) == tokenizer.decode([PROMPT[i % len(PROMPT)] for i in range(3)])


async def test_chat_stream_puts_them_in_the_first_chunk(client, engine, tokenizer) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 3, "stream": True}
    events = _events((await client.post("/v1/chat/completions", json=body)).text)
    prompt = list(engine.arrivals[0].prompt_token_ids)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[0]["prompt_logprobs"] == expected(tokenizer, prompt, 3)
    assert all("prompt_logprobs" not in e for e in events[1:])


async def test_one_token_prompt_has_only_position_0(client) -> None:
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 1, "prompt_logprobs": 4}
    )
    assert r.json()["choices"][0]["prompt_logprobs"] == [None]


@pytest.mark.parametrize("value", [-1, -2, 21, "2", 1.5, True])
async def test_bad_values_are_400s_naming_the_field(client, value) -> None:
    for route, body in [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MESSAGES})]:
        r = await client.post(route, json={"model": MODEL, "max_tokens": 2, "prompt_logprobs": value, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
    if value == -1:
        assert "whole vocabulary" in r.json()["error"]["message"]
