"""scripts/serving/bench_serving.py against the real process group on the demo model: it writes
and loads its adapters, telling each stage, every request gets exactly the forced output length,
the report and plot are written, and the adapters are gone afterwards."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from scripts.common.plot import PNG_SIGNATURE
from scripts.serving.bench_serving import main
from scripts.serving.serving_workload import parse_config, plan_workload, read_model_config
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

OUTPUT_LEN = 8


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("bench-adapters"))


@pytest.fixture(scope="module")
def server(demo_model_dir, adapter_root, tmp_path_factory):
    args = [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-allowed-dir",
        adapter_root,
        "--max-model-len",
        "256",
        "--num-kv-blocks",
        "96",
        "--max-num-batched-tokens",
        "96",
        "--max-num-seqs",
        "16",
    ]
    srv = Server(demo_model_dir, str(tmp_path_factory.mktemp("bench-events")), args).start()
    yield srv
    srv.stop()


def test_bench_serving_drives_the_server(server, demo_model_dir, adapter_root, tmp_path):
    out, plot = tmp_path / "report.json", tmp_path / "report.png"
    argv = [
        "--base-url",
        server.base_url,
        "--model-dir",
        demo_model_dir,
        "--adapter-dir",
        adapter_root,
        "--num-adapters",
        "2",
        "--ranks",
        "4,8",
        "--popularity",
        "zipf",
        "--base-share",
        "0.25",
        "--arrival",
        "poisson",
        "--rate",
        "200",
        "--num-requests",
        "12",
        "--input-len",
        "16",
        "--output-len",
        str(OUTPUT_LEN),
        "--seed",
        "3",
        "--out",
        str(out),
        "--plot",
        str(plot),
    ]
    lines: list[str] = []
    progress: list[str] = []
    report = main(argv, echo=lines.append, say=progress.append)
    assert report["num_errors"] == 0, report["errors"]
    assert report["num_completed"] == 12 and report["num_output_len_mismatches"] == 0
    assert report["unload_failures"] == []
    assert lines and lines[0].startswith("popularity: top-1 adapter")
    assert [a["rank"] for a in report["adapters"]] == [4, 8]
    assert progress[0] == "planning 12 requests of 16 prompt tokens"
    for stage in ("writing 2 random adapters into", "loading adapter 2/2: bench-a1 (rank 8)", "sending 12 requests"):
        assert any(line.startswith(stage) for line in progress), progress
    assert progress[-2].startswith("12/12 requests answered (0 errors) in ") and progress[-1] == "unloading 2 adapters"

    rows = {row["model"]: row for row in report["per_adapter"]}
    plan, _ = plan_workload(parse_config(argv), read_model_config(demo_model_dir))  # the same seed: the same plan
    used = {f"bench-a{p.adapter}" for p in plan if p.adapter is not None}
    assert used and set(rows) == used | {report["base_model"]}
    assert sum(row["num_requests"] for row in rows.values()) == 12
    assert rows[report["base_model"]]["num_requests"] == 3  # round(0.25 * 12)
    assert all(row["mean_tpot_ms"] is not None and row["mean_tpot_ms"] > 0 for row in rows.values())
    assert report["ttft_ms"]["p99"] >= report["ttft_ms"]["p50"] > 0
    assert report["throughput"]["output_tokens_per_s"] > 0
    assert report["fairness"]["num_adapters"] == len(used) and 0 < report["fairness"]["jain_index"] <= 1

    assert json.loads(out.read_text())["num_completed"] == 12
    assert plot.read_bytes().startswith(PNG_SIGNATURE)
    models = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [report["base_model"]]  # the adapters were unloaded
    assert sorted(os.listdir(adapter_root)) == ["adapter-0", "adapter-1"]
    server.wait_idle(timeout_s=20)


def test_sharded_client_sends_every_request_from_one_start(server, demo_model_dir):
    """The profile's client spread over processes: each request of the plan comes back once, in
    plan order, with the forced output length, and no shard starts before the shared instant."""
    import asyncio
    import time

    from scripts.serving.client_shards import deal, run_sharded, shard_concurrency

    argv = ["--base-url", server.base_url, "--model-dir", demo_model_dir, "--num-adapters", "0", "--base-share", "1"]
    argv += ["--arrival", "burst", "--num-requests", "7", "--input-len", "12", "--output-len", str(OUTPUT_LEN)]
    plan, _ = plan_workload(parse_config(argv), read_model_config(demo_model_dir))
    base = httpx.get(server.base_url + "/v1/models", timeout=10).json()["data"][0]["id"]
    before_s = time.perf_counter()
    results = asyncio.run(run_sharded(server.base_url, plan, [], base, OUTPUT_LEN, 3, num_shards=2))
    assert [r.index for r in results] == [p.index for p in plan]
    assert all(r.status == 200 and r.output_tokens == OUTPUT_LEN for r in results), results
    assert min(r.start_s for r in results) > before_s  # one clock for every process
    assert [[p.index for p in part] for part in deal(plan, 2)] == [[0, 2, 4, 6], [1, 3, 5]]
    assert [shard_concurrency(3, 2, i) for i in range(2)] == [2, 1] and shard_concurrency(None, 2, 0) is None
    server.wait_idle(timeout_s=20)
