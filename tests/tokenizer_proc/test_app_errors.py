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
def engine(request: pytest.FixtureRequest) -> FakeEngine:
    return FakeEngine(num_kv_blocks=getattr(request, "param", 1024))


@pytest.fixture
async def client(engine: FakeEngine, tokenizer, demo_model_dir: str) -> AsyncIterator[httpx.AsyncClient]:
    config = EngineConfig(model_dir=demo_model_dir, served_model_name=MODEL, max_model_len=64)
    transport = httpx.ASGITransport(app=build_app(engine, tokenizer, config))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


def _assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]
    return error


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_tokens": "3"}, "max_tokens"),
        ({"max_tokens": 63}, "max_tokens"),  # prompt + max_tokens > max_model_len
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": 2}, "min_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"n": 17}, "n"),  # past config.max_n (16)
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop_token_ids": [99999]}, "stop_token_ids"),
        ({"prompt": [1, 99999]}, "prompt"),
        ({"prompt": ["a", ""]}, "prompt"),  # every prompt of a list must hold something
        ({"prompt": ["a", "b"], "n": 9}, "prompt"),  # 2 prompts x 9 choices: past config.max_n (16)
        ({"prompt": ""}, "prompt"),
        ({"prompt": list(range(64))}, "prompt"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"echo": True}, "echo"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ],
)
async def test_completion_invalid_params_are_400(client, extra: dict, param: str) -> None:
    payload = {"model": MODEL, "prompt": [1, 2], **extra}
    error = _assert_error(await client.post("/v1/completions", json=payload), 400, param)
    assert error["type"] == "BadRequestError"


async def test_non_finite_float_is_400(client) -> None:
    body = '{"model": "demo", "prompt": "hi", "temperature": NaN}'
    r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    _assert_error(r, 400, "temperature")


async def test_missing_field_and_bad_json_are_400(client) -> None:
    _assert_error(await client.post("/v1/completions", json={"model": MODEL}), 400, "prompt")
    r = await client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"chat_template": "{{ 1 }}"}, "chat_template"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
async def test_chat_invalid_params_are_400(client, extra: dict, param: str) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    _assert_error(await client.post("/v1/chat/completions", json=payload), 400, param)


async def test_unknown_model_is_404(client) -> None:
    r = await client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
    assert _assert_error(r, 404, "model")["type"] == "NotFoundError"
    r = await client.post(
        "/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    _assert_error(r, 404, "model")


async def test_unknown_route_is_openai_shaped_404(client) -> None:
    _assert_error(await client.get("/v1/nothing"), 404, None)


@pytest.mark.parametrize("engine", [1], indirect=True)  # a KV pool of one block (16 tokens)
async def test_rejected_request(client, engine) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 20}  # the core can never fit it: 400, its message
    r = await client.post("/v1/completions", json=body)
    assert "the KV cache holds only 1 blocks" in _assert_error(r, 400, None)["message"]
    r = await client.post("/v1/completions", json={**body, "stream": True})
    lines = [x for x in r.text.split("\n\n") if x]
    assert json.loads(lines[0][len("data: ") :])["error"]["code"] == 400 and lines[-1] == "data: [DONE]"


async def test_engine_failure_turns_health_red(client, engine) -> None:
    assert (await client.get("/health")).status_code == 200
    engine.fail("worker 0 died")
    assert not engine.is_healthy
    _assert_error(await client.get("/health"), 503, None)
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
    _assert_error(r, 503, None)


async def test_models_and_version(client, demo_model_dir: str) -> None:
    card = (await client.get("/v1/models")).json()["data"][0]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "ledgerserve"
    assert card["root"] == MODEL and card["parent"] is None  # no server path without the admin key
    assert "version" in (await client.get("/version")).json()
