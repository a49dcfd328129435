"""One adapter registered on demand at a time (`--max-on-demand-loras 1`) and 30 concurrent first
requests over three adapters, through the real process group: each request ends 200, after 503s
with `Retry-After` while another adapter is in use; none gets a 404 for an adapter that exists
(one unregistered between its resolution and its request is registered again by the request).
Each adapter's requests give the same greedy tokens, and the log replays."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import EventLogReader, newest_log, run_segments
from tests.adapter_factory import make_peft_adapter
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

NAMES = {"first": 31, "second": 32, "third": 33}
NUM_REQUESTS = 30


@pytest.fixture(scope="module")
def server(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    top = tmp_path_factory.mktemp("contention")
    for name, seed in NAMES.items():
        make_peft_adapter(demo_model_dir, top / name, r=4, alpha=8, targets=["q_proj", "v_proj"], seed=seed)
    args = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-allowed-dir", str(top)]
    args += ["--lora-resolve-dir", str(top), "--max-on-demand-loras", "1", "--max-model-len", "256"]
    srv = Server(demo_model_dir, str(tmp_path_factory.mktemp("contention-events")), args).start()
    yield srv
    srv.stop()


async def _until_served(client: httpx.AsyncClient, model: str, statuses: list[int]) -> httpx.Response:
    """A completion, sent again after each 503's Retry-After, as a client honouring it does."""
    body = {"model": model, "prompt": "The river ran", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    while True:
        r = await client.post("/v1/completions", json={**body, "return_token_ids": True})
        statuses.append(r.status_code)
        if r.status_code != 503:
            return r
        await asyncio.sleep(float(r.headers["retry-after"]))


async def _concurrent_first_uses(base_url: str) -> tuple[list[httpx.Response], list[int]]:
    statuses: list[int] = []
    names = list(NAMES)
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        responses = await asyncio.gather(
            *(_until_served(client, names[i % len(names)], statuses) for i in range(NUM_REQUESTS))
        )
    return responses, statuses


def test_concurrent_first_uses_all_succeed_and_none_gets_404(server: Server):
    responses, statuses = asyncio.run(_concurrent_first_uses(server.base_url))
    assert [r.status_code for r in responses] == [200] * NUM_REQUESTS, [r.text for r in responses]
    assert 404 not in statuses
    tokens: dict[str, set[tuple[int, ...]]] = {}
    for r in responses:
        body = r.json()
        tokens.setdefault(body["model"], set()).add(tuple(body["choices"][0]["token_ids"]))
    assert sorted(tokens) == sorted(NAMES) and all(len(outputs) == 1 for outputs in tokens.values()), tokens
    server.wait_idle()


def test_the_log_replays(server: Server):
    assert server.stop() == 0
    log = newest_log(server.log_dir)
    records = [event for segment in run_segments(log) for _, event in EventLogReader(segment, repair=False)]
    arrivals = [e for e in records if isinstance(e, ev.RequestArrived)]
    assert arrivals and all(e.on_demand is not None and e.on_demand.content_sha256 for e in arrivals)
    assert all(e.reason == "lru" for e in records if isinstance(e, ev.AdapterUnloaded))
    done = subprocess.run(
        [sys.executable, "-m", "ledgerserve", "replay", "--verify", log], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
