"""Adapter endpoints, /v1/models and adapter routing, over the fake engine."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import torch

from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.adapter_routes import StartupAdapterError
from ledgerserve.tokenizer_proc.app import build_app
from tests.peft_util import make_tiny_peft_adapter
from tests.shared.hostile_adapters import poison_weights
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
MODEL = "demo"


@pytest.fixture(scope="module")
def lora_root(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    make_tiny_peft_adapter(demo_model_dir, root / "sql", seed=1)
    make_tiny_peft_adapter(demo_model_dir, root / "chat", seed=2, target_modules=["o_proj", "down_proj"])
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{")
    return root


def _config(demo_model_dir: str, **kw: object) -> EngineConfig:
    return EngineConfig(model_dir=demo_model_dir, served_model_name=MODEL, max_model_len=64, **kw)  # type: ignore[arg-type]


async def _client(engine: FakeEngine, tokenizer, config: EngineConfig) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(engine, tokenizer, config)
    await engine.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c


@pytest.fixture
async def client(engine, tokenizer, demo_model_dir: str, lora_root: Path) -> AsyncIterator[httpx.AsyncClient]:
    config = _config(demo_model_dir, enable_lora=True, lora_allowed_dirs=(str(lora_root),))
    async for c in _client(engine, tokenizer, config):
        yield c


def _files_sha256(path: Path) -> str:
    """The content digest, computed independently: SHA-256 of the config's bytes, then the weights'."""
    data = (path / "adapter_config.json").read_bytes() + (path / "adapter_model.safetensors").read_bytes()
    return hashlib.sha256(data).hexdigest()


def _error(r: httpx.Response, status: int, fragment: str) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert fragment.lower() in error["message"].lower(), error["message"]
    assert "Traceback" not in r.text
    return error


async def _load(client: httpx.AsyncClient, name: str, path: str | Path, **kw: object) -> httpx.Response:
    return await client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **kw})


async def test_load_list_route_unload(client, engine, lora_root: Path) -> None:
    r = await _load(client, "sql", lora_root / "sql")
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
    load = engine.received[-1]
    assert load.name == "sql" and load.path == os.path.realpath(lora_root / "sql") and load.max_rank == 4
    assert load.num_bytes == os.path.getsize(lora_root / "sql" / "adapter_model.safetensors")
    assert load.content_sha256 == _files_sha256(lora_root / "sql")
    cards = (await client.get("/v1/models")).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL, None), ("sql", MODEL)]
    assert cards[1]["root"] == "sql"  # no server path without the admin key
    r = await client.post("/v1/completions", json={"model": "sql", "prompt": [5, 6], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["model"] == "sql"
    r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
    assert r.status_code == 200 and "removed" in r.text
    assert [c["id"] for c in (await client.get("/v1/models")).json()["data"]] == [MODEL]
    _error(await client.post("/v1/completions", json={"model": "sql", "prompt": [5]}), 404, "does not exist")
    assert [a.lora_name for a in engine.arrivals] == ["sql"]


async def test_duplicate_and_inplace(client, engine, lora_root: Path) -> None:
    assert (await _load(client, "sql", lora_root / "sql")).status_code == 200
    _error(await _load(client, "sql", lora_root / "chat"), 400, "already been loaded")
    assert (await _load(client, "sql", lora_root / "chat", load_inplace=True)).status_code == 200
    assert engine.received[-1].content_sha256 == _files_sha256(lora_root / "chat")  # the new version's files
    assert engine.registry["sql"].version_id == 2
    cards = (await client.get("/v1/models")).json()["data"]
    assert [(c["id"], c["root"]) for c in cards] == [(MODEL, MODEL), ("sql", "sql")]


async def test_unload_unknown_is_404(client) -> None:
    _error(await client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}), 404, "cannot be found")


async def test_lora_path_routing(client, engine, lora_root: Path) -> None:
    await _load(client, "sql", lora_root / "sql")
    await _load(client, "chat", lora_root / "chat")
    for lora_path in ("chat", str(lora_root / "chat"), str(lora_root / "x" / ".." / "chat")):
        body = {"model": MODEL, "prompt": [5], "max_tokens": 1, "lora_path": lora_path}
        assert (await client.post("/v1/completions", json=body)).status_code == 200
    chat = {"model": "sql", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert (await client.post("/v1/chat/completions", json=chat)).status_code == 200
    assert (
        await client.post("/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 1})
    ).status_code == 200
    assert [a.lora_name for a in engine.arrivals] == ["chat", "chat", "chat", "sql", None]
    _error(
        await client.post("/v1/completions", json={"model": MODEL, "prompt": [5], "lora_path": "zzz"}),
        404,
        "not loaded",
    )
    body = {"model": "sql", "prompt": [5], "lora_path": "chat"}
    _error(await client.post("/v1/completions", json=body), 400, "different adapters")


async def test_unknown_model_is_404(client) -> None:
    error = _error(await client.post("/v1/completions", json={"model": "ghost", "prompt": [5]}), 404, "does not exist")
    assert error["type"] == "NotFoundError" and error["param"] == "model"


async def test_core_404_after_unload_surfaces(client, engine, lora_root: Path) -> None:
    await _load(client, "sql", lora_root / "sql")
    engine.unload_unheard("sql")  # the core unloaded it; the mirror has not heard yet
    _error(await client.post("/v1/completions", json={"model": "sql", "prompt": [5]}), 404, "does not exist")
    r = await client.post("/v1/completions", json={"model": "sql", "prompt": [5], "stream": True})
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    assert r.text.endswith("data: [DONE]\n\n") and events[-1]["error"]["code"] == 404


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("/etc", "not inside"),
        ("{root}/../outside", "not inside"),
        ("{root}/escape", "not inside"),  # a symlink inside the root pointing out of it
        ("", "non-empty"),
    ],
)
async def test_allowed_dir_refusals(client, lora_root: Path, tmp_path: Path, path: str, fragment: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    link = lora_root / "escape"
    if not link.is_symlink():
        link.symlink_to(outside)
    _error(await _load(client, "x", path.format(root=lora_root)), 400, fragment)


async def test_validation_refusals(client, lora_root: Path) -> None:
    _error(await _load(client, "x", lora_root / "missing"), 404, "No adapter directory")
    _error(await _load(client, "x", lora_root / "broken"), 400, "not valid JSON")
    _error(await _load(client, MODEL, lora_root / "sql"), 400, "base model")
    _error(await client.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400, "lora_path")


async def test_weights_past_the_model_dtype_are_refused_with_a_400(
    engine, tokenizer, demo_model_dir, lora_root: Path
) -> None:
    """A float32 weight of 1e5 is finite in the file but infinite in float16: a float16 server
    refuses it at registration (the workers then need not check values again); a float32 one loads it."""
    big = lora_root / "big-f32"
    if not big.exists():
        shutil.copytree(lora_root / "sql", big)
        poison_weights(1e5, torch.float32)(big, big)
    roots = (str(lora_root),)
    async for c in _client(
        engine, tokenizer, _config(demo_model_dir, enable_lora=True, lora_allowed_dirs=roots, dtype="float16")
    ):
        error = _error(await _load(c, "big", big), 400, "become infinite in the model's dtype (float16)")
        assert error["param"] == "lora_path" and "big" not in engine.registry and not engine.received
        assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == [MODEL]
    async for c in _client(engine, tokenizer, _config(demo_model_dir, enable_lora=True, lora_allowed_dirs=roots)):
        assert (await _load(c, "big", big)).status_code == 200


async def test_symlink_inside_root_loads_its_real_path(client, engine, lora_root: Path) -> None:
    link = lora_root / "alias"
    if not link.is_symlink():
        link.symlink_to(lora_root / "sql")
    assert (await _load(client, "alias", link)).status_code == 200
    assert engine.registry["alias"].path == os.path.realpath(lora_root / "sql")


async def test_no_allowed_dir_refuses_runtime_loads(engine, tokenizer, demo_model_dir, lora_root: Path) -> None:
    async for c in _client(engine, tokenizer, _config(demo_model_dir, enable_lora=True)):
        _error(await _load(c, "sql", lora_root / "sql"), 400, "--lora-allowed-dir")


async def test_lora_disabled(engine, tokenizer, demo_model_dir, lora_root: Path) -> None:
    async for c in _client(engine, tokenizer, _config(demo_model_dir)):
        _error(await _load(c, "sql", lora_root / "sql"), 400, "--enable-lora")
        _error(await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}), 400, "--enable-lora")
        _error(
            await c.post("/v1/completions", json={"model": MODEL, "prompt": [5], "lora_path": "sql"}),
            400,
            "--enable-lora",
        )


async def test_startup_adapters_load_before_serving(engine, tokenizer, demo_model_dir, lora_root: Path) -> None:
    config = _config(demo_model_dir, enable_lora=True, lora_modules=(("sql", str(lora_root / "sql")),))
    app = build_app(engine, tokenizer, config)
    async with app.router.lifespan_context(app):
        assert engine.registry["sql"].path == os.path.realpath(lora_root / "sql")
        assert [e.content_sha256 for e in engine.received] == [_files_sha256(lora_root / "sql")]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert [m["id"] for m in (await c.get("/v1/models")).json()["data"]] == [MODEL, "sql"]


async def test_startup_adapter_refused_by_validation(engine, tokenizer, demo_model_dir, lora_root: Path) -> None:
    config = _config(demo_model_dir, enable_lora=True, lora_modules=(("bad", str(lora_root / "broken")),))
    with pytest.raises(StartupAdapterError, match="start-up adapter 'bad'.*not valid JSON"):
        build_app(engine, tokenizer, config)


async def test_startup_adapter_refused_by_core(tokenizer, demo_model_dir, lora_root: Path) -> None:
    engine = FakeEngine(enable_lora=False)  # the core refuses every load
    config = _config(demo_model_dir, enable_lora=True, lora_modules=(("sql", str(lora_root / "sql")),))
    app = build_app(engine, tokenizer, config)
    with pytest.raises(StartupAdapterError, match="refused it \\(400\\): LoRA is disabled"):
        async with app.router.lifespan_context(app):
            pass
