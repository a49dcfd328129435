"""Two real servers (the demo model and its adapters) given the same scripted traffic, one request
at a time, log the same decisions: `ledgerserve replay --diff` finds no difference (exit 0) and no
engine-config field but per-run ones differs. A third run whose traffic differs in one prompt
diffs (exit 1), at that request. The traffic: completions on the base model and an adapter, a
chat completion with n = 2, a stream, a client's X-Request-Id, an adapter loaded on demand by
`lora_path`, and an adapter loaded and unloaded through the API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ledgerserve.shared.eventlog import newest_log
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}


def _traffic(adapters: Path, base: str, changed_prompt: str) -> list[tuple[str, dict, dict]]:
    chat = {"model": base, "messages": [{"role": "user", "content": "Tell me of the sea"}], "n": 2}
    return [
        ("/v1/completions", {"model": base, "prompt": "The river ran", **GREEDY}, {}),
        ("/v1/completions", {"model": "pirate", "prompt": "The river ran", **GREEDY}, {}),
        ("/v1/chat/completions", {**chat, **GREEDY}, {}),
        ("/v1/completions", {"model": base, "prompt": changed_prompt, **GREEDY}, {"X-Request-Id": "client-7"}),
        ("/v1/completions", {"model": base, "prompt": "The sea", "lora_path": str(adapters / "poet"), **GREEDY}, {}),
        ("/v1/load_lora_adapter", {"lora_name": "verse", "lora_path": str(adapters / "poet")}, {}),
        ("/v1/completions", {"model": "verse", "prompt": "The hill", "stream": True, **GREEDY}, {}),
        ("/v1/unload_lora_adapter", {"lora_name": "verse"}, {}),
        ("/v1/completions", {"model": base, "prompt": "The end", **GREEDY}, {}),
    ]


def _run(demo_home: str, demo_model_dir: str, log_dir: str, changed_prompt: str = "A small boat") -> str:
    """Serve the demo, send the traffic in order (each request after the one before ended), stop:
    the run's log."""
    adapters = Path(demo_model_dir) / "adapters"
    args = ["--max-model-len", "256", "--lora-allowed-dir", str(adapters)]
    server = Server(None, log_dir, args, env={"HOME": demo_home}).start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            base = client.get("/v1/models").json()["data"][0]["id"]
            for path, body, headers in _traffic(adapters, base, changed_prompt):
                r = client.post(path, json=body, headers=headers)
                assert r.status_code == 200, (path, r.text)
                if "X-Request-Id" in headers:
                    assert r.headers["x-request-id"] == "cmpl-client-7" == r.json()["id"]
    finally:
        assert server.stop() == 0
    return newest_log(log_dir)


@pytest.fixture(scope="module")
def logs(demo_home: str, demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    runs = {"a": {}, "b": {}, "changed": {"changed_prompt": "A large ship"}}
    return {
        name: _run(demo_home, demo_model_dir, str(tmp_path_factory.mktemp(f"diff-{name}")), **kw)
        for name, kw in runs.items()
    }


def _diff(this: str, other: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ledgerserve", "replay", this, "--diff", other, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONHASHSEED": "7"},
    )


def test_two_runs_of_the_same_traffic_diff_clean(logs):
    done = _diff(logs["a"], logs["b"])
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["status"] == "same" and report["first_decision"] is None
    # (the inputs may interleave otherwise: the workers' reports come when they come)
    assert report["config_differences"] == []  # only per-run fields (port, run and log dirs) differ
    for log in (logs["a"], logs["b"]):
        verified = subprocess.run(
            [sys.executable, "-m", "ledgerserve", "replay", log, "--verify"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_run_with_another_prompt_differs_at_that_request(logs):
    done = _diff(logs["a"], logs["changed"])
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    first_input = report["first_input"]
    assert first_input["this"]["type"] == first_input["other"]["type"] == "RequestArrived"
    assert first_input["this"]["event"][1] == first_input["other"]["event"][1] == "cmpl-client-7"  # its req_id
    assert "prompt_token_ids" in first_input["differing_fields"]
    assert report["first_decision"]["this"]["type"] is not None
