"""Run-time adapter updates: on with --lora-allowed-dir or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING,
off otherwise, for unloads as for loads (over the fake engine)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.app import build_app
from tests.peft_util import make_tiny_peft_adapter

pytestmark = pytest.mark.anyio
MODEL = "demo"
VARIABLE = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@pytest.fixture(scope="module")
def lora_root(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    make_tiny_peft_adapter(demo_model_dir, root / "sql", seed=1)
    make_tiny_peft_adapter(demo_model_dir, root / "chat", seed=2)
    return root


async def _requests(engine, tokenizer, config: EngineConfig) -> tuple[httpx.Response, httpx.Response, list[str]]:
    """With `sql` loaded at start-up: unload it, then load `chat`; the answers and the adapters then."""
    app = build_app(engine, tokenizer, config)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            unload = await c.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
            load = await c.post(
                "/v1/load_lora_adapter", json={"lora_name": "chat", "lora_path": config.lora_modules[1][1]}
            )
            models = [m["id"] for m in (await c.get("/v1/models")).json()["data"]]
    return unload, load, models


def _config(demo_model_dir: str, lora_root: Path, **kw: object) -> EngineConfig:
    modules = (("sql", str(lora_root / "sql")), ("chat-at-start", str(lora_root / "chat")))
    return EngineConfig(
        model_dir=demo_model_dir,
        served_model_name=MODEL,
        max_model_len=64,
        enable_lora=True,
        lora_modules=modules,
        **kw,
    )  # type: ignore[arg-type]


def _refused(r: httpx.Response, param: str, *fragments: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400
    for fragment in fragments:
        assert fragment in error["message"], error["message"]


@pytest.mark.parametrize("value", [None, "0", "false", "yes", ""])
async def test_updates_off_refuse_unload_like_load(engine, tokenizer, demo_model_dir, lora_root, monkeypatch, value):
    if value is None:
        monkeypatch.delenv(VARIABLE, raising=False)
    else:
        monkeypatch.setenv(VARIABLE, value)
    unload, load, models = await _requests(engine, tokenizer, _config(demo_model_dir, lora_root))
    _refused(unload, "lora_name", "Unloading adapters at run time is disabled", "--lora-allowed-dir", VARIABLE)
    _refused(load, "lora_path", "Loading adapters at run time is disabled", "--lora-allowed-dir", VARIABLE)
    assert models == [MODEL, "chat-at-start", "sql"]  # nothing changed


@pytest.mark.parametrize("value", ["1", "true", " TRUE "])
async def test_variable_alone_allows_unload_and_refuses_loads_naming_the_flag(
    engine, tokenizer, demo_model_dir, lora_root, monkeypatch, value
):
    monkeypatch.setenv(VARIABLE, value)
    unload, load, models = await _requests(engine, tokenizer, _config(demo_model_dir, lora_root))
    assert unload.status_code == 200, unload.text
    _refused(load, "lora_path", VARIABLE, "--lora-allowed-dir")
    assert models == [MODEL, "chat-at-start"]


async def test_allowed_dir_allows_both(engine, tokenizer, demo_model_dir, lora_root, monkeypatch) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    config = _config(demo_model_dir, lora_root, lora_allowed_dirs=(str(lora_root),))
    unload, load, models = await _requests(engine, tokenizer, config)
    assert (unload.status_code, load.status_code) == (200, 200), (unload.text, load.text)
    assert models == [MODEL, "chat", "chat-at-start"]
