"""Tensor-parallel consistency: with two ranks, a (test-only) fault makes rank 1 report a
wrong digest; the scheduler logs DigestMismatch and the engine stops, naming step and ranks."""

from __future__ import annotations

import os

import httpx
import pytest

from ledgerserve.scheduler_proc.replay import replay
from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import EventLogReader, newest_log
from tests.e2e.server import Server, assert_all_gone

pytestmark = pytest.mark.slow


def test_rank_disagreement_stops_the_engine(demo_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("LEDGERSERVE_TEST_FAULT_DIGEST_RANK", "1")
    monkeypatch.setenv("LEDGERSERVE_TEST_FAULT_DIGEST_STEP", "3")
    server = Server(demo_model_dir, str(tmp_path), ["--tensor-parallel-size", "2", "--max-model-len", "256"]).start()
    pids = [p.pid for p in server.children()]
    run_dirs = server.run_dirs()
    body = {"model": os.path.basename(demo_model_dir), "prompt": "The river", "max_tokens": 32, "ignore_eos": True}
    try:
        resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code >= 500
    except httpx.HTTPError:
        pass  # the group may be gone before the response is written
    assert server.proc.wait(timeout=15) != 0
    assert "ranks disagree after step 3" in server.output()
    assert_all_gone(pids, run_dirs)
    records = [event for _, event in EventLogReader(newest_log(str(tmp_path)), repair=False)]
    mismatch = [e for e in records if isinstance(e, ev.DigestMismatch)]
    assert len(mismatch) == 1 and mismatch[0].step == 3 and mismatch[0].odd_ranks == [1]
    assert replay(newest_log(str(tmp_path))).ok
