"""What the real server's event log holds of request content: with `--event-log-content hashed`
none of a prompt's token ids (as msgpack writes the list, or any run of them) nor of the sampled
ids, while the client gets them all and `ledgerserve replay --verify` passes; with `tokens` the
same search finds them. Both scheduling loops: async scheduling runs a step ahead of its tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest

from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import EventLogReader, newest_log, run_segments
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

ENCODE = msgspec.msgpack.encode
PROMPT = [300 + 31 * i for i in range(40)]  # distinctive ids (the demo vocabulary has 1536), each in 3 bytes
SECOND = PROMPT[:32] + [1511, 1523, 1531]  # shares two 16-token blocks with PROMPT
CASES = {"hashed": ["--event-log-content", "hashed"], "tokens": []}


def _complete(server: Server, prompt: list[int]) -> dict:
    model = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 10,
        "temperature": 0.0,
        "logprobs": 1,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    reply = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _patterns(prompts: list[list[int]], outputs: dict[str, list[int]]) -> dict[str, bytes]:
    """Each prompt as a list, every run of 2+ of its ids; each sampled id after its request's id (a
    SampledToken), and every run of 2+ outputs that msgpack writes in 6 bytes or more."""
    found: dict[str, bytes] = {}
    for n, ids in enumerate(prompts):
        found[f"prompt {n}"] = ENCODE(ids)
        for start in range(len(ids) - 1):
            for end in range(start + 2, len(ids) + 1):
                found[f"prompt {n} run {start}:{end}"] = b"".join(ENCODE(i) for i in ids[start:end])
    for req_id, ids in outputs.items():
        for i, token_id in enumerate(ids):
            found[f"{req_id} sampled {i}"] = ENCODE(req_id) + ENCODE(token_id)
        for start in range(len(ids) - 1):
            for end in range(start + 2, len(ids) + 1):
                run = b"".join(ENCODE(i) for i in ids[start:end])
                if len(run) >= 6:
                    found[f"{req_id} output run {start}:{end}"] = run
    return found


@pytest.mark.parametrize(
    "content, scheduling",
    [("hashed", []), ("hashed", ["--async-scheduling"]), ("tokens", [])],  # tokens: the search's control
    ids=["hashed-one-step", "hashed-async", "tokens-one-step"],
)
def test_the_log_holds_request_content_only_in_tokens_mode(demo_model_dir, tmp_path, content, scheduling):
    args = ["--max-model-len", "512", "--block-size", "16", *CASES[content], *scheduling]
    server = Server(demo_model_dir, str(tmp_path), args).start()
    try:
        replies = [_complete(server, PROMPT), _complete(server, SECOND)]
    finally:
        assert server.stop() == 0
    assert replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32  # matched on digests too
    path = newest_log(str(tmp_path))
    data = b"".join(Path(p).read_bytes() for p in run_segments(path))
    req_ids = [e.req_id for _, e in EventLogReader(path) if isinstance(e, ev.RequestArrived)]
    outputs = {req_id: reply["choices"][0]["token_ids"] for req_id, reply in zip(req_ids, replies)}
    assert all(len(ids) == 10 for ids in outputs.values())
    found = [name for name, pattern in _patterns([PROMPT, SECOND], outputs).items() if pattern in data]
    if content == "hashed":
        assert found == []
    else:
        assert {"prompt 0", "prompt 1", "prompt 0 run 5:9", f"{req_ids[0]} sampled 0"} <= set(found)
    verify = subprocess.run(
        [sys.executable, "-m", "ledgerserve", "replay", "--verify", path], capture_output=True, text=True
    )
    assert verify.returncode == 0 and verify.stdout.startswith("OK"), verify.stdout + verify.stderr
