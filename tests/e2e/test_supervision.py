"""The launcher supervises its group: a dead child takes the group down, named, within
10 s; SIGTERM/SIGINT drain in-flight requests and leave nothing behind."""

from __future__ import annotations

import signal
import threading
import time

import openai
import pytest

from shared import events
from shared.eventlog import EventLogReader, newest_log
from tests.e2e.server import Server, assert_all_gone

pytestmark = pytest.mark.slow

MODULE_OF = {"scheduler": "scheduler_proc.main", "worker-0": "worker_proc.main", "tokenizer": "tokenizer_proc.main"}


def _child(server: Server, module: str):
    return next(p for p in server.children() if module in p.cmdline())


@pytest.mark.parametrize("name", ["scheduler", "worker-0", "tokenizer"])
def test_kill9_of_any_child_stops_the_group(name, demo_model_dir, tmp_path):
    server = Server(demo_model_dir, str(tmp_path)).start()
    pids = [p.pid for p in server.children()]
    run_dirs = server.run_dirs()
    victim = _child(server, MODULE_OF[name])
    killed_at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    rc = server.proc.wait(timeout=10)
    assert time.monotonic() - killed_at < 10
    assert rc != 0
    assert f"process '{name}'" in server.output()
    assert_all_gone(pids, run_dirs)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_drains_in_flight_request_then_exits_clean(sig, tmp_path):
    server = Server(None, str(tmp_path), ["--max-model-len", "512"]).start()  # the demo model, by default
    assert "RANDOM" in server.output()
    pids = [p.pid for p in server.children()]
    run_dirs = server.run_dirs()
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt="The river", max_tokens=64, stream=True,
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    threading.Timer(0.05, server.proc.send_signal, args=(sig,)).start()
    chunks = [first, *stream]
    assert sum(len(c.choices[0].text) > 0 or c.choices[0].finish_reason is not None for c in chunks) > 1
    assert chunks[-1].choices[0].finish_reason == "length"
    assert server.proc.wait(timeout=60) == 0
    assert_all_gone(pids, run_dirs)
    records = list(EventLogReader(newest_log(str(tmp_path))))
    assert isinstance(records[-1][1], events.LogClosed)
