"""API key, body-size limit, chat template budget, and no pickle anywhere."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request

from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.env import API_KEY as API_KEY_ENV
from ledgerserve.tokenizer_proc.app import build_app
from ledgerserve.tokenizer_proc.auth import key_matches
from ledgerserve.tokenizer_proc.chat_template import ChatTemplate, ChatTemplateError
from ledgerserve.tokenizer_proc.errors import install_error_handlers
from ledgerserve.tokenizer_proc.security import BodyLimitMiddleware, StartupRefused
from tests.tokenizer_proc.fake_engine import FakeEngine

MODEL = "demo"
KEY = "s3cret-key"
REPO = Path(__file__).resolve().parents[2]
GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def _config(demo_model_dir: str, **kw) -> EngineConfig:
    return EngineConfig(model_dir=demo_model_dir, served_model_name=MODEL, max_model_len=64, **kw)


@pytest.fixture
async def keyed(tokenizer, demo_model_dir: str, monkeypatch) -> AsyncIterator[httpx.AsyncClient]:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    app = build_app(FakeEngine(), tokenizer, _config(demo_model_dir, api_key_required=True))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


def _assert_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


@pytest.mark.anyio
async def test_v1_routes_need_the_key(keyed: httpx.AsyncClient) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic " + KEY}):
        r = await keyed.post("/v1/completions", json=GOOD, headers=headers)
        assert _assert_error(r, 401)["type"] == "AuthenticationError"
        assert KEY not in r.text
    _assert_error(await keyed.get("/v1/models"), 401)
    _assert_error(await keyed.post("/v1/load_lora_adapter", json={}), 401)
    _assert_error(await keyed.get("/v1/no-such-route"), 401)  # decided on the path, not per route
    auth = {"Authorization": f"Bearer {KEY}"}
    assert (await keyed.post("/v1/completions", json=GOOD, headers=auth)).status_code == 200
    assert (await keyed.get("/v1/models", headers=auth)).status_code == 200


@pytest.mark.anyio
async def test_open_routes_need_no_key(keyed: httpx.AsyncClient) -> None:
    for path in ("/health", "/ping", "/version"):
        assert (await keyed.get(path)).status_code == 200, path


def test_required_key_missing_refuses_to_start(tokenizer, demo_model_dir: str, monkeypatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with pytest.raises(StartupRefused, match=API_KEY_ENV):
        build_app(FakeEngine(), tokenizer, _config(demo_model_dir, api_key_required=True))


def test_key_comparison() -> None:
    assert key_matches(b"Bearer abc", b"abc") and key_matches(b"bearer abc", b"abc")
    assert not key_matches(None, b"abc") and not key_matches(b"Bearer abcd", b"abc")
    assert not key_matches(b"Bearer ", b"abc") and not key_matches(b"abc", b"abc")


@pytest.fixture
async def small(tokenizer, demo_model_dir: str) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(FakeEngine(), tokenizer, _config(demo_model_dir, max_request_bytes=1024))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


@pytest.mark.anyio
async def test_body_over_the_limit_is_413(small: httpx.AsyncClient) -> None:
    big = {**GOOD, "prompt": "x" * 2000}
    error = _assert_error(await small.post("/v1/completions", json=big), 413)
    assert error["type"] == "RequestTooLargeError" and error["param"] is None

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"model": "demo", "prompt": "'
        for _ in range(10):
            yield b"x" * 200
        yield b'"}'

    r = await small.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    _assert_error(r, 413)
    assert (await small.post("/v1/completions", json=GOOD)).status_code == 200


def test_template_size_budget() -> None:
    template = ChatTemplate("{% for m in messages %}{% for i in range(1000) %}{{ m.content }}{% endfor %}{% endfor %}")
    messages = [{"role": "user", "content": "x" * 100}]
    assert len(template.render(messages, max_chars=200_000)) == 100_000
    with pytest.raises(ChatTemplateError, match="longer than"):
        template.render(messages, max_chars=50_000)


def test_template_time_budget() -> None:
    template = ChatTemplate("{% for i in range(100000) %}{% for j in range(100) %}.{% endfor %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="took longer"):
        template.render([], max_chars=1 << 30, max_seconds=0.05)


@pytest.mark.anyio
async def test_request_supplied_template_refused(small: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 7 * 7 }}"}
    assert _assert_error(await small.post("/v1/chat/completions", json=body), 400)["param"] == "chat_template"


UNSAFE = re.compile(
    r"\bimport pickle\b|\bfrom pickle\b|pickle\.loads?\(|torch\.load\(|\bcPickle\b|"
    r"weights_only\s*=\s*False|(load|open)\w*\(.*\.bin\b"
)


def test_no_pickle_loading_anywhere() -> None:
    """No Python source loads pickle (torch.load, pickle.load, reading .bin weights).
    Only the refusal of `.bin` adapter files and this test may name them."""
    offenders = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[0].startswith(".") or "site-packages" in rel.parts or path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if UNSAFE.search(line):
                offenders.append(f"{rel}:{number}: {line.strip()}")
    assert offenders == []


@pytest.mark.anyio
async def test_a_body_that_stops_arriving_gets_408() -> None:
    """A client that sends part of its body and then nothing is answered 408 after the stall limit,
    while a slow but steady body, and the wait for a disconnect after the body, are not cut."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"size": len(await request.body())}

    guarded = BodyLimitMiddleware(app, max_bytes=1 << 20, stall_s=0.2)

    async def chunks(gap_s: float, stop_after: int | None) -> AsyncIterator[bytes]:
        for i in range(5):
            if stop_after is not None and i == stop_after:
                await asyncio.sleep(3600)
            await asyncio.sleep(gap_s)
            yield b"x" * 10

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guarded), base_url="http://test") as c:
        _assert_error(await c.post("/echo", content=chunks(0.0, stop_after=2)), 408)
        steady = await c.post("/echo", content=chunks(0.1, stop_after=None))
        assert steady.status_code == 200 and steady.json() == {"size": 50}
