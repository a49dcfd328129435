"""scripts/adapters/lora_stress.py: its status rules, and a short run against the fake-engine app
under a real uvicorn on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import AdapterOpReplied
from ledgerserve.tokenizer_proc.app import build_app
from scripts.adapters.lora_stress import Outcome, main, parse_args, run_stress, summarize
from scripts.common.request_loop import check_loopback
from tests.netutil import free_port, serve_in_thread
from tests.peft_util import make_tiny_peft_adapter
from tests.tokenizer_proc.fake_engine import FakeEngine


@pytest.fixture(scope="module")
def lora_root(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("stress-loras")
    make_tiny_peft_adapter(demo_model_dir, root / "a", seed=1)
    make_tiny_peft_adapter(demo_model_dir, root / "b", seed=2, target_modules=["down_proj"])
    return root


@pytest.fixture(scope="module")
def server(tokenizer, demo_model_dir: str, lora_root: Path) -> Iterator[tuple[str, FakeEngine]]:
    engine = FakeEngine(delay_s=0.005, op_delay_s=0.02)
    port = free_port()
    config = EngineConfig(
        model_dir=demo_model_dir,
        served_model_name="demo",
        max_model_len=128,
        port=port,
        enable_lora=True,
        lora_allowed_dirs=(str(lora_root),),
    )
    with serve_in_thread(build_app(engine, tokenizer, config), port) as url:
        yield url, engine


def _args(url: str, lora_root: Path, *extra: str):
    return parse_args(["--base-url", url, "--adapters", f"a={lora_root / 'a'}", f"b={lora_root / 'b'}", *extra])


def test_stress_against_fake_engine(server, lora_root: Path) -> None:
    server, _ = server
    args = _args(
        server, lora_root, "--concurrency", "6", "--rounds", "3", "--requests", "24", "--max-tokens", "4", "--seed", "3"
    )
    summary = run_stress(args)
    assert summary["unexpected"] == [], summary
    counts = summary["counts"]
    assert sum(counts["base"].values()) + sum(counts["adapter"].values()) + sum(counts["lora_path"].values()) == 72
    assert counts["reload"] == {"200": 6} and counts["unload"] == {"200": 6}
    assert counts["setup_unload"] == {"404": 2}
    assert summary["latency_ms"]["p50"] is not None and 90 <= summary["num_requests"] <= 110
    assert counts["load"].get("400", 0) >= 1 and counts["adapter"].get("404", 0) >= 1, counts  # races happened
    assert main(["--base-url", server, "--rounds", "1", "--requests", "4", "--adapters", f"a={lora_root / 'a'}"]) == 0


def test_stress_catches_an_unload_that_does_nothing(server, lora_root: Path, monkeypatch) -> None:
    url, engine = server
    adapters = engine.engine.core.adapters
    monkeypatch.setattr(adapters, "unload", lambda op: [AdapterOpReplied(op.op_id, 200, "", 0, adapters.infos())])
    summary = run_stress(
        _args(url, lora_root, "--rounds", "2", "--requests", "24", "--concurrency", "4", "--max-tokens", "2")
    )
    kinds = {u["kind"] for u in summary["unexpected"]}
    assert "load" in kinds or "load_group" in kinds, summary  # the second round's loads hit a "duplicate"
    monkeypatch.undo()
    for name in engine.registry:  # the server is idle: unload what the broken unloads left
        engine.unload_unheard(name)


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000"])
def test_refuses_non_loopback(url: str) -> None:
    with pytest.raises(ValueError, match="non-loopback"):
        check_loopback(url)
    assert main(["--base-url", url]) == 2


def test_loopback_forms_accepted() -> None:
    for url in ("http://127.0.0.1:1", "http://localhost:1", "http://[::1]:1", "http://127.3.2.1"):
        check_loopback(url)


def _o(kind: str, status: int, start: float, end: float, adapter: str | None = "a", **kw) -> Outcome:
    return Outcome(kind, adapter, status, start, end, **kw)


def _unexpected(outcomes: list[Outcome]) -> list[tuple[str, int]]:
    return [(u["kind"], u["status"]) for u in summarize(outcomes)["unexpected"]]


def test_status_rules() -> None:
    admin = [_o("load", 200, 1.0, 2.0, group=1), _o("unload", 200, 5.0, 6.0)]
    assert _unexpected(admin + [_o("adapter", 200, 3.0, 4.0)]) == []
    assert _unexpected(admin + [_o("adapter", 404, 3.0, 4.0)]) == [("adapter", 404)]  # surely loaded
    assert _unexpected(admin + [_o("lora_path", 404, 4.5, 5.5)]) == []  # overlaps the unload
    assert _unexpected(admin + [_o("adapter", 200, 4.5, 5.5)]) == []
    assert _unexpected(admin + [_o("adapter", 200, 6.5, 7.0)]) == [("adapter", 200)]  # surely unloaded
    assert _unexpected(admin + [_o("adapter", 404, 0.1, 0.5)]) == []  # before its first load
    assert _unexpected(admin + [_o("adapter", 404, 1.5, 1.8)]) == []  # during the load
    assert _unexpected(admin + [_o("base", 404, 3.0, 4.0, adapter=None)]) == [("base", 404)]
    assert _unexpected(admin + [_o("adapter", 500, 3.0, 4.0), _o("base", 0, 3.0, 4.0, adapter=None)]) == [
        ("adapter", 500),
        ("base", 0),
    ]


def test_load_race_rules() -> None:
    raced = [_o("load", 200, 1.0, 2.0, group=1, group_size=2), _o("load", 400, 1.0, 2.1, group=1, group_size=2)]
    assert _unexpected(raced) == []
    assert _unexpected([_o("load", 400, 1.0, 2.0, group=1)]) == [("load", 400), ("load_group", 0)]
    both = [_o("load", 200, 1.0, 2.0, group=1, group_size=2), _o("load", 200, 1.0, 2.1, group=1, group_size=2)]
    assert _unexpected(both) == [("load_group", 2)]
    assert _unexpected([_o("reload", 404, 1.0, 2.0), _o("setup_unload", 404, 0.0, 0.1)]) == [("reload", 404)]
