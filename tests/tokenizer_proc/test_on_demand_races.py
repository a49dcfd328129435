"""Adapters loaded on demand under concurrency, over the fake engine (the real core): an adapter
unregistered as least recently used between its resolution and its request's arrival is
registered again, never a 404; one directory registers once, whatever names reach it; and
every 503 says when to retry."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import AdapterLoadRequested
from ledgerserve.tokenizer_proc.app import build_app
from tests.peft_util import make_tiny_peft_adapter
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
MODEL = "demo"
NAMES = ("a1", "a2", "a3")


@pytest.fixture(scope="module")
def root(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    top = tmp_path_factory.mktemp("races")
    for seed, name in enumerate(NAMES):
        make_tiny_peft_adapter(demo_model_dir, top / "names" / name, seed=seed)
    (top / "names" / "alias").symlink_to(top / "names" / "a1")
    return top


async def _client(engine: FakeEngine, tokenizer, model_dir: str, root: Path) -> AsyncIterator[httpx.AsyncClient]:
    config = EngineConfig(
        model_dir=model_dir,
        served_model_name=MODEL,
        max_model_len=64,
        enable_lora=True,
        lora_allowed_dirs=(str(root),),
        lora_resolve_dir=str(root / "names"),
    )
    app = build_app(engine, tokenizer, config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


def _completion(model: str = MODEL, **kw: object) -> dict:
    return {"model": model, "prompt": [5, 6], "max_tokens": 2, **kw}


async def _until_not_503(c: httpx.AsyncClient, body: dict, statuses: list[int]) -> httpx.Response:
    """Send, and send again after each 503's Retry-After (a tenth of it: the test's clock)."""
    while True:
        r = await c.post("/v1/completions", json=body)
        statuses.append(r.status_code)
        if r.status_code != 503:
            return r
        assert r.headers["retry-after"] == "1", r.headers
        await asyncio.sleep(float(r.headers["retry-after"]) / 10)


@pytest.mark.parametrize("op_delay_s", [0.0, 0.01])
async def test_concurrent_first_uses_of_several_adapters_never_get_404(
    tokenizer, demo_model_dir: str, root: Path, op_delay_s: float
) -> None:
    """One adapter loaded on demand at a time, 30 concurrent requests over three: each loads,
    waits its turn (503, retried) and runs; none is refused for an adapter that exists."""
    engine = FakeEngine(max_on_demand_loras=1, op_delay_s=op_delay_s)
    statuses: list[int] = []
    async for c in _client(engine, tokenizer, demo_model_dir, root):
        bodies = [_completion(NAMES[i % len(NAMES)]) for i in range(30)]
        responses = await asyncio.gather(*(_until_not_503(c, body, statuses) for body in bodies))
        assert [r.status_code for r in responses] == [200] * 30, [r.text for r in responses if r.status_code != 200]
    assert 404 not in statuses


async def test_one_directory_registers_once_whatever_names_reach_it(tokenizer, demo_model_dir: str, root: Path) -> None:
    """Its --lora-resolve-dir name, a link beside it, and its path as lora_path: one load, under
    the name that came first, sequential or concurrent."""
    real = os.path.realpath(root / "names" / "a1")
    ways = [_completion("a1"), _completion("alias"), _completion(lora_path=real)]
    for concurrent in (False, True):
        engine = FakeEngine(op_delay_s=0.01)
        async for c in _client(engine, tokenizer, demo_model_dir, root):
            if concurrent:
                responses = await asyncio.gather(*(c.post("/v1/completions", json=body) for body in ways * 3))
            else:
                responses = [await c.post("/v1/completions", json=body) for body in ways[::-1]]
            assert {r.status_code for r in responses} == {200}, [r.text for r in responses]
        loads = [e for e in engine.received if isinstance(e, AdapterLoadRequested)]
        assert len(loads) == 1 and loads[0].path == real, loads
        assert [info.path for info in engine.registry.values()] == [real]
        assert {a.lora_name for a in engine.arrivals} == {loads[0].name}


async def test_every_503_carries_retry_after(tokenizer, demo_model_dir: str, root: Path) -> None:
    engine = FakeEngine(max_on_demand_loras=1)
    async for c in _client(engine, tokenizer, demo_model_dir, root):
        engine.hold = asyncio.Event()  # a1's request keeps a1, loaded on demand, in use
        first = asyncio.ensure_future(c.post("/v1/completions", json=_completion("a1")))
        while not engine.arrivals:
            await asyncio.sleep(0.01)
        r = await c.post("/v1/completions", json=_completion("a2"))  # every on-demand adapter in use
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "in use" in r.text
        engine.hold.set()
        assert (await first).status_code == 200
        engine.is_ready = False
        r = await c.get("/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        engine.is_ready, engine.is_draining = True, True
        for r in (await c.get("/health"), await c.post("/v1/completions", json=_completion())):
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
        engine.is_draining = False
        engine.fail("rank 0 fell over")
        r = await c.post("/v1/completions", json=_completion())
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
