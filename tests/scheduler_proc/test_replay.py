"""Replay: a recorded run verifies; a tampered decision or a damaged log is caught."""

import json
import os
import subprocess
import sys

import msgspec

from ledgerserve.scheduler_proc.replay import main, replay
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import EventLogReader, EventLogWriter
from ledgerserve.sim.workload import run_workload
from tests.scheduler_proc.driver import Driver

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = EngineConfig(
    model_dir="m", served_model_name="m", max_model_len=32, max_num_seqs=4, max_num_batched_tokens=16, block_size=4
)


def _record(directory, seed=3) -> str:
    writer = EventLogWriter(str(directory), ENGINE.to_json(), run_id="test")
    d = Driver(10, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, max_model_len=32, log=writer)
    run_workload(d, seed, num_events=80)
    writer.append(ev.LogClosed("done"))
    writer.close()
    return writer.path


def _rewrite(path, directory, change) -> str:
    """Copy the log into `directory`, passing each (seq, event) through `change`."""
    records = list(EventLogReader(path))
    with EventLogWriter(str(directory), EventLogReader(path).config_json, run_id="tampered") as writer:
        for seq, event in records:
            writer.append(change(seq, event))
    return writer.path


def test_recorded_run_verifies(tmp_path):
    path = _record(tmp_path)
    result = replay(path)
    assert result.ok and not result.truncated_tail
    assert result.num_inputs > 50 and result.num_decisions > 50
    assert result.core.step > 10 and not result.core.has_unfinished()


def test_tampered_decision_is_found_with_a_readable_diff(tmp_path):
    path = _record(tmp_path / "a")
    target = [seq for seq, e in EventLogReader(path) if isinstance(e, ev.StepPlan)][5]

    def change(seq, event):
        return ev.StepPlan(event.step + 100, event.new_reqs, event.cached_reqs) if seq == target else event

    result = replay(_rewrite(path, tmp_path / "b", change))
    assert not result.ok and result.divergence.seq == target
    text = result.divergence.describe()
    assert f"divergence at seq {target}" in text and "differing fields: step" in text
    step_row = next(line for line in text.splitlines() if line.split()[:2] == ["*", "step"])
    assert str(6 + 100) in step_row and " 6" in step_row  # logged, then recomputed, side by side
    print(text)


def test_missing_and_extra_decisions(tmp_path):
    path = _record(tmp_path / "a")
    target = [seq for seq, e in EventLogReader(path) if isinstance(e, ev.StateDigest)][2]
    dropped = _rewrite(path, tmp_path / "b", lambda seq, e: ev.LogClosed("x") if seq == target else e)
    assert replay(dropped).divergence.logged is None  # the core made one the log lacks
    extra = _rewrite(path, tmp_path / "c", lambda seq, e: ev.RequestFinished("zz", "stop", 1) if seq == target else e)
    assert replay(extra).divergence.seq == target


def test_log_ending_before_decisions_is_a_truncated_tail(tmp_path):
    path = _record(tmp_path / "a")
    records = list(EventLogReader(path))
    last_input = max(seq for seq, e in records if isinstance(e, ev.INPUT_TYPES))
    with EventLogWriter(str(tmp_path / "b"), ENGINE.to_json()) as writer:
        for _seq, event in records[:last_input]:
            writer.append(event)
    result = replay(writer.path)
    assert result.ok and result.truncated_tail


def test_cli_exit_codes_and_show(tmp_path, capsys):
    path = _record(tmp_path / "a")
    assert main([str(tmp_path / "a"), "--verify"]) == 0  # a directory: its newest log
    assert "OK" in capsys.readouterr().out
    assert main([path, "--show", "queues,requests", "--at-step", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "ok" and out["step"] == 3 and set(out["state"]) == {"queues", "requests"}
    assert out["state"]["queues"]["step"] == 3 and set(out["state"]["queues"]) >= {"waiting", "running"}
    assert main([path, "--show", "all", "--at-step", "3"]) == 0  # every section, as text
    text = capsys.readouterr().out
    assert all(f"== {name} ==" in text for name in ("queues", "slots", "namespaces", "requests", "adapters"))
    target = [seq for seq, e in EventLogReader(path) if isinstance(e, ev.TokensEmitted)][4]
    bad = _rewrite(path, tmp_path / "b", lambda seq, e: ev.TokensEmitted(e.req_id, [123]) if seq == target else e)
    assert main([bad]) == 1
    assert f"divergence at seq {target}" in capsys.readouterr().out
    where = EventLogReader(path).header.size + 500  # inside a record in the middle
    with open(path, "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert main([path]) == 2
    assert "bad record checksum (seq " in capsys.readouterr().err


def test_script_entry_point(tmp_path):
    path = _record(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "scripts.ops.replay", path], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("OK")


def test_a_verified_replay_shows_each_ranks_ready_report(tmp_path, capsys):
    """The weight bytes a rank reported in its WorkerReady (an input, so the run still verifies) are
    printed with its KV blocks; a log from before ranks reported them prints no figure."""
    path = _record(tmp_path / "a")

    def with_weights(seq, event):
        return msgspec.structs.replace(event, num_weight_bytes=3 << 20) if isinstance(event, ev.WorkerReady) else event

    reported = _rewrite(path, tmp_path / "b", with_weights)
    assert main([reported, "--verify"]) == 0
    assert "  rank 0: 10 KV blocks, 3.0 MiB of weights on cpu (float32)\n" in capsys.readouterr().out
    assert main([reported, "--verify", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] == [
        {"rank": 0, "num_kv_blocks": 10, "num_weight_bytes": 3 << 20}
    ]
    assert main([path, "--verify"]) == 0
    assert "  rank 0: 10 KV blocks on cpu (float32)\n" in capsys.readouterr().out
