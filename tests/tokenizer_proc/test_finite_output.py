"""No NaN or infinity reaches a client: a logprob of -inf is sent as -9999.0, a NaN fails the
request with a 500 in the OpenAI shape (a stream: an error event, then [DONE]), and the
request is aborted in the engine. Every body is parsed by a JSON reader that refuses NaN."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from ledgerserve.tokenizer_proc.responses import LOGPROB_FLOOR, NonFiniteOutput, to_json
from tests.tokenizer_proc.app_client import MODEL, assert_error, assert_still_serves

pytestmark = pytest.mark.anyio
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 3,
    "logprobs": True,
    "top_logprobs": 2,
}
COMPLETION = {"model": MODEL, "prompt": [40, 41], "max_tokens": 3, "logprobs": 2}


def strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in a response: {text[:200]}")

    return json.loads(text, parse_constant=refuse)


def stream_events(body: str) -> list[Any]:
    chunks = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]", body[-200:]
    return [strict_json(chunk) for chunk in chunks[:-1]]


async def test_minus_infinity_becomes_the_floor(client, engine) -> None:
    engine.logprob_values = (-math.inf, -math.inf)
    lp = strict_json((await client.post("/v1/completions", json=COMPLETION)).text)["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [LOGPROB_FLOOR] * 3
    assert all(set(top.values()) == {LOGPROB_FLOOR} for top in lp["top_logprobs"])
    content = strict_json((await client.post("/v1/chat/completions", json=CHAT)).text)["choices"][0]["logprobs"]
    assert [t["logprob"] for t in content["content"]] == [LOGPROB_FLOOR] * 3
    assert {t["logprob"] for tok in content["content"] for t in tok["top_logprobs"]} == {LOGPROB_FLOOR}
    events = stream_events((await client.post("/v1/chat/completions", json={**CHAT, "stream": True})).text)
    streamed = [t["logprob"] for e in events for c in e["choices"] if c["logprobs"] for t in c["logprobs"]["content"]]
    assert streamed == [LOGPROB_FLOOR] * 3


async def test_a_finite_logprob_below_the_floor_is_raised_to_it(client, engine) -> None:
    engine.logprob_values = (-1e300, -5.0)
    lp = strict_json((await client.post("/v1/completions", json=COMPLETION)).text)["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [LOGPROB_FLOOR] * 3 and -5.0 in lp["top_logprobs"][0].values()


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("values", [(math.nan, -1.0), (-0.5, math.nan), (math.inf, -1.0)])
async def test_nan_fails_a_plain_request_with_a_500(client, engine, route: str, values) -> None:
    engine.logprob_values = values
    r = await client.post(route, json=CHAT if "chat" in route else COMPLETION)
    strict_json(r.text)
    message = assert_error(r, 500, None)
    assert "logprob" in message and r.json()["error"]["type"] == "InternalServerError"
    await assert_still_serves(client)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
async def test_nan_ends_a_stream_with_an_error_event_and_aborts_it(client, engine, route: str) -> None:
    engine.logprob_values = (math.nan, -1.0)
    engine.delay_s = 0.01  # the request is still running when its first token fails
    body = {**(CHAT if "chat" in route else COMPLETION), "stream": True, "max_tokens": 40}
    events = stream_events((await client.post(route, json=body)).text)
    error = events[-1]["error"]
    assert error["code"] == 500 and "logprob" in error["message"]
    assert all("error" not in e for e in events[:-1])
    assert [a.req_id for a in engine.aborts] == [engine.arrivals[0].req_id]
    assert engine.num_in_flight == 0
    await assert_still_serves(client)


def test_the_serializer_never_writes_a_non_finite_number() -> None:
    assert to_json({"a": [1.5, -9999.0]}) == '{"a":[1.5,-9999.0]}'
    for value in (math.nan, math.inf, -math.inf):
        with pytest.raises(NonFiniteOutput):
            to_json({"usage": {"x": [value]}})
