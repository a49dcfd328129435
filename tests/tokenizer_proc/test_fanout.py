"""n choices per request (streaming or not, seeded) and the overload 503."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.tokenizer_proc.app import build_app
from ledgerserve.tokenizer_proc.fanout import choice_params
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
MODEL = "demo"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def client(engine: FakeEngine, tokenizer, demo_model_dir: str) -> AsyncIterator[httpx.AsyncClient]:
    config = EngineConfig(
        model_dir=demo_model_dir, served_model_name=MODEL, max_model_len=64, max_num_seqs=2, max_waiting_requests=2
    )
    app = build_app(engine, tokenizer, config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


def _events(text: str) -> list[dict]:
    chunks = [c[len("data: ") :] for c in text.split("\n\n") if c]
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


async def test_completion_n_choices(client, engine) -> None:
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": [5, 6], "max_tokens": 3, "n": 3, "seed": 7}
    )
    body = r.json()
    assert r.status_code == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == 2 and body["usage"]["completion_tokens"] == 9
    assert body["usage"]["total_tokens"] == 11
    arrivals = engine.arrivals
    assert [a.req_id for a in arrivals] == [f"{r.headers['x-request-id']}-{i}" for i in range(3)]
    assert [a.sampling.seed for a in arrivals] == [7, 8, 9]


async def test_chat_n_choices(client, engine) -> None:
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "n": 2})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 4
    assert all(a.sampling.seed is None for a in engine.arrivals)


async def test_single_choice_keeps_plain_id(client, engine) -> None:
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
    assert engine.arrivals[0].req_id == r.headers["x-request-id"]


async def test_streaming_n_choices(client) -> None:
    payload = {
        "model": MODEL,
        "prompt": [5, 6],
        "max_tokens": 3,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = _events((await client.post("/v1/completions", json=payload)).text)
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for event in events[:-1]:
        (choice,) = event["choices"]
        by_index[choice["index"]].append(choice)
    assert all(len(chunks) == 3 and chunks[-1]["finish_reason"] == "length" for chunks in by_index.values())
    assert events[-1]["usage"]["completion_tokens"] == 6 and events[-1]["usage"]["prompt_tokens"] == 2


async def test_streaming_chat_n_choices(client) -> None:
    payload = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "n": 3, "stream": True}
    events = _events((await client.post("/v1/chat/completions", json=payload)).text)
    roles = [e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("role")]
    assert roles == [0, 1, 2]
    finished = sorted(e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"])
    assert finished == [0, 1, 2]


def test_choice_seeds_wrap_into_int64() -> None:
    params = SamplingParams(max_tokens=1, seed=(1 << 63) - 1)
    assert choice_params(params, 1).seed == -(1 << 63)
    assert choice_params(SamplingParams(max_tokens=1), 3).seed is None


async def test_overload_is_503_with_retry_after(client, engine) -> None:
    engine.hold = asyncio.Event()
    payload = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    held = [asyncio.ensure_future(client.post("/v1/completions", json={**payload, "n": 2})) for _ in range(2)]
    for _ in range(200):
        if engine.num_in_flight == 4:  # max_num_seqs 2 + max_waiting_requests 2
            break
        await asyncio.sleep(0.01)
    assert engine.num_in_flight == 4
    r = await client.post("/v1/completions", json=payload)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    error = r.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "stream": True})
    assert r.status_code == 503
    engine.hold.set()
    assert [(await h).status_code for h in held] == [200, 200]
    assert (await client.post("/v1/completions", json=payload)).status_code == 200
