"""The app under a real uvicorn on 127.0.0.1, driven by the openai client and raw httpx."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.app import build_app
from tests.netutil import free_port, serve_in_thread
from tests.tokenizer_proc.fake_engine import FakeEngine

MODEL = "demo"


@pytest.fixture(scope="module")
def server(tokenizer, demo_model_dir: str) -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine(delay_s=0.01)
    port = free_port()
    config = EngineConfig(model_dir=demo_model_dir, served_model_name=MODEL, max_model_len=512, port=port)
    with serve_in_thread(build_app(engine, tokenizer, config), port) as url:
        yield url, engine


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_openai_client_completion_and_chat(server) -> None:
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    assert [m.id for m in client.models.list().data] == [MODEL]
    completion = client.completions.create(model=MODEL, prompt="hello there", max_tokens=4)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 4
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stop=["never"]
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 3


def test_openai_client_streams_with_usage(server) -> None:
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"


def test_openai_client_errors(server) -> None:
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=-3)
    assert info.value.body["param"] == "temperature"


def test_stream_disconnect_aborts(server) -> None:
    url, engine = server
    before = len(engine.aborts)
    payload = {"model": MODEL, "prompt": "a b c", "max_tokens": 400, "stream": True}
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", f"{url}/v1/completions", json=payload) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    assert _wait_for(lambda: len(engine.aborts) > before)
    assert engine.aborts[-1].reason == "abort"
    assert _wait_for(lambda: engine.num_in_flight == 0)


def test_non_stream_disconnect_aborts(server) -> None:
    url, engine = server
    before = len(engine.aborts)
    payload = {"model": MODEL, "prompt": "a b c", "max_tokens": 400}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=payload, timeout=0.5)
    assert _wait_for(lambda: len(engine.aborts) > before)
    assert engine.aborts[-1].reason == "abort"
    assert _wait_for(lambda: engine.num_in_flight == 0)
