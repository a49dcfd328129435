"""bench_adapter_load on the CPU with small shapes: it reads, images and copies each adapter
and reports every time with its ratio to the measured bandwidths."""

import json

from scripts.adapters import bench_adapter_load


def test_bench_reports_every_rank_on_the_cpu(tmp_path, capsys) -> None:
    out = tmp_path / "report.json"
    report = bench_adapter_load.main(
        [
            "--device",
            "cpu",
            "--small",
            "--ranks",
            "4,8",
            "--copy-mib",
            "4",
            "--read-mib",
            "4",
            "--repeats",
            "1",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text()) == report == json.loads(capsys.readouterr().out)
    assert report["pinned_h2d_GBps"] > 0 and report["file_read_GBps"] > 0
    assert [a["rank"] for a in report["adapters"]] == [4, 8]
    for a in report["adapters"]:
        assert a["image_bytes"] >= a["file_bytes"] * 0.9 and a["num_extents"] >= 1
        for key in ("disk_to_cpu_ms", "h2d_ms", "cpu_to_slot_ms", "disk_ratio", "h2d_ratio", "slot_ratio"):
            assert a[key] > 0, key
    assert report["adapters"][1]["image_bytes"] > report["adapters"][0]["image_bytes"]
