"""The real server's HTTP process against raw sockets: it lifts its open-file limit at start,
an idle flood past that limit does not lock /health or requests out, a silent (or
byte-at-a-time) connection is closed at the header timeout, a foreign Host header is refused,
and the `openai` client (Host 127.0.0.1:PORT) is served."""

from __future__ import annotations

import os
import resource
import socket
import threading
import time

import httpx
import openai
import psutil
import pytest

from ledgerserve.tokenizer_proc.connections import FD_RESERVE, HEADER_TIMEOUT_S
from tests.e2e.server import Server

pytestmark = pytest.mark.slow
LOWERED_FD_LIMIT = 256  # the HTTP process's soft limit in the flood test: at most 128 connections
NUM_IDLE = 400


@pytest.fixture(scope="module")
def server(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """Started with a soft open-file limit of 1024 (a login shell's) under a higher hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        srv = Server(demo_model_dir, str(tmp_path_factory.mktemp("conn-events")), ["--max-model-len", "256"]).start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield srv
    finally:
        assert srv.stop() == 0


def _http_process(server: Server) -> psutil.Process:
    (proc,) = [c for c in server.children() if "ledgerserve.tokenizer_proc.main" in c.cmdline()]
    return proc


def _connect(server: Server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5.0)


def test_the_open_file_limit_is_lifted_at_start(server: Server) -> None:
    soft, hard = _http_process(server).rlimit(psutil.RLIMIT_NOFILE)
    assert soft == hard


def test_an_idle_flood_past_the_fd_limit_locks_nobody_out(server: Server) -> None:
    proc = _http_process(server)
    _, hard = proc.rlimit(psutil.RLIMIT_NOFILE)
    proc.rlimit(psutil.RLIMIT_NOFILE, (LOWERED_FD_LIMIT, hard))
    assert proc.num_fds() < FD_RESERVE
    soft, own_hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(own_hard, 4 * NUM_IDLE)), own_hard))
    idle: list[socket.socket] = []
    try:
        for _ in range(NUM_IDLE):
            idle.append(_connect(server))
        time.sleep(0.5)
        assert proc.num_fds() < LOWERED_FD_LIMIT
        for _ in range(5):
            assert httpx.get(server.base_url + "/health", timeout=5.0).status_code == 200
        body = {"model": os.path.basename(server.model_dir), "prompt": "The river", "max_tokens": 2}
        assert httpx.post(server.base_url + "/v1/completions", json=body, timeout=30.0).status_code == 200
    finally:
        for sock in idle:
            sock.close()
        proc.rlimit(psutil.RLIMIT_NOFILE, (hard, hard))


def _closed_after(sock: socket.socket, trickle: bytes, found: dict[str, float], name: str) -> None:
    """Send `trickle` a byte a second (none if empty) until the server closes the connection."""
    started = time.monotonic()
    sock.settimeout(1.0)
    for i in range(int(HEADER_TIMEOUT_S) + 10):
        if i < len(trickle):
            try:
                sock.sendall(trickle[i : i + 1])
            except OSError:
                break
        try:
            if sock.recv(4096) == b"":
                break
        except TimeoutError:
            continue
        except OSError:
            break
    found[name] = time.monotonic() - started


def test_silent_and_trickling_connections_are_closed(server: Server) -> None:
    found: dict[str, float] = {}
    trickle = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 40
    threads = [
        threading.Thread(target=_closed_after, args=(_connect(server), b"", found, "silent")),
        threading.Thread(target=_closed_after, args=(_connect(server), trickle, found, "trickling")),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(HEADER_TIMEOUT_S - 1 < seconds < HEADER_TIMEOUT_S + 3 for seconds in found.values()), found


def test_a_foreign_host_is_refused_and_the_openai_client_served(server: Server) -> None:
    r = httpx.get(server.base_url + "/v1/models", headers={"Host": f"rebound.example:{server.port}"}, timeout=10)
    assert r.status_code == 400 and "is not allowed" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    out = client.completions.create(model=os.path.basename(server.model_dir), prompt="The river", max_tokens=2)
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(openai.APIStatusError) as refused:
        client.responses.create(model=os.path.basename(server.model_dir), input="hi")
    assert refused.value.status_code == 501
