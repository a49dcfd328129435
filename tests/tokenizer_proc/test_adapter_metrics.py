"""The HTTP side of per-adapter figures, over the app with the fake engine: EngineStats rows
arrive only when they change and are merged per adapter, a load observed counts once under
its adapter (never under a name that is not registered), `vllm:lora_requests_info` keeps one
series, /v1/models gives each adapter's location, and an unload removes every series."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import AdapterLoadObserved, AdapterRow, EngineStats
from ledgerserve.tokenizer_proc.adapter_labels import MIN_SERIES
from ledgerserve.tokenizer_proc.app import build_app
from tests.peft_util import make_tiny_peft_adapter
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
MODEL = "demo"


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
        max_loras=3,
        lora_allowed_dirs=(str(adapter_dir),),
    )
    app = build_app(engine, tokenizer, config)
    await engine.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        for name in ("a", "b", "c"):
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter_dir / "sql")})
            assert r.status_code == 200, r.text
        yield c


async def _samples(client: httpx.AsyncClient) -> list:
    text = (await client.get("/metrics")).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(samples: list, name: str, **labels: str) -> float | None:
    found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


def _stats(step: int, *rows: AdapterRow) -> EngineStats:
    return EngineStats(
        step,
        1,
        2,
        10,
        20,
        adapter_rows=list(rows),
        num_used_slots=2,
        num_loading_slots=1,
        cpu_tier_bytes=4096,
        num_lora_wait_steps=3,
        lora_wait_ms=250.0,
    )


async def test_rows_loads_and_requests_info(client, engine) -> None:
    engine._dispatch(_stats(1, AdapterRow("a", 1, "gpu", False, 1, 0, 5, 7, 2), AdapterRow("b", 2, "cpu", True, 0, 2)))
    engine._dispatch(AdapterLoadObserved("a", 1, "disk", 12.0))
    engine._dispatch(AdapterLoadObserved("a", 1, "cpu", 3.0))
    engine._dispatch(AdapterLoadObserved("zz", 9, "disk", 1.0))  # not registered: no series
    samples = await _samples(client)
    assert [_value(samples, "ledgerserve_lora_location", adapter="a", tier=t) for t in ("gpu", "cpu", "disk")] == [
        1,
        0,
        0,
    ]
    assert _value(samples, "ledgerserve_lora_location", adapter="b", tier="cpu") == 1
    assert _value(samples, "ledgerserve_lora_location", adapter="c", tier="disk") is None  # no row yet
    assert (
        _value(samples, "ledgerserve_lora_pinned", adapter="a"),
        _value(samples, "ledgerserve_lora_pinned", adapter="b"),
    ) == (0, 1)
    assert _value(samples, "ledgerserve_lora_requests_waiting", adapter="b") == 2
    assert _value(samples, "ledgerserve_lora_prompt_tokens_total", adapter="a") == 5
    assert _value(samples, "ledgerserve_lora_generation_tokens_total", adapter="a") == 7
    assert _value(samples, "ledgerserve_lora_prefix_cache_hit_tokens_total", adapter="a") == 2
    assert _value(samples, "ledgerserve_lora_loads_total", adapter="a", source_tier="disk") == 1
    assert _value(samples, "ledgerserve_lora_load_seconds_sum", adapter="a") == pytest.approx(0.015)
    assert _value(samples, "ledgerserve_lora_load_seconds_count", adapter="a") == 2
    assert not [s for s in samples if s.labels.get("adapter") == "zz"]
    assert (_value(samples, "ledgerserve_lora_slots_used"), _value(samples, "ledgerserve_lora_loads_in_flight")) == (
        2,
        1,
    )
    assert _value(samples, "ledgerserve_lora_cpu_tier_bytes") == 4096
    assert _value(samples, "ledgerserve_lora_wait_steps_total") == 3
    assert _value(samples, "ledgerserve_lora_wait_seconds_total") == 0.25
    (info,) = [s for s in samples if s.name == "vllm:lora_requests_info"]
    assert info.labels == {"running_lora_adapters": "a", "waiting_lora_adapters": "b", "max_lora": "3"}

    engine._dispatch(_stats(2, AdapterRow("b", 2, "gpu", True, 2, 0)))  # only b changed: a's row stays
    samples = await _samples(client)
    assert _value(samples, "ledgerserve_lora_location", adapter="a", tier="gpu") == 1
    (info,) = [s for s in samples if s.name == "vllm:lora_requests_info"]  # one series: the old one is gone
    assert (info.labels["running_lora_adapters"], info.labels["waiting_lora_adapters"]) == ("a,b", "")


async def test_models_carry_locations_and_unload_removes_series(client, engine) -> None:
    engine._dispatch(_stats(1, AdapterRow("a", 1, "gpu"), AdapterRow("b", 2, "cpu")))
    engine._dispatch(AdapterLoadObserved("a", 1, "disk", 12.0))
    cards = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert {name: cards[name]["location"] for name in "abc"} == {"a": "gpu", "b": "cpu", "c": "disk"}
    assert "location" not in cards[MODEL]
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
    assert r.status_code == 200, r.text
    samples = await _samples(client)
    assert not [s for s in samples if s.labels.get("adapter") == "a"]
    assert _value(samples, "ledgerserve_lora_location", adapter="b", tier="cpu") == 1
    assert "a" not in {m["id"] for m in (await client.get("/v1/models")).json()["data"]}


async def test_per_adapter_series_are_bounded(tokenizer, demo_model_dir: str, adapter_dir: Path) -> None:
    """Of 70 adapters, each with a row, loads and finished requests, at most MIN_SERIES (64, more
    than --max-cpu-loras here) have series in each family: the most active rows (running, then
    waiting, pinned, gpu, cpu), and the adapters whose loads and requests came last."""
    engine = FakeEngine()
    config = EngineConfig(
        model_dir=demo_model_dir,
        served_model_name=MODEL,
        max_model_len=64,
        enable_lora=True,
        max_loras=2,
        max_cpu_loras=4,
        lora_allowed_dirs=(str(adapter_dir),),
    )
    app = build_app(engine, tokenizer, config)
    await engine.start()
    names = [f"adapter-{i:02d}" for i in range(MIN_SERIES + 6)]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        for name in names:
            load = {"lora_name": name, "lora_path": str(adapter_dir / "sql")}
            assert (await client.post("/v1/load_lora_adapter", json=load)).status_code == 200
            r = await client.post("/v1/completions", json={"model": name, "prompt": [5, 6], "max_tokens": 1})
            assert r.status_code == 200, r.text
            engine._dispatch(AdapterLoadObserved(name, engine.registry[name].version_id, "disk", 2.0))
        busy = {"adapter-65": 3, "adapter-01": 1}  # running requests
        engine._dispatch(_stats(1, *[AdapterRow(n, 1, "disk", False, busy.get(n, 0)) for n in names]))
        engine._dispatch(_stats(2, AdapterRow("adapter-02", 1, "gpu", True), AdapterRow("adapter-03", 1, "cpu")))
        samples = await _samples(client)
    by_family: dict[str, set[str]] = {}
    for s in samples:
        label = s.labels.get("adapter") or (s.labels.get("namespace") if s.labels.get("namespace") != "base" else None)
        if label is not None:
            by_family.setdefault(s.name, set()).add(label)
    active = {"adapter-65", "adapter-01", "adapter-02", "adapter-03"}
    assert active < by_family["ledgerserve_lora_location"] and len(by_family["ledgerserve_lora_location"]) == MIN_SERIES
    assert by_family["ledgerserve_lora_loads_total"] == set(names[-MIN_SERIES:])
    assert by_family["ledgerserve_prompt_tokens_total"] == set(names[-MIN_SERIES:])
    assert all(len(found) <= MIN_SERIES for found in by_family.values()), by_family
