"""Adapter names are model ids and metrics labels: `/v1/load_lora_adapter` refuses long names,
names with control or format characters (zero-width, bidi controls), line separators, lone
surrogates or odd spaces, and names not in Unicode NFC (a name that looks like another is
another), before the path is looked at, and registers nothing; so do `--lora-modules`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.adapter_routes import StartupAdapterError, validate_startup_adapters
from ledgerserve.tokenizer_proc.adapters import MAX_NAME_CHARS, load_base_shapes
from ledgerserve.tokenizer_proc.app import build_app
from tests.peft_util import make_tiny_peft_adapter
from tests.tokenizer_proc.fake_engine import FakeEngine

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def lora_root(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    make_tiny_peft_adapter(demo_model_dir, root / "sql", seed=1)
    return root


@pytest.fixture
async def client(
    tokenizer, demo_model_dir: str, lora_root: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeEngine]]:
    engine = FakeEngine()
    config = EngineConfig(
        model_dir=demo_model_dir,
        served_model_name="demo",
        max_model_len=64,
        enable_lora=True,
        lora_allowed_dirs=(str(lora_root),),
    )
    app = build_app(engine, tokenizer, config)
    await engine.start()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        yield c, engine


def _body(name: str, path: Path) -> bytes:
    return json.dumps({"lora_name": name, "lora_path": str(path)}).encode()  # ensure_ascii: "\ud800" stays escaped


@pytest.mark.parametrize(
    "name",
    [
        "x" * (MAX_NAME_CHARS + 1),
        "new\nline",
        "tab\there",
        "bell\x07",
        "del\x7f",
        "c1\x85",
        "sep\u2028",
        "para\u2029",
        "lone\ud800",
    ],
)
async def test_bad_names_are_refused(client, lora_root: Path, name: str) -> None:
    c, engine = client
    r = await c.post(
        "/v1/load_lora_adapter", content=_body(name, lora_root / "sql"), headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "lora_name" and error["code"] == 400
    assert engine.registry == {} and not engine.received


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("sql\u200b", "U+200B (ZERO WIDTH SPACE) at position 3"),
        ("s\u200dql", "U+200D"),
        ("\ufeffsql", "U+FEFF"),
        ("sql\u202egpj.exe", "U+202E (RIGHT-TO-LEFT OVERRIDE)"),
        ("sql\u2067x\u2069", "U+2067"),
        ("sql\u00a0v2", "U+00A0 (NO-BREAK SPACE)"),
        ("priv\ue000", "U+E000"),
        ("cafe\u0301", "NFC"),  # e + combining acute accent: NFC writes it as one character
        ("\u212bngstrom", "NFC"),  # the Angstrom sign: NFC writes it as A with ring above
    ],
)
async def test_look_alike_names_are_refused_naming_the_problem(
    client, lora_root: Path, name: str, problem: str
) -> None:
    c, engine = client
    r = await c.post(
        "/v1/load_lora_adapter", content=_body(name, lora_root / "sql"), headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "lora_name" and problem in error["message"]
    assert engine.registry == {} and not engine.received


@pytest.mark.parametrize(
    "name", ["x" * MAX_NAME_CHARS, "sql-v2.1_ß", "日本語", "emoji-\U0001f600", "caf\u00e9", "two words"]
)
async def test_good_names_load(client, lora_root: Path, name: str) -> None:
    c, engine = client
    r = await c.post(
        "/v1/load_lora_adapter", content=_body(name, lora_root / "sql"), headers={"content-type": "application/json"}
    )
    assert r.status_code == 200, r.text
    assert list(engine.registry) == [name]
    assert name in [m["id"] for m in (await c.get("/v1/models")).json()["data"]]


@pytest.mark.parametrize("name", ["sql\u200b", "cafe\u0301"])
def test_start_up_adapters_with_look_alike_names_are_refused(demo_model_dir: str, lora_root: Path, name: str) -> None:
    config = EngineConfig(
        model_dir=demo_model_dir,
        served_model_name="demo",
        max_model_len=64,
        enable_lora=True,
        lora_modules=((name, str(lora_root / "sql")),),
    )
    with pytest.raises(StartupAdapterError, match=r"U\+200B|NFC"):
        validate_startup_adapters(config, load_base_shapes(demo_model_dir))
