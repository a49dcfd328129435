"""Faults inside one request or one adapter fail only that request or adapter, through
the real process group: a test-only worker fault, client disconnects, adapter files
broken after registration, bad loads under load, and the load test itself."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import scripts.serving.load_test
from scripts.serving.load_test import leaks
from scripts.serving.load_test import main as load_test_main
from tests.adapter_factory import make_peft_adapter
from tests.e2e.server import Server, assert_all_gone

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FAULT_TOKEN_ID = 777
GOOD_PROMPTS = [[11, 12, 13, 14, 15], [200, 201, 202], [42, 43, 44, 45, 46, 47, 48], [300, 9, 301, 9]]
ADAPTER = dict(r=4, alpha=8, targets=["q_proj", "v_proj"])


@pytest.fixture(scope="module")
def adapter_root(demo_model_dir, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("fault-adapters")
    for seed, name in enumerate(["good-a", "good-b", "spare"]):
        make_peft_adapter(demo_model_dir, str(root / name), seed=seed + 1, **ADAPTER)
    return str(root)


@pytest.fixture(scope="module")
def server(demo_model_dir, adapter_root, tmp_path_factory):
    args = [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-allowed-dir",
        adapter_root,
        "--max-model-len",
        "512",
        "--num-kv-blocks",
        "128",
        "--max-num-seqs",
        "16",
    ]
    srv = Server(
        demo_model_dir,
        str(tmp_path_factory.mktemp("fault-events")),
        args,
        env={"LEDGERSERVE_TEST_FAULT_TOKEN_ID": str(FAULT_TOKEN_ID)},
    ).start()
    pids, run_dirs = [p.pid for p in srv.children()], srv.run_dirs()
    yield srv
    assert srv.stop() == 0
    assert_all_gone(pids, run_dirs)


@pytest.fixture(scope="module")
def model(server) -> str:
    return httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]


def _complete(server: Server, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)


def _greedy(model: str, prompt: list[int]) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def _load(server: Server, name: str, path: str) -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=30
    )


def _unload(server: Server, name: str) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30)


def _tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def test_a_request_fault_fails_only_that_request(server, model):
    expected = [_tokens(_complete(server, _greedy(model, p))) for p in GOOD_PROMPTS]
    faulty = [5, 6, FAULT_TOKEN_ID, 8]
    with ThreadPoolExecutor(len(GOOD_PROMPTS) + 1) as pool:
        bad = pool.submit(_complete, server, _greedy(model, faulty))
        good = [pool.submit(_complete, server, _greedy(model, p)) for p in GOOD_PROMPTS]
        assert [_tokens(f.result()) for f in good] == expected
        r = bad.result()
    assert r.status_code == 500
    error = r.json()["error"]
    assert error["type"] == "InternalServerError" and "test fault" in error["message"]
    assert not leaks(server.wait_idle())


def test_client_disconnect_frees_blocks_and_pins(server, adapter_root):
    assert _load(server, "live", os.path.join(adapter_root, "good-a")).status_code == 200
    body = {"model": "live", "prompt": "The river", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
        assert server.metrics()["ledgerserve_lora_pinned_slots"] == 1
    m = server.wait_idle(timeout_s=5)
    assert m["ledgerserve_lora_pinned_slots"] == 0
    assert m["ledgerserve_kv_blocks_free"] + m["ledgerserve_kv_blocks_cached"] == m["ledgerserve_kv_blocks_total"]
    assert _unload(server, "live").status_code == 200


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_adapter_broken_after_registration_fails_only_its_requests(damage, server, model, adapter_root):
    """Files broken right after registration. The workers stage a version into the CPU tier
    at registration, so the request meets one of three outcomes, each correct: the staging
    already failed (the version is unloaded: 404), the load fails under the request (500
    naming the adapter), or the staging won the race (the registered content is served). The
    base request is unaffected either way, nothing leaks, and the name never serves again
    once a read of the broken files failed."""
    name = f"frail-{damage}"
    path = os.path.join(adapter_root, name)  # inside the allowed dir
    shutil.copytree(os.path.join(adapter_root, "spare"), path)
    assert _load(server, name, path).status_code == 200
    weights = os.path.join(path, "adapter_model.safetensors")
    if damage == "delete":
        os.remove(weights)
    else:
        os.truncate(weights, os.path.getsize(weights) // 2)
    with ThreadPoolExecutor(2) as pool:
        base = pool.submit(_complete, server, _greedy(model, GOOD_PROMPTS[0]))
        r = _complete(server, {"model": name, "prompt": "hello", "max_tokens": 4})
        assert base.result().status_code == 200
    assert r.status_code in (200, 404, 500), r.text
    if r.status_code == 500:
        assert r.json()["error"]["type"] == "InternalServerError" and name in r.json()["error"]["message"]
    m = server.wait_idle()
    assert m["ledgerserve_lora_pinned_slots"] == 0 and not leaks(m)
    if r.status_code != 200:
        assert _complete(server, {"model": name, "prompt": "hello", "max_tokens": 4}).status_code == 404
    else:
        assert _unload(server, name).status_code == 200
    assert _load(server, "after", os.path.join(adapter_root, "spare")).status_code == 200  # the slot is free again
    assert _tokens(_complete(server, {**_greedy("after", GOOD_PROMPTS[1])}))
    assert _unload(server, "after").status_code == 200


def _broken_adapters(root: str, tmp_path) -> list[dict]:
    """Bodies of loads that must all be refused: bad paths, broken adapters, a duplicate."""
    garbage = tmp_path / "garbage"
    shutil.copytree(os.path.join(root, "spare"), garbage)
    (garbage / "adapter_config.json").write_text("{not json")
    torn = tmp_path / "torn"
    shutil.copytree(os.path.join(root, "spare"), torn)
    os.truncate(torn / "adapter_model.safetensors", 4)
    empty = tmp_path / "empty"
    empty.mkdir()
    return [
        {"lora_name": "bad-missing", "lora_path": os.path.join(root, "absent")},
        {"lora_name": "bad-outside", "lora_path": str(garbage)},  # outside the allowed dir
        {"lora_name": "bad-escape", "lora_path": os.path.join(root, "..", "..")},
        {"lora_name": "owned", "lora_path": os.path.join(root, "spare")},
    ]  # duplicate name


def _bad_loads(server: Server, bodies: list[dict], num: int, statuses: list[int], stop: threading.Event) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for i in range(num):
            statuses.append(client.post("/v1/load_lora_adapter", json=bodies[i % len(bodies)]).status_code)
            stop.wait(0.2)


def test_load_test_with_bad_loads_has_no_errors(server, adapter_root, tmp_path):
    assert _load(server, "owned", os.path.join(adapter_root, "spare")).status_code == 200
    statuses: list[int] = []
    stop = threading.Event()
    loader = threading.Thread(
        target=_bad_loads, args=(server, _broken_adapters(adapter_root, tmp_path), 32, statuses, stop)
    )
    loader.start()
    adapters = [f"{n}={os.path.join(adapter_root, n)}" for n in ("good-a", "good-b")]
    report = load_test_main(
        [
            "--base-url",
            server.base_url,
            "--duration-s",
            "12",
            "--concurrency",
            "4",
            "--max-tokens",
            "6",
            "--adapters",
            *adapters,
        ]
    )
    loader.join(timeout=60)
    assert len(statuses) == 32 and all(400 <= s < 500 for s in statuses), statuses
    assert report["errors"] == 0, report["unexpected"]
    assert report["ok"] and report["num_requests"] > 50 and report["num_aborted"] > 0, report
    assert report["counts"].get("load", {}).get("200", 0) > 0
    assert _unload(server, "owned").status_code == 200


def _documented_load_test() -> list[str]:
    """The command in scripts/serving/load_test.py's docstring, as a shell would split it."""
    usage = scripts.serving.load_test.__doc__.split("\n\n")[1]
    return shlex.split(usage.replace("\\\n", " "))


def test_load_test_runs_as_its_docstring_says(server, adapter_root):
    argv = _documented_load_test()
    values = {
        "--base-url": [server.base_url],
        "--duration-s": ["3"],
        "--concurrency": ["2"],
        "--adapters": [f"{n}={os.path.join(adapter_root, n)}" for n in ("good-a", "good-b")],
    }
    flags = [a for a in argv if a.startswith("--")]
    assert argv[0] == "python" and sorted(flags) == sorted(values), argv  # the documented flags, this server's values
    argv = [sys.executable, *argv[1 : argv.index(flags[0])], *(x for f in flags for x in [f, *values[f]])]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # a shell in the repository root
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["ok"] and report["num_requests"] > 0 and report["counts"]["load"]["200"] > 0, report
