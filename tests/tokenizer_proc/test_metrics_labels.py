"""/metrics series labelled by an adapter name live only while the adapter is registered:
unloading removes them, and a request that ends after its adapter was unloaded does not
bring them back. Over the app with the fake engine (its replies carry the registry, as
the core's do)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.app import build_app
from tests.peft_util import make_tiny_peft_adapter
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
MODEL = "demo"
LABELLED = ("ledgerserve_prompt_tokens", "ledgerserve_prefix_cache_hit_tokens")


@pytest.fixture(scope="module")
def adapter_dir(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    make_tiny_peft_adapter(demo_model_dir, root / "sql", seed=1)
    return root


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine, tokenizer, demo_model_dir: str, adapter_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    config = EngineConfig(
        model_dir=demo_model_dir,
        served_model_name=MODEL,
        max_model_len=64,
        enable_lora=True,
        lora_allowed_dirs=(str(adapter_dir),),
    )
    app = build_app(engine, tokenizer, config)
    await engine.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


async def _namespaces(client: httpx.AsyncClient) -> dict[str, set[str]]:
    """The `namespace` label values of each adapter-labelled counter."""
    text = (await client.get("/metrics")).text
    out: dict[str, set[str]] = {name: set() for name in LABELLED}
    for family in text_string_to_metric_families(text):
        if family.name in out:
            out[family.name] |= {sample.labels["namespace"] for sample in family.samples}
    return out


async def _complete(client: httpx.AsyncClient, model: str) -> None:
    r = await client.post("/v1/completions", json={"model": model, "prompt": [5, 6], "max_tokens": 1})
    assert r.status_code == 200, r.text


async def _op(client: httpx.AsyncClient, route: str, body: dict) -> None:
    r = await client.post(route, json=body)
    assert r.status_code == 200, r.text


async def test_a_thousand_unloaded_adapters_leave_no_series(client, adapter_dir: Path) -> None:
    await _complete(client, MODEL)
    for i in range(1000):
        name = f"adapter-{i}"
        await _op(client, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir / "sql")})
        await _complete(client, name)
        if i == 0:
            assert all(name in found for found in (await _namespaces(client)).values())  # the series exist
        await _op(client, "/v1/unload_lora_adapter", {"lora_name": name})
    await _op(client, "/v1/load_lora_adapter", {"lora_name": "kept", "lora_path": str(adapter_dir / "sql")})
    await _complete(client, "kept")
    assert await _namespaces(client) == {name: {"base", "kept"} for name in LABELLED}


async def test_a_request_ending_after_its_unload_recreates_no_series(client, engine, adapter_dir: Path) -> None:
    await _op(client, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(adapter_dir / "sql")})
    engine.hold = asyncio.Event()
    running = asyncio.create_task(_complete(client, "late"))
    while not engine.arrivals:
        await asyncio.sleep(0.01)
    await _op(client, "/v1/unload_lora_adapter", {"lora_name": "late"})
    engine.hold.set()
    await running  # the request finishes on the unloaded adapter, as a deferred eviction lets it
    assert all("late" not in found for found in (await _namespaces(client)).values())
