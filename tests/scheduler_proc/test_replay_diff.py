"""`replay --diff`: the first differing decision of two runs, wall-clock fields ignored."""

import dataclasses
import json

import msgspec

from ledgerserve.scheduler_proc.replay import main
from ledgerserve.scheduler_proc.replay.diff import diff_logs
from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import EventLogReader, EventLogWriter
from tests.scheduler_proc.driver import Driver
from tests.scheduler_proc.logtools import ENGINE, rewrite


def _run(directory, max_tokens_of_b=4, clock=0.0, engine=ENGINE):
    writer = EventLogWriter(str(directory), engine.to_json(), run_id="run")
    d = Driver(10, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, max_model_len=32, log=writer)
    for req_id, prompt, max_tokens in [("a", 5, 4), ("b", 6, max_tokens_of_b), ("c", 3, 5)]:
        d.send(
            ev.RequestArrived(req_id, list(range(100, 100 + prompt)), ev.SamplingParams(max_tokens=max_tokens), clock)
        )
        clock += 0.25
    d.run()
    writer.append(ev.LogClosed("done"))
    writer.close()
    return writer.path


def test_same_workload_different_wall_clock_is_the_same(tmp_path, capsys):
    a, b = _run(tmp_path / "a", clock=1000.0), _run(tmp_path / "b", clock=2000.5)
    assert main([a, "--diff", b]) == 0
    assert "no decision differs" in capsys.readouterr().out
    assert diff_logs(a, b).input is None  # arrival_time_s is not a difference


def test_one_request_differs(tmp_path, capsys):
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b", max_tokens_of_b=2)
    found = diff_logs(a, b)
    this, other = found.decision
    assert this.seq is not None and other.seq is not None
    assert isinstance(this.event, ev.StepPlan) and isinstance(
        other.event, ev.StepPlan
    )  # b's NewReq carries its sampling
    assert [r.sampling.max_tokens for r in this.event.new_reqs if r.req_id == "b"] == [4]
    assert [r.sampling.max_tokens for r in other.event.new_reqs if r.req_id == "b"] == [2]
    this_input, other_input = found.input
    assert this_input.event.sampling.max_tokens == 4 and other_input.event.sampling.max_tokens == 2
    assert main([a, "--diff", b]) == 1
    out = capsys.readouterr().out
    assert f"first differing decision: seq {this.seq}" in out and "* new_reqs" in out
    assert main([a, "--diff", b, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "different" and report["first_decision"]["this"]["seq"] == this.seq
    assert report["first_decision"]["differing_fields"] == ["new_reqs"]


def test_a_missing_decision_is_the_difference(tmp_path):
    a = _run(tmp_path / "a")
    last_emitted = max(seq for seq, e in EventLogReader(a) if isinstance(e, ev.TokensEmitted))
    b = rewrite(a, tmp_path / "b", lambda seq, e: ev.LogClosed("gone") if seq == last_emitted else e)
    this, other = diff_logs(a, b).decision
    assert this.seq == last_emitted and isinstance(this.event, ev.TokensEmitted)
    assert other.seq != last_emitted


def test_each_differing_config_field_is_named_with_both_values(tmp_path, capsys):
    """Per-run fields (run dir, log dir, host, port) are no difference; every other field that
    differs is named, with both values, in the text and the JSON report."""
    per_run = {"run_dir": "/tmp/run-a", "event_log_dir": str(tmp_path / "a"), "host": "127.0.0.1", "port": 8001}
    a = _run(tmp_path / "a", engine=dataclasses.replace(ENGINE, **per_run))
    b = _run(tmp_path / "b", engine=dataclasses.replace(ENGINE, max_loras=3, run_dir="/tmp/run-b", port=8002))
    c = _run(tmp_path / "c", engine=dataclasses.replace(ENGINE, run_dir="/tmp/run-c", port=9000))
    assert main([a, "--diff", c]) == 0
    assert "configs differ" not in capsys.readouterr().out  # only per-run fields differ
    assert main([a, "--diff", b]) == 0  # a config difference is a note, not a difference
    out = capsys.readouterr().out
    assert "engine configs differ in 1 field(s)" in out and "max_loras: 8 in this log, 3 in the other log" in out
    assert "run_dir" not in out and "port" not in out and "host" not in out
    assert main([a, "--diff", b, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config_differs"] and report["config_differences"] == [{"field": "max_loras", "this": 8, "other": 3}]


def test_the_workers_reports_are_no_input_difference(tmp_path):
    """Two runs' loads take other times and their reports fall elsewhere among the inputs: the
    first differing input is one of the client's (a request, an abort, an adapter op), or none."""
    engine = dataclasses.replace(ENGINE, enable_lora=True, max_model_len=64)
    writer = EventLogWriter(str(tmp_path / "a"), engine.to_json(), run_id="run")
    d = Driver(10, block_size=4, max_model_len=64, enable_lora=True, lora_overlap_loading=True, log=writer)
    d.load("x")
    d.arrive("r", 3, lora="x", max_tokens=2)
    d.run()
    writer.append(ev.LogClosed("done"))
    writer.close()
    records = list(EventLogReader(writer.path))
    staged = next(seq for seq, e in records if isinstance(e, ev.AdapterLoadCompleted) and e.slot == -1)

    def other_times(seq, event):
        if isinstance(event, ev.AdapterLoadCompleted):
            return msgspec.structs.replace(event, duration_ms=event.duration_ms + 7.5, end_time_s=1e9)
        return event

    other = rewrite(writer.path, tmp_path / "b", other_times)
    found = diff_logs(writer.path, other)
    assert found.same and found.input is None
    # the staging reported before the request arrived, not after: the same client inputs
    arrived = next(seq for seq, e in records if isinstance(e, ev.RequestArrived))
    assert arrived < staged
    moved = [e for seq, e in records if seq != staged]
    moved.insert(arrived - 1, records[staged - 1][1])
    later = rewrite(writer.path, tmp_path / "c", lambda seq, event: moved[seq - 1])
    assert diff_logs(writer.path, later).input is None
