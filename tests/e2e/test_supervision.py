"""The launcher supervises its group: a dead child takes the group down, named, within
10 s, after the tokenizer failed its in-flight requests and turned /health 503, and the
scheduler's log ends with a LogClosed naming it; a dead launcher takes its children with
it; SIGTERM/SIGINT drain in-flight requests (new ones and /health get 503) and leave
nothing behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import psutil
import pytest

from shared import events
from shared.eventlog import EventLogReader, newest_log
from tests.e2e.server import Server, assert_all_gone

pytestmark = pytest.mark.slow

MODULE_OF = {"scheduler": "scheduler_proc.main", "worker-0": "worker_proc.main", "tokenizer": "tokenizer_proc.main"}


def _child(server: Server, module: str):
    return next(p for p in server.children() if module in p.cmdline())


LONG = {"prompt": "The river", "max_tokens": 1000, "ignore_eos": True, "temperature": 0.0}


def _stream_lines(base_url: str, model: str, lines: list[str], first: threading.Event, max_tokens: int = 1000) -> None:
    body = {**LONG, "model": model, "stream": True, "max_tokens": max_tokens}
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    first.set()
    except httpx.HTTPError as e:  # the tokenizer itself was killed
        lines.append(f"cut: {e}")


def _post(base_url: str, model: str, out: list[httpx.Response | None]) -> None:
    try:
        out.append(httpx.post(base_url + "/v1/completions", json={**LONG, "model": model}, timeout=30))
    except httpx.HTTPError:
        out.append(None)


def _replay_ok(log_dir: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "shared.cli", "replay", "--verify", "--json", newest_log(log_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"] == "ok"
    return report


def _last_record(log_dir: str) -> events.Event:
    return list(EventLogReader(newest_log(log_dir)))[-1][1]


@pytest.mark.parametrize("name", ["scheduler", "worker-0", "tokenizer"])
def test_kill9_of_any_child_stops_the_group(name, demo_model_dir, tmp_path):
    server = Server(demo_model_dir, str(tmp_path), ["--max-model-len", "2048"]).start()
    pids = [p.pid for p in server.children()]
    run_dirs = server.run_dirs()
    model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
    lines: list[str] = []
    replies: list[httpx.Response | None] = []
    first = threading.Event()
    threads = [threading.Thread(target=_stream_lines, args=(server.base_url, model, lines, first)),
               threading.Thread(target=_post, args=(server.base_url, model, replies))]
    for t in threads:
        t.start()
    assert first.wait(30)
    time.sleep(0.3)  # the non-streaming request is in flight too
    victim = _child(server, MODULE_OF[name])
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    if name != "tokenizer":
        _check_in_flight_failed(server, threads, lines, replies, name)
    rc = server.proc.wait(timeout=10)
    assert time.monotonic() - killed_at < 10
    assert rc != 0
    assert f"process '{name}'" in server.output()
    assert_all_gone(pids, run_dirs)
    for t in threads:
        t.join(timeout=10)
    closed = _replay_ok(str(tmp_path))["closed"]
    if name == "scheduler":  # killed with its log open: the log ends where it was
        assert closed is None and not isinstance(_last_record(str(tmp_path)), events.LogClosed)
    else:
        reason = f"engine process {name!r} died (exit code -9)"
        assert _last_record(str(tmp_path)) == events.LogClosed(reason, name, -9)
        assert closed == {"reason": reason, "dead_process": name, "exit_code": -9}


def _check_in_flight_failed(server, threads, lines, replies, name) -> None:
    """The stream ends with an error chunk then [DONE]; the plain request gets a 5xx
    JSON error; /health is 503 while the tokenizer flushes."""
    threads[0].join(timeout=5)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["code"] == 503 and name in error["message"]
    assert httpx.get(server.base_url + "/health", timeout=2).status_code == 503
    threads[1].join(timeout=5)
    assert replies[0] is not None and replies[0].status_code >= 500 and name in replies[0].json()["error"]["message"]


def test_kill9_of_the_launcher_takes_its_children(demo_model_dir, tmp_path):
    server = Server(demo_model_dir, str(tmp_path)).start()
    children, run_dirs = server.children(), server.run_dirs()
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait(timeout=5)
    gone, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, [p.cmdline() for p in alive]
    assert_all_gone([], run_dirs, timeout_s=1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_in_flight_request_then_exits_clean(sig, tmp_path):
    server = Server(None, str(tmp_path), ["--max-model-len", "2048"]).start()  # the demo model, by default
    assert "RANDOM" in server.output()
    pids = [p.pid for p in server.children()]
    run_dirs = server.run_dirs()
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt="The river", max_tokens=1000, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    server.proc.send_signal(sig)
    _check_draining(server, model)
    chunks = [first, *stream]
    assert sum(len(c.choices[0].text) > 0 or c.choices[0].finish_reason is not None for c in chunks) > 1
    assert chunks[-1].choices[0].finish_reason == "length"
    assert server.proc.wait(timeout=60) == 0
    assert_all_gone(pids, run_dirs)
    records = list(EventLogReader(newest_log(str(tmp_path))))
    assert isinstance(records[-1][1], events.LogClosed)


def _check_draining(server: Server, model: str) -> None:
    """While the in-flight request drains, /health and new requests get 503."""
    deadline = time.monotonic() + 5
    while httpx.get(server.base_url + "/health", timeout=2).status_code != 503:
        assert time.monotonic() < deadline, "/health never turned 503 while draining"
        time.sleep(0.02)
    r = httpx.post(server.base_url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2},
                   timeout=5)
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


def test_shutdown_timeout_cuts_what_is_left_and_exits_clean(demo_model_dir, tmp_path):
    server = Server(demo_model_dir, str(tmp_path), ["--max-model-len", "2048", "--shutdown-timeout", "1"]).start()
    pids, run_dirs = [p.pid for p in server.children()], server.run_dirs()
    model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
    streams = [([], threading.Event()) for _ in range(4)]  # 4 x 2000 tokens: far more than 1 s of work
    readers = [threading.Thread(target=_stream_lines, args=(server.base_url, model, lines, first, 2000))
               for lines, first in streams]
    for reader in readers:
        reader.start()
    assert all(first.wait(30) for _, first in streams)
    signalled_at = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=15) == 0
    assert time.monotonic() - signalled_at < 8  # 1 s of drain, then the group stops
    for reader in readers:
        reader.join(timeout=10)
    for lines, _ in streams:  # cut: never a complete-looking stream
        assert lines[-1] != "data: [DONE]" or '"error"' in lines[-2], lines[-2:]
    assert_all_gone(pids, run_dirs)
    records = list(EventLogReader(newest_log(str(tmp_path))))
    assert isinstance(records[-1][1], events.LogClosed)
