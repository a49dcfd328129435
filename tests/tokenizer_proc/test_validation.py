"""Every bad request gets an OpenAI-shaped 4xx naming its param, with no stack trace and no
server path, and a good request right after it still succeeds."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import httpx
import pytest

from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.app import build_app
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
MODEL = "demo"
MESSAGES = [{"role": "user", "content": "hi"}]
GOOD_COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


@pytest.fixture
async def client(tokenizer, demo_model_dir: str, tmp_path) -> AsyncIterator[httpx.AsyncClient]:
    config = EngineConfig(
        model_dir=demo_model_dir,
        served_model_name=MODEL,
        max_model_len=64,
        enable_lora=True,
        lora_allowed_dirs=(str(tmp_path),),
    )
    app = build_app(FakeEngine(), tokenizer, config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        c.model_dir = demo_model_dir  # type: ignore[attr-defined]
        yield c


async def _refused(client: httpx.AsyncClient, r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"]
    assert "Traceback" not in r.text and client.model_dir not in r.text  # type: ignore[attr-defined]
    good = await client.post("/v1/completions", json=GOOD_COMPLETION)
    assert good.status_code == 200, good.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b'"a string"', None),
        (b"null", None),
        (b"", None),
        (b"\xff\xfe\x00", None),
        (b'{"model": "demo", "prompt": "hi", "top_p": NaN}', "top_p"),
        (b'{"model": "demo", "prompt": "hi", "temperature": Infinity}', "temperature"),
        (b'{"model": "demo", "prompt": "hi", "presence_penalty": -Infinity}', "presence_penalty"),
    ],
)
async def test_bad_bodies(client, body: bytes, param: str | None) -> None:
    r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    await _refused(client, r, 400, param)


async def test_body_without_json_content_type(client) -> None:
    r = await client.post(
        "/v1/completions", content=b'{"model": "demo", "prompt": "hi"}', headers={"content-type": "text/plain"}
    )
    await _refused(client, r, 400, None)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": "3"}, "max_tokens"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"prompt": "word " * 200}, "prompt"),
        ({"prompt": "x" * (2 << 20)}, "prompt"),  # past the character budget: never tokenized
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [[5, 10**20]]}, "prompt"),
        ({"temperature": 101}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 10**9}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 1000}, "repetition_penalty"),
        ({"seed": "1"}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"n": 17}, "n"),
        ({"n": "2"}, "n"),
        ({"best_of": 3, "n": 2}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [2**70]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"stop": ["s"] * 17}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"model": 7}, "model"),
    ],
)
async def test_bad_completion_params(client, extra: dict, param: str) -> None:
    r = await client.post("/v1/completions", json={**GOOD_COMPLETION, **extra})
    await _refused(client, r, 400, param)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]}, "messages"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"n": 100}, "n"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}, "messages"),  # past the render budget
    ],
)
async def test_bad_chat_params(client, extra: dict, param: str) -> None:
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **extra})
    await _refused(client, r, 400, param)


async def test_unknown_model_and_adapter_are_404(client) -> None:
    await _refused(
        client, await client.post("/v1/completions", json={**GOOD_COMPLETION, "model": "nope"}), 404, "model"
    )
    r = await client.post("/v1/completions", json={**GOOD_COMPLETION, "lora_path": "nowhere-adapter"})
    await _refused(client, r, 404, "lora_path")
    r = await client.post("/v1/completions", json={**GOOD_COMPLETION, "lora_path": "/nowhere/adapter"})
    await _refused(client, r, 400, "lora_path")  # an absolute path would be loaded on demand: it lies outside the root
    r = await client.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
    await _refused(client, r, 404, "model")


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/load_lora_adapter", {}, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": "a"}, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": 1, "lora_path": "x"}, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": ["x"]}, "lora_path"),
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "x", "load_inplace": "no"}, "load_inplace"),
        ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "x"}, "lora_name"),
        ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": ""}, "lora_path"),
        ("/v1/unload_lora_adapter", {}, "lora_name"),
        ("/v1/unload_lora_adapter", {"lora_name": None}, "lora_name"),
    ],
)
async def test_bad_adapter_bodies(client, route: str, body: dict, param: str) -> None:
    await _refused(client, await client.post(route, json=body), 400, param)


async def test_adapter_outside_allowed_dirs_names_only_the_client_path(client, demo_model_dir: str) -> None:
    r = await client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": demo_model_dir})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


async def test_good_request_with_every_field(client) -> None:
    body = {
        **GOOD_COMPLETION,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": -1,
        "min_p": 0.1,
        "seed": -5,
        "presence_penalty": 1.0,
        "frequency_penalty": -1.0,
        "repetition_penalty": 1.2,
        "stop": ["zz"],
        "stop_token_ids": [3],
        "min_tokens": 1,
        "logprobs": 20,
        "n": 2,
        "best_of": 2,
        "logit_bias": {"3": -1.5},
        "user": "u",
    }
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert not math.isnan(r.json()["choices"][0]["logprobs"]["token_logprobs"][0])
