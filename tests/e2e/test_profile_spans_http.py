"""The serving-path profile's spans (`--profile-dir`), from a real process group on the CPU: they
join with the event log record for record, every hop between processes runs forward in time, a
step's hops add up to its cycle, and that cycle is the gap the client sees between tokens."""

from __future__ import annotations

import os
import signal
import statistics
import time

import httpx
import pytest

from ledgerserve.shared import events, spans
from ledgerserve.shared.eventlog import EventLogReader, newest_log
from scripts.serving import profile_report
from tests.e2e.server import Server

pytestmark = pytest.mark.slow
SLACK_MS = 0.05  # clock reads of one clock in different processes: a hop may come out this far below 0


def assert_parts_add_up(row: dict[str, float], parts: tuple[str, ...], total: str) -> None:
    """Each part runs forward in time (within SLACK_MS) and together they make `total` (1 %)."""
    values = [row[p] for p in parts]
    assert min(values) >= -SLACK_MS, row
    assert sum(values) == pytest.approx(row[total], rel=0.01, abs=SLACK_MS), row


def stream_gaps(base_url: str, prompt: list[int], num_tokens: int) -> list[float]:
    """One streaming completion; the gaps (ms) between its token chunks."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": num_tokens, "min_tokens": num_tokens}
    body |= {"ignore_eos": True, "temperature": 0.0, "stream": True, "return_token_ids": True}
    times = []
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {") and '"token_ids":[' in line.replace(" ", ""):
                times.append(time.perf_counter())
    return [(b - a) * 1e3 for a, b in zip(times, times[1:])]


@pytest.fixture(scope="module")
def profiled(demo_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("profile")
    profile_dir, log_dir = str(root / "spans"), str(root / "events")
    args = ["--device", "cpu", "--max-model-len", "256", "--num-kv-blocks", "128", "--profile-dir", profile_dir]
    server = Server(demo_model_dir, log_dir, args + ["--served-model-name", "demo"]).start()
    try:
        gaps = stream_gaps(server.base_url, [5, 6, 7, 8] * 8, 24)
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            body = {"model": "demo", "prompt": [9, 10, 11] * 5, "max_tokens": 6, "n": 3}
            assert client.post("/v1/completions", json=body).status_code == 200
    finally:
        assert server.stop(signal.SIGTERM) == 0
    files = [os.path.join(profile_dir, name) for name in sorted(os.listdir(profile_dir))]
    sp = profile_report.Spans.of(r for path in files for r in spans.read_spans(path))
    records = list(EventLogReader(newest_log(log_dir)))
    return sp, records, gaps


def test_spans_join_the_event_log(profiled):
    sp, records, _ = profiled
    by_seq = dict(records)
    assert sp.inputs and all(type(by_seq[i.seq]).__name__ == i.kind for i in sp.inputs)
    plans = {e.step for _, e in records if isinstance(e, events.StepPlan)}
    assert plans and plans == {s.step for s in sp.steps}
    assert plans == {i.planned_step for i in sp.inputs if i.planned_step}
    assert {e.req_id for _, e in records if isinstance(e, events.RequestArrived)} == {r.req_id for r in sp.requests}


def test_hops_run_forward_and_add_up_to_the_cycle(profiled):
    sp, _, _ = profiled
    chains = profile_report.step_chains(sp, sp.steps)
    assert len(chains) >= 0.8 * len(sp.steps)  # one step in flight: nearly every step is planned on the last
    for chain in chains:
        assert_parts_add_up(chain, profile_report.CHAIN_HOPS, "cycle")


def test_ttft_parts_add_up(profiled):
    sp, records, _ = profiled
    facts = profile_report.LogFacts.of(records)
    rows = profile_report.ttft_parts(sp, facts, 0, 2**63)
    assert len(rows) == len(sp.requests) == 4
    for row in rows:
        assert_parts_add_up(row, profile_report.TTFT_PARTS, "ttft")


def test_step_cycle_is_the_gap_between_tokens(profiled):
    """Measured apart: the worker's device clock per step, the client's clock per token."""
    sp, _, gaps = profiled
    single = [c["cycle"] for c in profile_report.step_chains(sp, sp.steps)][1:20]  # the streamed request alone
    assert statistics.median(single) == pytest.approx(statistics.median(gaps), rel=0.5)
    device = profile_report.device_time(sp.steps)
    assert 0.0 <= device["idle_share"] < 1.0
