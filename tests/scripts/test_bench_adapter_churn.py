"""scripts/adapters/bench_adapter_churn.py: the full run's plan is the one asked for and needs three
server start-ups per mode; the adapter-load summary of an event log; and `--quick`, the whole
benchmark on the CPU with the demo model against servers it starts itself."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import EventLogWriter
from scripts.adapters.bench_adapter_churn import main
from scripts.adapters.churn_plan import FULL, PROBE_CASES, QUICK, TableSetup, check_settings, server_groups
from scripts.adapters.churn_report import load_stats
from scripts.common.plot import PNG_SIGNATURE


def test_the_full_plan_is_the_one_asked_for() -> None:
    s = FULL
    assert (s.input_len, s.output_len, s.burst_requests, s.burst_in_flight) == (256, 128, 384, 128)
    assert (s.poisson_rate, s.poisson_requests) == (10.0, 200)
    assert [(t.num_adapters, t.max_loras) for t in s.table] == [(1, 8), (8, 8), (16, 8), (64, 8), (64, 64)]
    assert (s.zipf_adapters, s.zipf_rank, s.zipf_s, s.zipf_max_loras, s.zipf_max_cpu_loras, s.zipf_load) == (
        512,
        8,
        1.1,
        32,
        128,
        0.7,
    )
    assert set(s.ranks) == {8, 16}


@pytest.mark.parametrize("settings", [FULL, QUICK], ids=["full", "quick"])
def test_workloads_need_three_server_start_ups(settings) -> None:
    check_settings(settings)
    groups = server_groups(settings)
    assert len(groups) <= 3
    assert [g.runs_probe for g in groups] == [True] + [False] * (len(groups) - 1)
    assert groups[0].setups[0] == settings.table[0] and settings.table[0].num_adapters == 1  # capacity comes first
    assert sorted((t for g in groups for t in g.setups), key=settings.table.index) == list(settings.table)
    for g in groups:
        assert all(t.max_loras == g.max_loras for t in g.setups)
        assert g.max_cpu_loras == (
            settings.zipf_max_cpu_loras if g.runs_zipf else max(settings.min_cpu_loras, g.max_loras)
        )
    assert [g.runs_zipf for g in groups].count(True) == 1
    if FULL is settings:
        assert [(g.max_loras, g.max_cpu_loras) for g in groups] == [(8, 32), (64, 64), (32, 128)]


def test_settings_the_probe_cannot_use_are_refused() -> None:
    with pytest.raises(ValueError, match="single adapter"):
        check_settings(dataclasses.replace(QUICK, table=(TableSetup(2, 2),)))
    with pytest.raises(ValueError, match="beside a full set of slots"):
        check_settings(dataclasses.replace(QUICK, min_cpu_loras=2))
    with pytest.raises(ValueError, match="as many table adapters"):
        check_settings(dataclasses.replace(QUICK, table=(TableSetup(1, 2), TableSetup(2, 2))))


def test_load_stats_group_rank_zero_loads_by_target_and_tier(tmp_path) -> None:
    config = EngineConfig(model_dir="m", served_model_name="m", max_model_len=32).to_json()
    with EventLogWriter(str(tmp_path), config, run_id="loads") as log:
        for event in [
            ev.AdapterPrefetched(1, "/a", 7),
            ev.AdapterLoadCompleted(0, -1, 1, "disk", 4.0, 8_000_000),
            ev.AdapterLoadCompleted(1, -1, 1, "disk", 99.0, 8_000_000),  # another rank: not counted
            ev.AdapterSlotAssigned(0, 1, "/a", 7),
            ev.AdapterLoadCompleted(0, 0, 1, "cpu", 1.0, 8_000_000),
            ev.AdapterSlotAssigned(1, 2, "/b", 9),
            ev.AdapterLoadCompleted(0, 1, 2, "disk", 2.0, 4_000_000),
            ev.AdapterLoadCompleted(0, 1, 2, "disk", 6.0, 4_000_000),
            ev.AdapterLoadCompleted(0, 1, 3),  # a worker that reports no tier or duration
            ev.AdapterCpuEvicted(1),
        ]:
            log.append(event)
    stats = load_stats(str(tmp_path))
    assert stats["decisions"] == {
        "AdapterSlotAssigned": 2,
        "AdapterPrefetched": 1,
        "AdapterEvicted": 0,
        "AdapterCpuEvicted": 1,
        "AdapterLoadFailed": 0,
    }
    assert stats["loads"] == {
        "cpu_tier<-disk": {"count": 1, "median_duration_ms": 4.0, "median_gbps": 2.0},
        "gpu_slot<-cpu": {"count": 1, "median_duration_ms": 1.0, "median_gbps": 8.0},
        "gpu_slot<-disk": {"count": 2, "median_duration_ms": 4.0, "median_gbps": 1.333},  # medians of 2 and 0.667
        "gpu_slot<-unreported": {"count": 1, "median_duration_ms": None, "median_gbps": None},
    }


@pytest.mark.slow
def test_quick_run_measures_every_workload(tmp_path, demo_home, monkeypatch) -> None:
    monkeypatch.setenv("HOME", demo_home)  # the session's demo build, not a second one in the user's cache
    out, plot = tmp_path / "churn.json", tmp_path / "churn.png"
    report = main(["--quick", "--work-dir", str(tmp_path / "work"), "--out", str(out), "--plot", str(plot)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert plot.read_bytes().startswith(PNG_SIGNATURE)
    assert report["bandwidth"]["page_cache_read_gbps"] > 0 and report["bandwidth"]["pinned_h2d_gbps"] is None
    mode = report["modes"]["on"]
    assert "leaks" not in mode
    assert len(mode["servers"]) == 3 and all(s["exit_code"] == 0 for s in mode["servers"])
    assert all("--lora-overlap-loading" in s["args"] for s in mode["servers"])
    probe = mode["probe"]
    assert probe["num_repetitions"] == QUICK.probe_reps
    assert all(probe["median_ms"][case] > 0 for case in PROBE_CASES)
    rows = mode["table"]
    assert [(r["num_adapters"], r["max_loras"], r["arrival"]) for r in rows] == [
        (t.num_adapters, t.max_loras, a) for t in QUICK.table for a in ("burst", "poisson")
    ]
    [zipf] = mode["zipf"]
    for row in [*rows, zipf]:
        assert row["num_errors"] == 0 and row["unload_failures"] == [], row["errors"]
        assert row["output_tokens_per_s"] > 0 and row["ttft_ms"]["p99"] >= row["ttft_ms"]["p50"] > 0
        assert len(row["ttft_values_ms"]) == row["num_requests"]
    assert [r["num_requests"] for r in rows] == [QUICK.burst_requests, QUICK.poisson_requests] * len(QUICK.table)
    assert mode["capacity_requests_per_s"] == rows[0]["requests_per_s"]
    assert zipf["rate"] == round(QUICK.zipf_load * rows[0]["requests_per_s"], 3)
    assert zipf["num_requests"] == QUICK.zipf_requests and zipf["num_adapters"] == QUICK.zipf_adapters
    first = mode["servers"][0]["adapter_movement"]
    slot_loads = sum(row["count"] for key, row in first["loads"].items() if key.startswith("gpu_slot"))
    assert first["decisions"]["AdapterSlotAssigned"] == slot_loads > 0
    zipf_dir = tmp_path / "work" / "adapters" / "zipf"
    assert len(os.listdir(zipf_dir)) == QUICK.zipf_adapters
    linked = zipf_dir / f"adapter-{QUICK.zipf_adapters - 1}" / "adapter_model.safetensors"
    assert os.stat(linked).st_nlink > 1  # the weights are shared; each directory is its own version


def test_the_servers_get_the_rank_count() -> None:
    from ledgerserve.cli import build_parser
    from scripts.adapters.bench_adapter_churn import QUICK_FLAGS, model_args, parse_args

    argv = model_args(parse_args(["--quick", "--tensor-parallel-size", "2"]), "/m", QUICK_FLAGS)
    served = build_parser().parse_args(["serve", *argv])
    assert (served.tensor_parallel_size, served.model_dir, served.async_scheduling) == (2, "/m", True)
    assert (
        build_parser().parse_args(["serve", *model_args(parse_args([]), "/m", QUICK_FLAGS)]).tensor_parallel_size == 1
    )
