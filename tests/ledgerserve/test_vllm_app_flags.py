"""The vLLM flags the HTTP app acts on, through the in-process app on the fake engine and the
real `openai` client: several --served-model-name names, --chat-template, --root-path, CORS."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest

from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.app import build_app
from ledgerserve.tokenizer_proc.main import uvicorn_config
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}|{% endif %}"
ORIGIN = "https://app.example"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


@asynccontextmanager
async def _client(engine: FakeEngine, tokenizer: Any, model_dir: str, **settings: Any) -> AsyncIterator[Any]:
    """The app as uvicorn serves it: its root path, as uvicorn_config gives it, in every request's scope."""
    config = EngineConfig(model_dir=model_dir, served_model_name="first", max_model_len=64, **settings)
    app = build_app(engine, tokenizer, config)
    transport = httpx.ASGITransport(app=app, root_path=uvicorn_config(app, config).root_path)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


async def test_every_served_name_is_accepted_and_the_first_is_listed_and_reported(tokenizer, demo_model_dir):
    engine = FakeEngine()
    async with _client(engine, tokenizer, demo_model_dir, served_model_aliases=("second",)) as http:
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0) as oai:
            ids = [m.id for m in (await oai.models.list()).data]
            assert ids == ["first", "second"]
            for name in ids:  # each name reaches the base model; a response names the first, as vLLM's
                done = await oai.completions.create(model=name, prompt="hi", max_tokens=2)
                assert done.model == "first" and engine.arrivals[-1].lora_name is None
                chat = await oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
                assert chat.model == "first"
                stream = await oai.completions.create(model=name, prompt="hi", max_tokens=2, stream=True)
                assert {chunk.model async for chunk in stream} == {"first"}
            with pytest.raises(openai.NotFoundError):
                await oai.completions.create(model="third", prompt="hi", max_tokens=2)


async def test_chat_template_replaces_the_tokenizers(tokenizer, demo_model_dir):
    engine = FakeEngine()
    async with _client(engine, tokenizer, demo_model_dir, chat_template=TEMPLATE) as http:
        async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0) as oai:
            messages = [{"role": "user", "content": "the river"}]
            await oai.chat.completions.create(model="first", messages=messages, max_tokens=2)
    prompt = engine.arrivals[-1].prompt_token_ids
    assert prompt == tokenizer.encode("<user>the river|", add_special_tokens=False)


async def test_root_path_and_cors(tokenizer, demo_model_dir):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    async with _client(FakeEngine(), tokenizer, demo_model_dir) as http:  # no --allowed-origins: no CORS
        r = await http.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        assert (await http.get("/openapi.json")).json().get("servers") is None
    settings = {"allowed_origins": (ORIGIN,), "allow_credentials": True, "root_path": "/llm"}
    async with _client(FakeEngine(), tokenizer, demo_model_dir, **settings) as http:
        r = await http.options("/v1/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        assert r.headers["access-control-allow-credentials"] == "true"
        refused = await http.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        got = await http.get("/v1/models", headers={"Origin": ORIGIN})
        assert got.status_code == 200 and got.headers["access-control-allow-origin"] == ORIGIN
        assert (await http.get("/openapi.json")).json()["servers"] == [{"url": "/llm"}]
        assert (await http.get("/llm/v1/models")).status_code == 200  # a proxy that keeps the prefix
        assert (await http.get("/v1/models")).status_code == 200  # one that strips it


def test_uvicorn_gets_log_level_root_path_and_tls(demo_model_dir, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    settings = {"uvicorn_log_level": "warning", "root_path": "/llm", "ssl_keyfile": str(key), "ssl_certfile": str(cert)}
    config = EngineConfig(model_dir=demo_model_dir, served_model_name="m", max_model_len=64, **settings)
    uv = uvicorn_config(object(), config)
    assert (uv.log_level, uv.root_path, uv.ssl_keyfile, uv.ssl_certfile) == ("warning", "/llm", str(key), str(cert))
    assert uv.is_ssl
    plain = uvicorn_config(object(), EngineConfig(model_dir=demo_model_dir, served_model_name="m", max_model_len=64))
    assert (plain.log_level, plain.root_path, plain.is_ssl) == ("info", "", False)
