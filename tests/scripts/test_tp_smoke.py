"""scripts/ops/tp_smoke.py against the real server on the CPU: every check passes at tensor parallel 2
on the demo model, and a check whose expectation does not hold is reported failed."""

from __future__ import annotations

import json

import pytest

from scripts.common.server_process import Server
from scripts.ops import tp_smoke

pytestmark = pytest.mark.slow

CHECKS = [
    "models",
    "completion demo-model",
    "completion pirate",
    "completion poet",
    "chat",
    "stream",
    "load adapter",
    "unload adapter",
    "clean exit",
    "replay --verify",
]


def test_every_check_passes_at_tensor_parallel_2(demo_home, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", demo_home)
    out = tmp_path / "tp2.json"
    assert tp_smoke.main(["--tensor-parallel-size", "2", "--device", "cpu", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [c["name"] for c in report["checks"]] == CHECKS
    assert report["ok"] and all(c["ok"] for c in report["checks"]), report["checks"]
    assert report["checks"][-1]["detail"].startswith("OK "), report["checks"][-1]
    assert "--tensor-parallel-size" in report["server_args"]


def test_a_loaded_adapter_that_answers_otherwise_fails_its_check(demo_home, tmp_path, monkeypatch) -> None:
    """The run-time copy of pirate is expected to answer as poet: its check fails, and the unload
    that depends on it is not tried."""
    monkeypatch.setenv("HOME", demo_home)
    target = tp_smoke.demo_target()
    target.same_as = "poet"
    server = Server(None, str(tmp_path / "events"), ["--device", "cpu", *target.args]).start()
    try:
        checks = {c.name: c for c in tp_smoke.run_checks(server, target)}
    finally:
        server.stop()
    assert not checks["load adapter"].ok and "its original" in checks["load adapter"].detail
    assert "unload adapter" not in checks
    assert all(c.ok for name, c in checks.items() if name != "load adapter"), checks
