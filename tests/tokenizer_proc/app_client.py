"""The in-process app on the fake engine, and the check that it still serves after a refusal."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.app import build_app
from tests.tokenizer_proc.fake_engine import FakeEngine

MODEL = "demo"
GOOD_COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CLIENT_TIMEOUT_S = 1.0


@asynccontextmanager
async def app_client(
    engine: FakeEngine, tokenizer: Any, model_dir: str, **config: Any
) -> AsyncIterator[httpx.AsyncClient]:
    settings = {"served_model_name": MODEL, "max_model_len": 64, **config}
    app = build_app(engine, tokenizer, EngineConfig(model_dir=model_dir, **settings))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a 500 is an answer, not a raise
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client


async def assert_still_serves(client: httpx.AsyncClient) -> None:
    """A good request right after succeeds within the client timeout: the process stays responsive."""
    async with asyncio.timeout(CLIENT_TIMEOUT_S):
        r = await client.post("/v1/completions", json=GOOD_COMPLETION, timeout=CLIENT_TIMEOUT_S)
    assert r.status_code == 200, r.text


def assert_error(r: httpx.Response, status: int, param: str | None) -> str:
    """The OpenAI error shape with this status and param; returns the message."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["param"] == param and error["message"], error
    return error["message"]
