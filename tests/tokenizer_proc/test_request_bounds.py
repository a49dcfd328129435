"""No single cheap request holds the HTTP process: the big lists of a body are bounded before
the body is parsed, prompts are tokenized off the event loop, a chat template is stopped at
its time limit whatever it does, and a response's prompt logprobs are bounded. Every refusal
is an OpenAI-shaped 400 that reaches nothing else, and the app goes on serving."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest

from ledgerserve.tokenizer_proc import text_check
from tests.tokenizer_proc.app_client import GOOD_COMPLETION, MODEL, app_client, assert_error, assert_still_serves
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
MAX_MODEL_LEN = 64
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SILENT_LOOP = "{% for i in range(100000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}x"
PARTS = [{"type": "text", "text": ""}] * 250_000
BIAS = {str(i): 1 for i in range(500_000)}
METADATA = {f"k{i}": "v" for i in range(500_000)}
HUGE_NUMBER = "{% set n = (messages | length) * 10 %}{{ (n ** (n ** 8)) % 7 }}"  # not folded at compile time


@pytest.fixture
def parsed_sizes(monkeypatch) -> list[int]:
    """The size of every text json.loads parses from now on (the app's request bodies included)."""
    sizes: list[int] = []
    loads = json.loads

    def spy(text: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.append(len(text))
        return loads(text, *args, **kwargs)

    monkeypatch.setattr(json, "loads", spy)
    return sizes


async def _post_raw(client: Any, route: str, body: dict) -> Any:
    data = json.dumps(body).encode()
    return await client.post(route, content=data, headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize(
    ("route", "body", "param", "says"),
    [
        ("/v1/completions", {**GOOD_COMPLETION, "prompt": [5] * 1_300_000}, "prompt", "1300000 tokens"),
        ("/v1/completions", {**GOOD_COMPLETION, "prompt": [[5]] * 17}, "prompt", "at most 16 prompts"),
        ("/v1/completions", {**GOOD_COMPLETION, "prompt": [[5], [5] * 65]}, "prompt", "`prompt.1` has 65"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": ""}] * 250_000}, "messages", "4096"),
        ("/tokenize", {"messages": [{"role": "user"}] * 5000}, "messages", "4096"),
        ("/detokenize", {"tokens": [5] * 1_000_000}, "tokens", "at most 64 token ids"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": PARTS}]}, "messages", "4096"),
        ("/v1/completions", {**GOOD_COMPLETION, "stop": ["a"] * 1_500_000}, "stop", "at most 16 stop strings"),
        ("/v1/completions", {**GOOD_COMPLETION, "logit_bias": BIAS}, "logit_bias", "at most 300 logit_bias"),
        ("/v1/completions", {**GOOD_COMPLETION, "metadata": METADATA}, "metadata", "at most 16 metadata pairs"),
    ],
)
async def test_big_lists_are_refused_before_the_body_is_parsed(
    engine: FakeEngine, tokenizer, demo_model_dir: str, parsed_sizes: list[int], route, body, param, says
) -> None:
    async with app_client(engine, tokenizer, demo_model_dir, max_model_len=MAX_MODEL_LEN) as client:
        r = await _post_raw(client, route, body)
        assert says in assert_error(r, 400, param)
        assert max(parsed_sizes) < 1000  # the body itself was never handed to json.loads
        assert engine.arrivals == []
        await assert_still_serves(client)


async def test_a_body_msgspec_cannot_split_is_bounded_after_parsing(engine, tokenizer, demo_model_dir: str) -> None:
    """NaN is not JSON to msgspec; the body is then parsed as the routes parse it, and bounded."""
    body = b'{"model": "demo", "max_tokens": 2, "temperature": NaN, "prompt": [' + b"5," * 99 + b"5]}"
    async with app_client(engine, tokenizer, demo_model_dir, max_model_len=MAX_MODEL_LEN) as client:
        r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert "100 tokens" in assert_error(r, 400, "prompt")
        await assert_still_serves(client)


class ThreadNotingTokenizer:
    """The demo tokenizer, noting the thread of every encode and decode."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.threads: list[int] = []

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def encode(self, *args: Any, **kwargs: Any) -> list[int]:
        self.threads.append(threading.get_ident())
        return self._tokenizer.encode(*args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        self.threads.append(threading.get_ident())
        return self._tokenizer.decode(*args, **kwargs)


async def test_concurrent_prompts_are_tokenized_off_the_event_loop(tokenizer, demo_model_dir: str) -> None:
    """16 prompts of 64 KiB at once (each then too long for the model) and short texts alike."""
    noting = ThreadNotingTokenizer(tokenizer)
    text = ("The river ran past the mill. " * 3000)[: 64 << 10]
    async with app_client(FakeEngine(), noting, demo_model_dir) as client:
        *long, short, back = await asyncio.gather(
            *[client.post("/v1/completions", json={**GOOD_COMPLETION, "prompt": text}) for _ in range(16)],
            client.post("/tokenize", json={"prompt": "hi"}),
            client.post("/detokenize", json={"tokens": [5, 6, 7]}),
        )
        assert all("maximum context length" in assert_error(r, 400, "prompt") for r in long)
        assert short.status_code == 200 and back.status_code == 200
    assert len(noting.threads) == 18 and threading.get_ident() not in noting.threads


@pytest.mark.parametrize("source", [SILENT_LOOP, HUGE_NUMBER])
async def test_a_template_is_stopped_at_its_time_limit(tokenizer, demo_model_dir: str, source: str) -> None:
    """A template that writes nothing for seconds (or computes one huge number) is stopped at 2 s
    with a 400, and /health answers at once meanwhile."""
    engine = FakeEngine()
    await engine.start()
    async with app_client(engine, tokenizer, demo_model_dir, chat_template=source) as client:
        started = time.perf_counter()
        chat = asyncio.ensure_future(_post_raw(client, "/v1/chat/completions", CHAT))
        await asyncio.sleep(0.3)
        assert (await client.get("/health")).status_code == 200
        assert time.perf_counter() - started < 1.0  # the loop was never held by the render
        assert "took longer than 2 s" in assert_error(await chat, 400, "messages")
        assert time.perf_counter() - started < 6.0
        assert engine.arrivals == []
        await assert_still_serves(client)


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"])
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
async def test_template_kwargs_may_not_set_what_the_renderer_sets(
    engine: FakeEngine, tokenizer, demo_model_dir: str, key: str, route: str
) -> None:
    body = {**CHAT, "chat_template_kwargs": {"flavour": 1, key: 1}}
    if route == "/tokenize":
        body = {"messages": CHAT["messages"], "chat_template_kwargs": body["chat_template_kwargs"]}
    async with app_client(engine, tokenizer, demo_model_dir) as client:
        assert f"`{key}`" in assert_error(await client.post(route, json=body), 400, "chat_template_kwargs")
        assert engine.arrivals == []
        await assert_still_serves(client)


async def test_prompt_logprobs_cannot_multiply_into_a_huge_response(engine, tokenizer, demo_model_dir: str) -> None:
    """Each of n choices carries its prompt's logprobs: n x positions x (k + 1) entries are bounded
    by one full-length prompt at the most prompt_logprobs (64 x 21 here)."""
    prompt = list(range(10, 70))  # 60 tokens: 59 positions x 21 entries fit once, not 16 times
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 20}
    async with app_client(engine, tokenizer, demo_model_dir) as client:
        assert "logprob entries" in assert_error(
            await client.post("/v1/completions", json={**body, "n": 16}), 400, "prompt_logprobs"
        )
        assert engine.arrivals == []
        one = await client.post("/v1/completions", json=body)
        assert one.status_code == 200 and len(one.json()["choices"][0]["prompt_logprobs"]) == 60


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "the river " * 40}, "prompt"),
        ({"messages": [{"role": "user", "content": "the mill " * 40}]}, "messages"),
    ],
)
async def test_tokenize_is_bounded_by_max_model_len(engine, tokenizer, demo_model_dir: str, body, param) -> None:
    async with app_client(engine, tokenizer, demo_model_dir) as client:
        assert "maximum context length is 64" in assert_error(await client.post("/tokenize", json=body), 400, param)
        assert (await client.post("/tokenize", json={"prompt": "the river"})).status_code == 200


@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses/resp_123"])
async def test_the_responses_api_says_it_is_not_supported(client, method: str, path: str) -> None:
    r = await client.request(method, path, json={"model": MODEL, "input": "hi"} if method == "POST" else None)
    assert "Responses API" in assert_error(r, 501, None)


async def test_a_lone_surrogate_among_a_million_strings_is_found_quickly(
    engine, tokenizer, demo_model_dir, monkeypatch
) -> None:
    """The text check finds the one bad string without looking at every string in Python."""
    looked_at = []
    encodes = text_check.encodes
    monkeypatch.setattr(text_check, "encodes", lambda text: looked_at.append(1) or encodes(text))
    kwargs = {"x": ["é"] * 1_000_000 + ["\ud800"]}
    data = json.dumps({**CHAT, "chat_template_kwargs": kwargs}, ensure_ascii=False).encode("utf-8", "surrogatepass")
    async with app_client(engine, tokenizer, demo_model_dir) as client:
        r = await client.post("/v1/chat/completions", content=data, headers={"content-type": "application/json"})
        assert "chat_template_kwargs.x.1000000" in assert_error(r, 400, "chat_template_kwargs")
        assert len(looked_at) < 10_000
        await assert_still_serves(client)
