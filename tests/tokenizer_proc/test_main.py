"""`python -m tokenizer_proc.main` as a real process, with the test playing launcher and scheduler."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import msgspec
import zmq

from shared import codec, ipc
from shared.config import EngineConfig
from tests.netutil import free_port
from shared.events import RequestArrived, TokensEmitted
from tokenizer_proc.main import watch_parent

ROOT = Path(__file__).resolve().parents[2]


def _recv(sock: zmq.Socket, timeout_s: float) -> bytes:
    if not sock.poll(int(timeout_s * 1000)):
        raise TimeoutError("nothing received")
    return sock.recv()


def test_process_handshake_serves_and_drains_on_sigterm(demo_model_dir: str) -> None:
    run_dir = ipc.make_run_dir()
    ctx = zmq.Context.instance()
    control = ipc.bind(ctx, zmq.PULL, run_dir, ipc.CONTROL)
    sched_in = ipc.bind(ctx, zmq.PULL, run_dir, ipc.SCHED_IN)
    to_tok = ipc.bind(ctx, zmq.PUSH, run_dir, ipc.TO_TOKENIZER)
    port = free_port()
    config = EngineConfig(model_dir=demo_model_dir, served_model_name="demo", max_model_len=128,
                          port=port, run_dir=run_dir, shutdown_timeout_s=5)
    config_path = Path(run_dir) / "config.json"
    config_path.write_bytes(config.to_json())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "tokenizer_proc.main", "--config", str(config_path)], env=env)
    try:
        ready = msgspec.msgpack.decode(_recv(control, 60))
        assert ready == {"process": "tokenizer", "pid": proc.pid}
        result: dict = {}
        payload = {"model": "demo", "prompt": [4, 5], "max_tokens": 2}
        worker = threading.Thread(
            target=lambda: result.update(r=httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=payload, timeout=30))
        )
        worker.start()
        arrived = codec.to_scheduler_decoder().decode(_recv(sched_in, 30))
        assert isinstance(arrived, RequestArrived) and arrived.prompt_token_ids == [4, 5]
        proc.send_signal(signal.SIGTERM)  # graceful: the in-flight request still completes
        threading.Event().wait(0.5)
        to_tok.send(codec.encode(TokensEmitted(arrived.req_id, [6, 7], "length", num_prompt_tokens=2)))
        worker.join(30)
        assert result["r"].status_code == 200
        assert result["r"].json()["usage"]["completion_tokens"] == 2
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for sock in (control, sched_in, to_tok):
            sock.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_watch_parent_stops_server_when_reparented() -> None:
    server = SimpleNamespace(should_exit=False, force_exit=False)
    asyncio.run(asyncio.wait_for(watch_parent(server, parent_pid=-1), 5))  # type: ignore[arg-type]
    assert server.should_exit and server.force_exit
