from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.app import build_app
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
MODEL = "demo"


@pytest.fixture
async def client(engine: FakeEngine, tokenizer, demo_model_dir: str) -> AsyncIterator[httpx.AsyncClient]:
    config = EngineConfig(model_dir=demo_model_dir, served_model_name=MODEL, max_model_len=64)
    app = build_app(engine, tokenizer, config)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def _events(body: str) -> list:
    chunks = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


async def test_completion_echoes_prompt(client, engine, tokenizer) -> None:
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    ids = tokenizer.encode("hello there")
    assert body["choices"][0]["text"] == tokenizer.decode((ids * 2)[:2])
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 2,
        "total_tokens": len(ids) + 2,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    arrived = engine.arrivals[0]
    assert arrived.prompt_token_ids == ids and arrived.sampling.max_tokens == 2


async def test_completion_token_prompt_and_return_token_ids(client, engine) -> None:
    prompt = [5, 6, 7] + list(range(10, 24))  # 17 tokens: a second request finds its first block (16) cached
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "return_token_ids": True}
    assert (await client.post("/v1/completions", json=payload)).status_code == 200
    body = (await client.post("/v1/completions", json=payload)).json()
    assert body["choices"][0]["token_ids"] == [5, 6, 7, 10]
    assert body["prompt_token_ids"] == prompt
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


async def test_sampling_params_reach_engine(client, engine) -> None:
    payload = {
        "model": MODEL,
        "prompt": ["x y"],
        "max_tokens": 3,
        "temperature": 0,
        "top_p": 0.5,
        "top_k": -1,
        "min_p": 0.1,
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.2,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "min_tokens": 1,
        "logprobs": 2,
    }
    assert (await client.post("/v1/completions", json=payload)).status_code == 200
    s = engine.arrivals[0].sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.0, 0.5, 0, 0.1, 7)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (s.stop_token_ids, s.ignore_eos, s.min_tokens, s.logprobs) == ((2,), True, 1, 2)


async def test_default_max_tokens_fills_context(client, engine) -> None:
    await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3, 4]})
    assert engine.arrivals[0].sampling.max_tokens == 60


async def test_completion_logprobs(client) -> None:
    payload = {"model": MODEL, "prompt": [40, 41], "max_tokens": 2, "logprobs": 1}
    lp = (await client.post("/v1/completions", json=payload)).json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.25, -0.25] and len(lp["tokens"]) == 2
    assert len(lp["top_logprobs"]) == 2 and lp["text_offset"][0] == 0


async def test_chat_completion(client, engine, tokenizer) -> None:
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 3,
        "return_token_ids": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    body = (await client.post("/v1/chat/completions", json=payload)).json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert engine.arrivals[0].prompt_token_ids == prompt == body["prompt_token_ids"]
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["token_ids"] == prompt[:3]
    assert len(choice["logprobs"]["content"]) == 3
    assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 2


async def test_chat_stream_with_usage(client, tokenizer) -> None:
    payload = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await client.post("/v1/chat/completions", json=payload)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert text == tokenizer.decode(prompt[:5], skip_special_tokens=True)
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    assert all(e["usage"] is None for e in events[:-1])


async def test_completion_stream_return_token_ids(client) -> None:
    payload = {"model": MODEL, "prompt": [40, 41, 42], "max_tokens": 3, "stream": True, "return_token_ids": True}
    events = _events((await client.post("/v1/completions", json=payload)).text)
    assert events[0]["choices"][0]["prompt_token_ids"] == [40, 41, 42]
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == [40, 41, 42]
    assert "usage" not in events[0]


async def test_stop_string_aborts_engine(client, engine, tokenizer) -> None:
    engine.script = tokenizer.encode("alpha beta gamma delta epsilon")
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 20, "stop": ["gamma"]}
    choice = (await client.post("/v1/completions", json=payload)).json()["choices"][0]
    assert choice["text"] == "alpha beta "
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == "gamma"
    assert [a.reason for a in engine.aborts] == ["stop"]


async def test_stop_string_in_stream(client, engine, tokenizer) -> None:
    engine.script = tokenizer.encode("one two three four")
    payload = {"model": MODEL, "prompt": "x", "max_tokens": 20, "stop": "three", "stream": True}
    events = _events((await client.post("/v1/completions", json=payload)).text)
    assert "".join(e["choices"][0]["text"] for e in events) == "one two "
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
