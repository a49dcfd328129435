"""check_targets: the five decode-target verdicts, from the three reports a GPU run writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from scripts.repo.check_targets import judge


def _row(batch: int, adapters: int, step_ms: float, floor_ms: float, tok_s: float) -> dict:
    return {
        "batch": batch,
        "adapters": adapters,
        "step_ms": step_ms,
        "floor_ms": floor_ms,
        "gpu_ms": step_ms + 0.01,
        "tok_s": tok_s,
    }


def _targets(step_32_adapters_ms: float = 6.0, tok_s_4_adapters: float = 4700.0) -> dict:
    return {
        "device": "test GPU",
        "copy_bw_GBps": 3000.0,
        "results": [
            _row(1, 0, 5.5, 5.0, 182.0),
            _row(32, 0, 6.4, 5.2, 5000.0),
            _row(1, 1, 9.9, 5.0, 100.0),  # batch 1 with an adapter is reported but judged by no target
            _row(32, 4, 6.8, 5.3, tok_s_4_adapters),
            _row(32, 32, step_32_adapters_ms, 6.0, 4200.0),
        ],
    }


E2E, PEFT = {"device": "test GPU", "tok_s": 3800.0}, {"device": "test GPU", "tok_s": 22.0}


def test_all_five_met() -> None:
    verdicts = judge(_targets(), E2E, PEFT)
    assert [v.met for v in verdicts] == [True] * 5
    assert verdicts[0].value == pytest.approx(1.1)
    assert verdicts[2].value == pytest.approx(0.84)
    assert verdicts[4].value == pytest.approx(172.7)


def test_the_floor_limit_is_inclusive_and_a_step_past_it_misses() -> None:
    assert judge(_targets(step_32_adapters_ms=7.5), E2E, PEFT)[1].met  # exactly 1.25x
    missed = judge(_targets(step_32_adapters_ms=7.51), E2E, PEFT)
    assert [v.met for v in missed] == [True, False, True, True, True]


def test_throughput_ratio_below_its_limit_misses() -> None:
    verdicts = judge(_targets(tok_s_4_adapters=4590.0), E2E, PEFT)  # 0.918x base
    assert [v.met for v in verdicts] == [True, True, True, False, True]
    assert not judge(_targets(), E2E, PEFT | {"tok_s": 40.0})[4].met  # 95x


def test_a_missing_row_is_an_error_not_a_pass() -> None:
    targets = _targets()
    targets["results"] = [r for r in targets["results"] if r["adapters"] != 32]
    with pytest.raises(ValueError, match="batch 32 with 32 adapters"):
        judge(targets, E2E, PEFT)


def test_reports_from_another_gpu_are_an_error() -> None:
    with pytest.raises(ValueError, match="different devices"):
        judge(_targets(), E2E, PEFT | {"device": "another GPU"})


def test_the_command_exits_1_when_a_target_is_missed(tmp_path) -> None:
    paths = []
    for name, report in [("t", _targets(step_32_adapters_ms=8.0)), ("e", E2E), ("p", PEFT)]:
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report))
    out = tmp_path / "verdict.json"
    done = subprocess.run(
        [sys.executable, "-m", "scripts.repo.check_targets", *map(str, paths), "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1, done.stderr
    assert "MISSED batch 32, 32 adapters step <= 1.25x floor" in done.stdout
    assert [v["met"] for v in json.loads(out.read_text())["verdicts"]] == [True, False, True, True, True]


def test_the_command_says_why_it_cannot_judge(tmp_path) -> None:
    paths = []
    for name, report in [("t", _targets()), ("e", E2E), ("p", PEFT | {"device": "another GPU"})]:
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(report))
    done = subprocess.run(
        [sys.executable, "-m", "scripts.repo.check_targets", *map(str, paths)], capture_output=True, text=True
    )
    assert done.returncode == 1
    assert done.stderr.strip().startswith("check_targets: the reports come from different devices")
    assert "Traceback" not in done.stderr
