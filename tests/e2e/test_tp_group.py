"""The tensor-parallel group in the real process group (two ranks on the CPU, gloo): its
transport listens on loopback only, its rendezvous file lives in the private run directory and
goes with it, its log records the shard layout and replays; a rank that stalls inside a step
(alive, stuck) fails the waiting rank's collective after --tp-collective-timeout, and the
engine stops, naming the step, leaving nothing behind."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

import httpx
import psutil
import pytest

from ledgerserve.shared import events
from ledgerserve.shared.eventlog import EventLogReader, newest_log
from ledgerserve.worker_proc.parallel import RENDEZVOUS_FILE, cpu_threads_of_rank
from tests.e2e.server import Server, assert_all_gone

pytestmark = pytest.mark.slow

TP2 = ["--tensor-parallel-size", "2", "--max-model-len", "256"]
WORKER = "ledgerserve.worker_proc.main"


def _body(model_dir: str, max_tokens: int) -> dict:
    return {"model": os.path.basename(model_dir), "prompt": "The river", "max_tokens": max_tokens, "ignore_eos": True}


def _inet_sockets(pid: int) -> list[tuple[str, str]]:
    """(local ip, status) of every TCP and UDP socket of the process."""
    return [(c.laddr.ip, c.status) for c in psutil.Process(pid).net_connections(kind="inet") if c.laddr]


def test_two_ranks_stay_on_loopback_and_their_log_replays(demo_model_dir, tmp_path):
    server = Server(demo_model_dir, str(tmp_path), TP2).start()
    pids, run_dirs = [p.pid for p in server.children()], server.run_dirs()
    resp = httpx.post(server.base_url + "/v1/completions", json=_body(demo_model_dir, 8), timeout=60)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8
    workers = [p for p in server.children() if WORKER in p.cmdline()]
    assert len(workers) == 2
    sockets = [s for w in workers for s in _inet_sockets(w.pid)]
    assert any(status == psutil.CONN_LISTEN for _, status in sockets), sockets  # gloo's listener is seen
    assert all(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip, _ in sockets), sockets
    assert [d for d in run_dirs if os.path.exists(os.path.join(d, RENDEZVOUS_FILE))] == run_dirs
    assert server.stop() == 0
    if not os.environ.get("OMP_NUM_THREADS"):  # each rank takes its share of the cores, not all of them
        share = f"{cpu_threads_of_rank(len(os.sched_getaffinity(0)), 2)} CPU threads for this rank's ops (of 2 ranks)"
        assert server.output().count(share) == 2, server.output()[-3000:]
    assert_all_gone(pids, run_dirs)
    verify = [sys.executable, "-m", "ledgerserve", "replay", "--verify", "--json", newest_log(str(tmp_path))]
    proc = subprocess.run(verify, capture_output=True, text=True, timeout=60)
    report = json.loads(proc.stdout)
    assert proc.returncode == 0 and report["status"] == "ok", proc.stdout + proc.stderr
    assert report["tensor_parallel_size"] == 2 and report["tp_layout"].startswith("tp=2 megatron")
    assert "kv heads 2 -> 1/rank (split)" in report["tp_layout"]  # the demo model: 2 KV heads


def test_a_stalled_rank_times_out_the_collective_and_stops_the_engine(demo_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LEDGERSERVE_TEST_FAULT_TP_STALL_RANK", "1")
    monkeypatch.setenv("LEDGERSERVE_TEST_FAULT_TP_STALL_STEP", "3")
    server = Server(demo_model_dir, str(tmp_path), [*TP2, "--tp-collective-timeout", "3"]).start()
    pids, run_dirs = [p.pid for p in server.children()], server.run_dirs()
    try:
        resp = httpx.post(server.base_url + "/v1/completions", json=_body(demo_model_dir, 32), timeout=60)
        assert resp.status_code >= 500 and "collective" in resp.json()["error"]["message"]
    except httpx.HTTPError:
        pass  # the group may be gone before the response is written
    assert server.proc.wait(timeout=60) != 0
    out = server.output()
    want = "worker rank 0 failed: step 3 failed: tensor-parallel collective all_reduce timed out after 3 s"
    assert want in out and "stalling before step 3" in out, out[-3000:]
    assert_all_gone(pids, run_dirs)
    last = list(EventLogReader(newest_log(str(tmp_path))))[-1][1]
    assert isinstance(last, events.LogClosed) and want in last.reason
