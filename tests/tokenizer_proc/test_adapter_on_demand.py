"""Adapters loaded on a request's first use, and the adapter API's pins and strict bodies, over
the fake engine: what the HTTP process validates, sends and answers."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import AdapterLoadRequested
from ledgerserve.tokenizer_proc.app import build_app
from tests.peft_util import make_tiny_peft_adapter
from tests.tokenizer_proc.app_client import assert_error, assert_still_serves
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
MODEL = "demo"


@pytest.fixture(scope="module")
def root(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    top = tmp_path_factory.mktemp("on-demand")
    make_tiny_peft_adapter(demo_model_dir, top / "direct", seed=1)
    make_tiny_peft_adapter(demo_model_dir, top / "names" / "alpha", seed=2)
    (top / "names" / "broken").mkdir()
    (top / "names" / "broken" / "adapter_config.json").write_text("{")
    outside = tmp_path_factory.mktemp("outside")
    make_tiny_peft_adapter(demo_model_dir, outside / "evil", seed=3)
    (top / "names" / "escape").symlink_to(outside / "evil")
    return top


def _config(demo_model_dir: str, **kw: object) -> EngineConfig:
    return EngineConfig(model_dir=demo_model_dir, served_model_name=MODEL, max_model_len=64, enable_lora=True, **kw)  # type: ignore[arg-type]


async def _app_client(engine: FakeEngine, tokenizer, config: EngineConfig) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(engine, tokenizer, config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


@pytest.fixture
def engine(request: pytest.FixtureRequest) -> FakeEngine:
    return FakeEngine(max_on_demand_loras=getattr(request, "param", 64))


@pytest.fixture
async def client(engine, tokenizer, demo_model_dir: str, root: Path) -> AsyncIterator[httpx.AsyncClient]:
    config = _config(demo_model_dir, lora_allowed_dirs=(str(root),), lora_resolve_dir=str(root / "names"))
    async for c in _app_client(engine, tokenizer, config):
        yield c


def _loads(engine: FakeEngine) -> list[AdapterLoadRequested]:
    return [e for e in engine.received if isinstance(e, AdapterLoadRequested)]


def _completion(model: str = MODEL, **kw: object) -> dict:
    return {"model": model, "prompt": [5, 6], "max_tokens": 2, **kw}


async def test_lora_path_loads_on_first_request_under_its_real_path(client, engine, root: Path) -> None:
    spelled = str(root / "names" / ".." / "direct")
    r = await client.post("/v1/completions", json=_completion(lora_path=spelled))
    assert r.status_code == 200, r.text
    real = os.path.realpath(root / "direct")
    (load,) = _loads(engine)
    assert (load.name, load.path, load.on_demand, load.pinned, load.load_inplace) == (real, real, True, False, False)
    assert len(load.content_sha256) == 64 and engine.arrivals[-1].lora_name == real
    assert engine.arrivals[-1].lora_version_id == engine.registry[real].version_id  # the version it resolved
    r = await client.post("/v1/completions", json=_completion(lora_path=str(root / "direct")))
    assert r.status_code == 200 and len(_loads(engine)) == 1  # registered now: no second load
    cards = (await client.get("/v1/models")).json()["data"]
    assert [(c["id"], c["root"], c["pinned"]) for c in cards[1:]] == [(real, real, False)]


async def test_resolvable_name_loads_from_the_resolve_dir(client, engine, root: Path) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json={"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200 and r.json()["model"] == "alpha"
    (load,) = _loads(engine)
    assert (load.name, load.path, load.on_demand) == ("alpha", os.path.realpath(root / "names" / "alpha"), True)


async def test_concurrent_first_requests_load_once(engine, tokenizer, demo_model_dir: str, root: Path) -> None:
    engine.op_delay_s = 0.05  # the core takes a while: every request arrives while the load is in flight
    config = _config(demo_model_dir, lora_allowed_dirs=(str(root),), lora_resolve_dir=str(root / "names"))
    async for c in _app_client(engine, tokenizer, config):
        responses = await asyncio.gather(*(c.post("/v1/completions", json=_completion("alpha")) for _ in range(20)))
        assert [r.status_code for r in responses] == [200] * 20
    assert len(_loads(engine)) == 1 and [a.lora_name for a in engine.arrivals] == ["alpha"] * 20


@pytest.mark.parametrize(
    ("body", "status", "param", "fragment"),
    [
        (_completion(lora_path="/etc"), 400, "lora_path", "not inside"),
        (_completion(lora_path="{root}/names/escape"), 400, "lora_path", "not inside"),  # a link out of the root
        (_completion(lora_path="{root}/" + "d" * 300), 400, "lora_path", "longer than 256"),
        (_completion(lora_path="{root}/line\u2028break"), 400, "lora_path", "line separators"),
        (_completion("broken"), 400, "model", "not valid JSON"),
        (_completion("escape"), 400, "model", "outside every --lora-allowed-dir"),
        (_completion("missing"), 404, "model", "does not exist"),
        (_completion("names/alpha"), 404, "model", "does not exist"),  # not a single path component
        (_completion("..%2Falpha"), 404, "model", "does not exist"),
        (_completion(lora_path="relative-name"), 404, "lora_path", "not loaded"),
    ],
)
async def test_refused_first_requests_load_nothing(client, engine, root: Path, body, status, param, fragment) -> None:
    if "lora_path" in body:
        body = {**body, "lora_path": body["lora_path"].format(root=root)}
    message = assert_error(await client.post("/v1/completions", json=body), status, param)
    assert fragment.lower() in message.lower(), message
    assert _loads(engine) == [] and engine.arrivals == []
    await assert_still_serves(client)


@pytest.mark.parametrize("engine", [1], indirect=True)  # one adapter registered on demand at once
async def test_the_cores_refusal_reaches_the_client(client, engine, root: Path) -> None:
    engine.hold = asyncio.Event()  # the first request keeps its adapter, loaded on demand, in use
    first = asyncio.create_task(client.post("/v1/completions", json=_completion(lora_path=str(root / "direct"))))
    while not engine.arrivals:
        await asyncio.sleep(0.01)
    message = assert_error(await client.post("/v1/completions", json=_completion("alpha")), 503, "model")
    assert "retry later" in message and [a.lora_name for a in engine.arrivals] == [os.path.realpath(root / "direct")]
    engine.hold.set()
    assert (await first).status_code == 200


async def test_without_allowed_dirs_nothing_loads_on_demand(engine, tokenizer, demo_model_dir: str, root: Path) -> None:
    app = build_app(engine, tokenizer, _config(demo_model_dir, lora_resolve_dir=""))
    transport = httpx.ASGITransport(app=app)
    async with openai.AsyncOpenAI(
        base_url="http://test/v1",
        api_key="unused",
        max_retries=0,
        http_client=httpx.AsyncClient(transport=transport, base_url="http://test"),
    ) as oai:
        with pytest.raises(openai.NotFoundError, match="The LoRA adapter .* is not loaded"):
            await oai.completions.create(
                model=MODEL, prompt="hi", max_tokens=2, extra_body={"lora_path": str(root / "direct")}
            )
        with pytest.raises(openai.NotFoundError, match="The model `alpha` does not exist"):
            await oai.completions.create(model="alpha", prompt="hi", max_tokens=2)
    assert _loads(engine) == []


async def test_pinned_load_reaches_the_core_and_the_model_card(client, engine, root: Path) -> None:
    r = await client.post(
        "/v1/load_lora_adapter", json={"lora_name": "p", "lora_path": str(root / "direct"), "pinned": True}
    )
    assert r.status_code == 200, r.text
    assert _loads(engine)[-1].pinned and not _loads(engine)[-1].on_demand
    cards = {c["id"]: c for c in (await client.get("/v1/models")).json()["data"]}
    assert cards["p"]["pinned"] is True and "pinned" not in cards[MODEL]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/load_lora_adapter", {"lora_name": "p", "lora_path": "/x", "pinned": "yes"}, "pinned"),
        ("/v1/load_lora_adapter", {"lora_name": "p", "lora_path": "/x", "pin": True}, "pin"),
        ("/v1/unload_lora_adapter", {"lora_name": "p", "force": True}, "force"),
    ],
)
async def test_adapter_api_refuses_unknown_fields_and_loose_types(client, engine, route, body, param) -> None:
    message = assert_error(await client.post(route, json=body), 400, param)
    assert param in message and engine.received == []


async def test_pinned_startup_adapters(engine, tokenizer, demo_model_dir: str, root: Path) -> None:
    config = _config(
        demo_model_dir,
        max_loras=2,
        lora_modules=(("a", str(root / "direct")), ("b", str(root / "names" / "alpha"))),
        pinned_lora_modules=("b",),
    )
    app = build_app(engine, tokenizer, config)
    async with app.router.lifespan_context(app):
        assert [(e.name, e.pinned) for e in _loads(engine)] == [("a", False), ("b", True)]
    with pytest.raises(ValueError, match="at most max_loras - 1 = 1 adapters may be pinned"):
        _config(demo_model_dir, max_loras=2, lora_modules=config.lora_modules, pinned_lora_modules=("a", "b"))
