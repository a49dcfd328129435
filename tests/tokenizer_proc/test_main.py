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

import httpx
import msgspec
import pytest
import uvicorn
import zmq

from ledgerserve.shared import codec, ipc
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import RequestArrived, TokensEmitted
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.tokenizer_proc.engine_client import EngineDeadError
from ledgerserve.tokenizer_proc.main import Server
from tests.netutil import free_port
from tests.tokenizer_proc.fake_engine import FakeEngine

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
    config = EngineConfig(
        model_dir=demo_model_dir,
        served_model_name="demo",
        max_model_len=128,
        port=port,
        run_dir=run_dir,
        shutdown_timeout_s=5,
    )
    config_path = Path(run_dir) / "config.json"
    config_path.write_bytes(config.to_json())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ledgerserve.tokenizer_proc.main", "--config", str(config_path)], env=env
    )
    try:
        ready = msgspec.msgpack.decode(_recv(control, 60))
        assert ready == {"process": "tokenizer", "pid": proc.pid}
        result: dict = {}
        payload = {"model": "demo", "prompt": [4, 5], "max_tokens": 2}
        worker = threading.Thread(
            target=lambda: result.update(
                r=httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=payload, timeout=30)
            )
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


def test_launcher_death_fails_in_flight_requests_then_exits() -> None:
    async def scenario() -> None:
        engine = FakeEngine()
        engine.hold = asyncio.Event()  # the request stays in flight
        server = Server(uvicorn.Config(app=None), engine, run_dir="", drain_timeout_s=30)
        stream = engine.generate(RequestArrived("r", [1, 2], SamplingParams(max_tokens=4)))
        pending = asyncio.ensure_future(stream.__anext__())
        responding = asyncio.Event()  # an HTTP handler still writing its error response
        handler = asyncio.ensure_future(responding.wait())
        server.server_state.tasks.add(handler)
        await asyncio.sleep(0.01)
        assert engine.num_in_flight == 1
        server.on_launcher_gone("the launcher (pid 1) died")
        with pytest.raises(EngineDeadError, match=r"the launcher \(pid 1\) died") as info:
            await pending
        assert info.value.status_code == 503 and not engine.is_healthy and engine.num_in_flight == 0
        await asyncio.sleep(0.1)  # FLUSH_S is 0.4
        assert not server.should_exit  # the handler has not sent its response yet
        responding.set()
        await handler
        server.server_state.tasks.discard(handler)
        await asyncio.wait_for(_until(lambda: server.should_exit), 1)
        assert server.launcher_gone

    asyncio.run(scenario())


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)
