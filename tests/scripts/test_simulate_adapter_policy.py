"""simulate_adapter_policy: the real core under both slot policies in logical time, on a small
workload (integrity checked after every event): every request is served, the policies agree
when every adapter has a slot, and with more adapters than slots draining one slot keeps the
batches fuller than barring every adapter."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from scripts.adapters.simulate_adapter_policy import SimSettings, Workload, main, percentile, simulate

SMALL = dataclasses.replace(
    SimSettings(),
    max_loras=4,
    max_num_seqs=32,
    prompt_tokens=16,
    output_tokens=16,
    lora_max_wait_steps=4,
    num_requests=48,
    rate_rps=40.0,
    burst_requests=64,
    burst_concurrency=32,
)


def test_percentile_matches_numpy() -> None:
    values = [5.0, 1.0, 9.0, 3.0, 7.0, 2.0]
    for q in (0, 25, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_with_a_slot_for_every_adapter_the_policies_agree() -> None:
    bar = simulate(SMALL, Workload("burst", 4), "bar", check=True)
    drain = simulate(SMALL, Workload("burst", 4), "drain", check=True)
    assert bar == drain and drain["num_drains"] == 0 and drain["num_slot_loads"] == 4


@pytest.mark.parametrize("workload", ["burst", "poisson"])
def test_draining_one_slot_keeps_batches_fuller_than_barring_every_adapter(workload: str) -> None:
    bar = simulate(SMALL, Workload(workload, 8), "bar", check=True)
    drain = simulate(SMALL, Workload(workload, 8), "drain", check=True)
    assert drain["num_drains"] > 0 and bar["num_drains"] == 0
    assert drain["tokens_per_step"] > bar["tokens_per_step"]
    assert drain["ttft_p50_steps"] < bar["ttft_p50_steps"]


def test_main_writes_the_rows(tmp_path) -> None:
    out = tmp_path / "sim.json"
    assert main(["--adapters", "4", "--workloads", "burst", "--burst-requests", "16", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["num_adapters"], r["policy"]) for r in rows] == [
        ("burst", 4, "bar"),
        ("burst", 4, "drain"),
    ]
    assert all(r["num_slot_loads"] == 4 and r["tokens_per_step"] > 0 for r in rows)
