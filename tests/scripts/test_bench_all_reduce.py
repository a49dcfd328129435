"""scripts/decode/bench_all_reduce.py on the CPU: two gloo rank processes time every size through the
collective library; one-shot, CUDA's alone, is reported absent."""

from __future__ import annotations

import json

import pytest

from scripts.decode import bench_all_reduce


def test_two_cpu_ranks_time_each_size(tmp_path) -> None:
    out = tmp_path / "all_reduce.json"
    argv = ["--tensor-parallel-size", "2", "--device", "cpu", "--sizes-kib", "4,64", "--out", str(out)]
    report = bench_all_reduce.main(argv)
    assert json.loads(out.read_text()) == report
    assert (report["device"], report["tensor_parallel_size"]) == ("cpu", 2)
    assert [row["bytes"] for row in report["rows"]] == [4096, 65536]
    assert all(row["library_us"] > 0 and row["one_shot_us"] is None for row in report["rows"])


def test_one_rank_has_nothing_to_reduce() -> None:
    with pytest.raises(SystemExit):
        bench_all_reduce.parse_args(["--tensor-parallel-size", "1"])
