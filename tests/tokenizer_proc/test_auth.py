"""The two API keys: `--admin-api-key` alone opens the adapter routes (loading, pinning,
unloading) and shows server paths on /v1/models; the API key opens inference and /metrics,
which the admin key opens too. A path under `--root-path` is guarded as the route it reaches."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.env import ADMIN_API_KEY, API_KEY
from ledgerserve.tokenizer_proc.app import build_app
from ledgerserve.tokenizer_proc.security import StartupRefused
from tests.peft_util import make_tiny_peft_adapter
from tests.tokenizer_proc.app_client import GOOD_COMPLETION, MODEL, assert_error
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio
USER, ADMIN = "user-key-7c1", "admin-key-9d4"
AS_USER = {"Authorization": f"Bearer {USER}"}
AS_ADMIN = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def lora_root(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    make_tiny_peft_adapter(demo_model_dir, root / "sql", seed=1)
    return root


@asynccontextmanager
async def keyed(
    monkeypatch, tokenizer, demo_model_dir: str, lora_root: Path, api: str = USER, admin: str = ADMIN, **settings: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeEngine]]:
    for name, key in ((API_KEY, api), (ADMIN_API_KEY, admin)):
        monkeypatch.setenv(name, key)
    config = EngineConfig(
        model_dir=demo_model_dir,
        served_model_name=MODEL,
        max_model_len=64,
        enable_lora=True,
        lora_allowed_dirs=(str(lora_root),),
        api_key_required=bool(api),
        admin_api_key_required=bool(admin),
        **settings,
    )
    engine = FakeEngine()
    await engine.start()
    app = build_app(engine, tokenizer, config)
    transport = httpx.ASGITransport(app=app, root_path=config.root_path)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        yield client, engine


def _load(path: Path, pinned: bool = False) -> dict[str, Any]:
    return {"lora_name": "sql", "lora_path": str(path / "sql"), "pinned": pinned}


async def test_only_the_admin_key_loads_pins_and_unloads(monkeypatch, tokenizer, demo_model_dir, lora_root) -> None:
    async with keyed(monkeypatch, tokenizer, demo_model_dir, lora_root) as (client, engine):
        for headers, status in (({}, 401), ({"Authorization": "Bearer nope"}, 401), (AS_USER, 403)):
            for route, body in (("load", _load(lora_root, pinned=True)), ("unload", {"lora_name": "sql"})):
                r = await client.post(f"/v1/{route}_lora_adapter", json=body, headers=headers)
                assert_error(r, status, None)
                assert ADMIN not in r.text and USER not in r.text
        assert engine.received == []  # no refused op reached the engine
        r = await client.post("/v1/load_lora_adapter", json=_load(lora_root, pinned=True), headers=AS_ADMIN)
        assert r.status_code == 200, r.text
        assert engine.registry["sql"].pinned
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=AS_ADMIN)
        assert r.status_code == 200 and engine.registry == {}


async def test_inference_and_metrics_take_either_key(monkeypatch, tokenizer, demo_model_dir, lora_root) -> None:
    async with keyed(monkeypatch, tokenizer, demo_model_dir, lora_root) as (client, _):
        for path in ("/metrics", "/v1/models"):
            assert_error(await client.get(path), 401, None)
        assert_error(await client.post("/v1/completions", json=GOOD_COMPLETION), 401, None)
        for headers in (AS_USER, AS_ADMIN):
            assert (await client.post("/v1/completions", json=GOOD_COMPLETION, headers=headers)).status_code == 200
            metrics = await client.get("/metrics", headers=headers)
            assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
        for path in ("/health", "/ping", "/version"):
            assert (await client.get(path)).status_code == 200


async def test_without_an_api_key_inference_is_open(monkeypatch, tokenizer, demo_model_dir, lora_root) -> None:
    async with keyed(monkeypatch, tokenizer, demo_model_dir, lora_root, api="") as (client, engine):
        assert (await client.post("/v1/completions", json=GOOD_COMPLETION)).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        assert_error(await client.post("/v1/load_lora_adapter", json=_load(lora_root)), 401, None)
        assert (await client.post("/v1/load_lora_adapter", json=_load(lora_root), headers=AS_ADMIN)).status_code == 200


async def test_server_paths_are_shown_only_to_the_admin_key(monkeypatch, tokenizer, demo_model_dir, lora_root) -> None:
    async with keyed(monkeypatch, tokenizer, demo_model_dir, lora_root) as (client, _):
        assert (await client.post("/v1/load_lora_adapter", json=_load(lora_root), headers=AS_ADMIN)).status_code == 200
        user = (await client.get("/v1/models", headers=AS_USER)).json()["data"]
        assert [(c["id"], c["root"]) for c in user] == [(MODEL, MODEL), ("sql", "sql")]
        assert str(lora_root) not in str(user) and demo_model_dir not in str(user)
        one = (await client.get("/v1/models/sql", headers=AS_USER)).json()
        assert one["root"] == "sql"
        admin = (await client.get("/v1/models", headers=AS_ADMIN)).json()["data"]
        assert [c["root"] for c in admin] == [demo_model_dir, str((lora_root / "sql").resolve())]


async def test_the_root_path_prefix_does_not_walk_past_the_keys(monkeypatch, tokenizer, demo_model_dir, lora_root):
    """With --root-path /llm, a proxy may pass the prefix on: /llm/v1/... reaches /v1/... and is guarded as it."""
    async with keyed(monkeypatch, tokenizer, demo_model_dir, lora_root, root_path="/llm") as (client, engine):
        assert_error(await client.get("/llm/v1/models"), 401, None)
        assert_error(await client.post("/llm/v1/completions", json=GOOD_COMPLETION), 401, None)
        assert_error(await client.get("/llm/metrics"), 401, None)
        r = await client.post("/llm/v1/load_lora_adapter", json=_load(lora_root), headers=AS_USER)
        assert_error(r, 403, None)
        assert engine.received == []
        assert (await client.get("/llm/v1/models", headers=AS_USER)).status_code == 200


def test_refuses_to_start_without_its_keys(monkeypatch, tokenizer, demo_model_dir: str) -> None:
    def build(api: str, admin: str) -> None:
        monkeypatch.setenv(API_KEY, api)
        monkeypatch.setenv(ADMIN_API_KEY, admin)
        config = EngineConfig(
            model_dir=demo_model_dir, served_model_name=MODEL, max_model_len=64, admin_api_key_required=True
        )
        build_app(FakeEngine(), tokenizer, config)

    with pytest.raises(StartupRefused, match=ADMIN_API_KEY):
        build("", "")
    with pytest.raises(StartupRefused, match="must differ"):
        build("same", "same")
