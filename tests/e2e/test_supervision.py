"""The launcher supervises its group: a dead child takes the group down, named, within
10 s, after the tokenizer failed its in-flight requests and turned /health 503; a dead
launcher takes its children with it within a second, after the tokenizer failed its
in-flight requests the same way; the scheduler's log ends with a LogClosed naming the dead
process; SIGTERM/SIGINT drain in-flight requests (new ones and /health get 503) and leave
nothing behind; a start that fails leaves no run directory."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import psutil
import pytest

from ledgerserve.shared import events
from ledgerserve.shared.eventlog import EventLogReader, newest_log
from tests.e2e.server import Server, assert_all_gone
from tests.netutil import free_port

pytestmark = pytest.mark.slow

MODULE_OF = {
    "scheduler": "ledgerserve.scheduler_proc.main",
    "worker-0": "ledgerserve.worker_proc.main",
    "worker-1": "ledgerserve.worker_proc.main",
    "tokenizer": "ledgerserve.tokenizer_proc.main",
}


def _child(server: Server, name: str):
    """The child process `name` (a worker's rank is the last argument of its command line)."""
    rank = name.partition("-")[2] if name.startswith("worker-") else None
    return next(
        p for p in server.children() if MODULE_OF[name] in p.cmdline() and (rank is None or p.cmdline()[-1] == rank)
    )


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
    proc = subprocess.run(
        [sys.executable, "-m", "ledgerserve", "replay", "--verify", "--json", newest_log(log_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"] == "ok"
    return report


def _last_record(log_dir: str) -> events.Event:
    return list(EventLogReader(newest_log(log_dir)))[-1][1]


@pytest.mark.parametrize(("name", "num_ranks"), [("scheduler", 1), ("worker-0", 1), ("tokenizer", 1), ("worker-1", 2)])
def test_kill9_of_any_child_stops_the_group(name, num_ranks, demo_model_dir, tmp_path):
    """With two ranks, rank 1 is killed mid-stream: rank 0 is left alone in the group, and the
    launcher names the rank that died."""
    flags = ["--max-model-len", "2048", "--tensor-parallel-size", str(num_ranks)]
    server = Server(demo_model_dir, str(tmp_path), flags).start()
    pids = [p.pid for p in server.children()]
    run_dirs = server.run_dirs()
    model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
    lines: list[str] = []
    replies: list[httpx.Response | None] = []
    first = threading.Event()
    threads = [
        threading.Thread(target=_stream_lines, args=(server.base_url, model, lines, first)),
        threading.Thread(target=_post, args=(server.base_url, model, replies)),
    ]
    for t in threads:
        t.start()
    assert first.wait(30)
    time.sleep(0.3)  # the non-streaming request is in flight too
    victim = _child(server, name)
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
    error = json.loads(lines[-2][len("data: ") :])["error"]
    assert error["code"] == 503 and name in error["message"]
    assert httpx.get(server.base_url + "/health", timeout=2).status_code == 503
    threads[1].join(timeout=5)
    assert replies[0] is not None and replies[0].status_code >= 500 and name in replies[0].json()["error"]["message"]


def test_kill9_of_the_launcher_fails_in_flight_requests_and_takes_its_children(demo_model_dir, tmp_path):
    server = Server(demo_model_dir, str(tmp_path), ["--max-model-len", "2048"]).start()
    pids, run_dirs = [p.pid for p in server.children()], server.run_dirs()
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    lines: list[str] = []
    streamed: list[object] = []  # the openai stream's chunks, then what ended it
    plain: list[openai.APIStatusError] = []
    first, first_chunk = threading.Event(), threading.Event()
    threads = [
        threading.Thread(target=_stream_lines, args=(server.base_url, model, lines, first)),
        threading.Thread(target=_openai_stream, args=(client, model, streamed, first_chunk)),
        threading.Thread(target=_openai_plain, args=(client, model, plain)),
    ]
    for t in threads:
        t.start()
    assert first.wait(30) and first_chunk.wait(30)
    time.sleep(0.3)  # the plain request is in flight too
    killed_at = time.monotonic()
    server.proc.send_signal(signal.SIGKILL)
    gone_s = _wait_gone(pids, killed_at, timeout_s=3)  # within a second; the margin is for a loaded machine
    print(f"children gone {gone_s:.2f} s after the launcher's death")
    assert_all_gone([], run_dirs, timeout_s=1)
    server.proc.wait(timeout=5)
    for t in threads:
        t.join(timeout=10)
    assert isinstance(streamed[-1], openai.APIError) and len(streamed) > 1, streamed[-1]
    _assert_dead_launcher_error(streamed[-1].body)
    assert lines[-1] == "data: [DONE]"
    _assert_dead_launcher_error(json.loads(lines[-2][len("data: ") :])["error"])
    assert len(plain) == 1 and plain[0].status_code == 503
    _assert_dead_launcher_error(plain[0].body)
    assert _last_record(str(tmp_path)).dead_process == "launcher"
    assert _replay_ok(str(tmp_path))["closed"]["dead_process"] == "launcher"


def _openai_stream(client: openai.OpenAI, model: str, out: list[object], first: threading.Event) -> None:
    stream = client.completions.create(
        model=model, prompt="The river", max_tokens=1000, stream=True, extra_body={"ignore_eos": True}
    )
    try:
        for chunk in stream:
            out.append(chunk)
            first.set()
    except openai.APIError as e:  # the SSE error event, raised by the client
        out.append(e)


def _openai_plain(client: openai.OpenAI, model: str, out: list[openai.APIStatusError]) -> None:
    try:
        client.completions.create(model=model, prompt="The river", max_tokens=1000, extra_body={"ignore_eos": True})
    except openai.APIStatusError as e:
        out.append(e)


def _wait_gone(pids: list[int], since: float, timeout_s: float) -> float:
    """Seconds from `since` until none of `pids` runs (a zombie has exited)."""
    while time.monotonic() - since < timeout_s:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return time.monotonic() - since
        time.sleep(0.01)
    raise AssertionError(f"children still running {timeout_s} s after the launcher's death")


def _assert_dead_launcher_error(error: object) -> None:
    """The OpenAI error shape, a 503 that names the launcher."""
    assert isinstance(error, dict) and sorted(error) == ["code", "message", "param", "type"], error
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert "launcher" in error["message"] and "died" in error["message"]


def test_a_child_failing_at_start_leaves_no_run_directory(demo_model_dir, tmp_path):
    not_a_dir = tmp_path / "events"
    not_a_dir.write_text("")  # the scheduler cannot create its event log here
    runs = tempfile.mkdtemp(prefix="ls-runs-")  # short: ipc socket paths are limited to ~100 bytes
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "ledgerserve",
                "serve",
                demo_model_dir,
                "--port",
                str(free_port()),
                "--event-log-dir",
                str(not_a_dir),
            ],
            env={**os.environ, "TMPDIR": runs},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 1 and "process 'scheduler'" in proc.stderr, proc.stderr
        assert os.listdir(runs) == []
    finally:
        shutil.rmtree(runs, ignore_errors=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_in_flight_request_then_exits_clean(sig, tmp_path, demo_home):
    # 300 tokens: seconds of decoding, far longer than the draining checks need; the demo serves its
    # adapters, so LoRA is on, and a drain on a busy 2-core CPU can outlast 30 s: a long shutdown timeout
    args = ["--max-model-len", "2048", "--shutdown-timeout", "300"]
    server = Server(None, str(tmp_path), args, env={"HOME": demo_home}).start()  # the demo model, by default
    assert "serving the DEMO model" in server.output()
    pids = [p.pid for p in server.children()]
    run_dirs = server.run_dirs()
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model, prompt="The river", max_tokens=300, stream=True, extra_body={"ignore_eos": True}
    )
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
    r = httpx.post(
        server.base_url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=5
    )
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"


def test_shutdown_timeout_cuts_what_is_left_and_exits_clean(demo_model_dir, tmp_path):
    server = Server(demo_model_dir, str(tmp_path), ["--max-model-len", "2048", "--shutdown-timeout", "1"]).start()
    pids, run_dirs = [p.pid for p in server.children()], server.run_dirs()
    model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
    streams = [([], threading.Event()) for _ in range(4)]  # 4 x 2000 tokens: far more than 1 s of work
    readers = [
        threading.Thread(target=_stream_lines, args=(server.base_url, model, lines, first, 2000))
        for lines, first in streams
    ]
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
