"""Request and adapter-op ids, over the fake engine: the logged ids come from the client's
X-Request-Id or from this process's arrival count, never from chance, so the same traffic gives
the same ids; an X-Request-Id in flight is refused, and free again once its request ended."""

from __future__ import annotations

import asyncio
import re

import pytest

from ledgerserve.shared.events import AdapterLoadRequested, AdapterUnloadRequested
from tests.peft_util import make_tiny_peft_adapter
from tests.tokenizer_proc.app_client import MODEL, app_client, assert_error
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
RANDOM_HEX = re.compile(r"[0-9a-f]{32}")


async def test_without_the_header_ids_count_arrivals_and_response_ids_are_random(client, engine) -> None:
    first = await client.post("/v1/completions", json=COMPLETION)
    second = await client.post("/v1/chat/completions", json={**CHAT, "n": 2})
    assert [a.req_id for a in engine.arrivals] == ["req-1", "req-2-0", "req-2-1"]
    assert (first.headers["x-request-id"], second.headers["x-request-id"]) == ("req-1", "req-2")
    kind, _, tail = first.json()["id"].partition("-")
    assert kind == "cmpl" and RANDOM_HEX.fullmatch(tail)  # unique across restarts, as a client may store it
    kind, _, tail = second.json()["id"].partition("-")
    assert kind == "chatcmpl" and RANDOM_HEX.fullmatch(tail)


async def test_the_header_names_the_request_as_vllm_does(client, engine) -> None:
    r = await client.post("/v1/completions", json={**COMPLETION, "n": 2}, headers={"X-Request-Id": "trace-7"})
    assert r.status_code == 200 and r.json()["id"] == "cmpl-trace-7" and r.headers["x-request-id"] == "cmpl-trace-7"
    async with client.stream(
        "POST", "/v1/chat/completions", json={**CHAT, "stream": True}, headers={"X-Request-Id": "t8"}
    ) as s:
        assert s.headers["x-request-id"] == "chatcmpl-t8"
        chunks = [line async for line in s.aiter_lines() if line.startswith("data: {")]
    assert chunks and all('"id":"chatcmpl-t8"' in chunk for chunk in chunks)
    assert [a.req_id for a in engine.arrivals] == ["cmpl-trace-7-0", "cmpl-trace-7-1", "chatcmpl-t8"]


@pytest.mark.parametrize("value", ["", "has space", "caf\u00e9", "x" * 129, "tab\there"])
async def test_a_bad_header_is_refused_and_nothing_is_sent(client, engine, value: str) -> None:
    r = await client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": value.encode("latin-1")})
    assert "printable ASCII" in assert_error(r, 400, "X-Request-Id")
    assert engine.arrivals == []


async def test_an_id_in_flight_is_refused_and_free_once_its_request_ended(client, engine) -> None:
    engine.hold = asyncio.Event()
    header = {"X-Request-Id": "x-0"}
    first = asyncio.ensure_future(client.post("/v1/completions", json=COMPLETION, headers=header))
    while not engine.arrivals:
        await asyncio.sleep(0.01)
    message = assert_error(await client.post("/v1/completions", json=COMPLETION, headers=header), 400, "X-Request-Id")
    assert "`cmpl-x-0` is already in flight" in message
    two = {**COMPLETION, "n": 2}  # choices `cmpl-x-0` and `cmpl-x-1`: the first is taken
    message = assert_error(
        await client.post("/v1/completions", json=two, headers={"X-Request-Id": "x"}), 400, "X-Request-Id"
    )
    assert "`cmpl-x-0` is already in flight" in message
    assert [a.req_id for a in engine.arrivals] == ["cmpl-x-0"]
    engine.hold.set()
    assert (await first).status_code == 200
    for _ in range(2):  # ended: the id names the next request, again and again
        r = await client.post("/v1/completions", json=COMPLETION, headers=header)
        assert r.status_code == 200, r.text
    assert [a.req_id for a in engine.arrivals] == ["cmpl-x-0"] * 3 and not engine.aborts


async def test_a_request_left_early_keeps_its_id_until_the_core_answers_its_abort(client, engine) -> None:
    """A client gone: the abort is sent, and the id stays taken until the core's last word on it,
    so tokens still on their way for the old request never reach a new one."""
    engine.hold = asyncio.Event()
    header = {"X-Request-Id": "gone"}
    first = asyncio.ensure_future(client.post("/v1/completions", json=COMPLETION, headers=header))
    while not engine.arrivals:
        await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    assert engine.is_in_flight("cmpl-gone")  # released by the route, not yet answered by the core
    engine.hold.set()
    for _ in range(200):
        if not engine.is_in_flight("cmpl-gone"):
            break
        await asyncio.sleep(0.01)
    r = await client.post("/v1/completions", json=COMPLETION, headers=header)
    assert r.status_code == 200, r.text


async def _traffic(engine: FakeEngine, tokenizer, model_dir: str, adapter: str) -> list[str]:
    async with app_client(engine, tokenizer, model_dir, enable_lora=True, lora_allowed_dirs=(adapter,)) as c:
        assert (await c.post("/v1/completions", json=COMPLETION)).status_code == 200
        r = await c.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapter})
        assert r.status_code == 200, r.text
        assert (await c.post("/v1/completions", json={**COMPLETION, "model": "a"})).status_code == 200
        assert (await c.post("/v1/chat/completions", json={**CHAT, "n": 2})).status_code == 200
        assert (await c.post("/v1/unload_lora_adapter", json={"lora_name": "a"})).status_code == 200
    ids = []
    for event in engine.received:
        if isinstance(event, (AdapterLoadRequested, AdapterUnloadRequested)):
            ids.append(event.op_id)
        elif hasattr(event, "req_id"):
            ids.append(event.req_id)
    return ids


async def test_the_same_traffic_gives_the_same_ids(tokenizer, demo_model_dir: str, tmp_path) -> None:
    adapter = str(make_tiny_peft_adapter(demo_model_dir, tmp_path / "a", seed=4))
    runs = [await _traffic(FakeEngine(), tokenizer, demo_model_dir, adapter) for _ in range(2)]
    assert runs[0] == runs[1] == ["req-1", "lora-op-1", "req-2", "req-3-0", "req-3-1", "lora-op-2"]
