"""scripts/common/request_loop.py without a server: how a reply, a stream and a client abort are
read, and what one picked request sends (httpx's mock transport stands in for the server)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import httpx

from scripts.common.request_loop import Run, send_one, stream

CHUNK = 'data: {"choices": [{"text": "x"}]}\n\n'


def _client(reply: httpx.Response, seen: list[dict] | None = None) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append({"path": request.url.path, **json.loads(request.content)})
        return reply

    return httpx.AsyncClient(transport=httpx.MockTransport(handle), base_url="http://127.0.0.1:1")


def _stream(text: str, abort: bool = False, status: int = 200) -> tuple[int, str]:
    async def go() -> tuple[int, str]:
        async with _client(httpx.Response(status, text=text)) as client:
            return await stream(client, "/v1/completions", {}, abort=abort)

    return asyncio.run(go())


def test_a_stream_is_read_to_done_and_an_abort_stops_at_the_first_chunk():
    assert _stream(CHUNK * 3 + "data: [DONE]\n\n") == (200, "")
    assert _stream(CHUNK * 3 + "data: [DONE]\n\n", abort=True) == (200, "aborted")
    assert _stream(CHUNK * 3) == (-1, "stream ended without [DONE]")  # cut
    assert _stream("", abort=True) == (-1, "stream ended without data")


def test_a_stream_counts_with_its_error_event_or_its_status():
    error = 'data: {"error": {"message": "gone", "code": 404}}\n\n'
    assert _stream(CHUNK + error + "data: [DONE]\n\n") == (404, error.strip())
    assert _stream(error, abort=True) == (404, error.strip())
    assert _stream('{"error": {"code": 400}}', status=400) == (400, '{"error": {"code": 400}}')


def test_picked_requests_mix_kinds_and_only_streams_are_aborted():
    args = argparse.Namespace(max_tokens=3)
    seen: list[dict] = []

    async def go() -> Run:
        run = Run(args, "base", random.Random(0))
        async with _client(httpx.Response(200, text=CHUNK + "data: [DONE]\n\n"), seen) as client:
            for _ in range(200):
                await send_one(run, client, {"a": "/loras/a"}, "load", abort_fraction=0.25)
        return run

    run = asyncio.run(go())
    assert {o.kind for o in run.outcomes} == {"base", "adapter", "lora_path"} and all(
        o.status == 200 for o in run.outcomes
    )
    aborted = [body["stream"] for body, o in zip(seen, run.outcomes) if o.detail == "aborted"]
    assert aborted and all(aborted)  # aborts are streams
    assert 0.1 < len(aborted) / 200 < 0.4 and 0.3 < sum(body["stream"] for body in seen) / 200 < 0.7
    assert {body["path"] for body in seen} == {"/v1/completions", "/v1/chat/completions"}
    by_path = [o for body, o in zip(seen, run.outcomes) if body.get("lora_path") == "/loras/a"]
    assert by_path and all(o.by_path and o.kind == "lora_path" for o in by_path)
    assert all(body["max_tokens"] == 3 for body in seen)
