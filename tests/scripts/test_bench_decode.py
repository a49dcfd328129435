"""bench_decode's GPU-idle share, read from the steps' (start, end) event times."""

from __future__ import annotations

import pytest

from scripts.decode.decode_churn import idle_share


def test_idle_share_counts_the_gaps_between_steps() -> None:
    # three steps: the second queued 2 ms after the first ended, the third right behind the second
    assert idle_share([(0.0, 10.0), (12.0, 20.0), (20.0, 30.0)]) == pytest.approx(2.0 / 30.0)


def test_a_step_queued_ahead_starts_when_the_one_before_ends() -> None:
    # with a step in flight, every start event fires as the step before it ends: no idle time
    assert idle_share([(0.0, 5.0), (5.0, 10.0), (10.0, 15.0)]) == 0.0


def test_one_step_has_no_gap_to_measure() -> None:
    assert idle_share([(3.0, 9.0)]) == 0.0
    assert idle_share([]) == 0.0


def test_load_churn_keeps_spare_slots_loading_from_both_tiers(tmp_path) -> None:
    """On the CPU runner: every load that ends starts the next one in its slot, half of them from
    the CPU tier; stopping evicts what the churn holds."""
    import time

    from ledgerserve.shared.config import EngineConfig
    from ledgerserve.worker_proc.runner import ModelRunner
    from scripts.decode.decode_churn import LoadChurn
    from tests.adapter_factory import make_peft_adapter
    from tests.model_factory import make_tiny_checkpoint

    base = make_tiny_checkpoint("llama", tmp_path / "base")
    paths = [
        make_peft_adapter(base, tmp_path / f"a{i}", r=4, alpha=8, targets=["q_proj", "v_proj"], seed=i)
        for i in range(2)
    ]
    config = EngineConfig(
        model_dir=base,
        served_model_name="tiny",
        max_model_len=64,
        block_size=4,
        num_kv_blocks=16,
        enable_lora=True,
        max_loras=3,
        max_lora_rank=8,
        max_cpu_loras=8,
        lora_overlap_loading=True,
    )
    runner = ModelRunner(config)
    try:
        churn = LoadChurn(runner, 1, 2, paths)
        churn.start()
        deadline = time.monotonic() + 60
        while churn.num_loads < 8 and time.monotonic() < deadline:
            churn.pump()
            time.sleep(0.001)
        assert churn.num_loads >= 8 and set(churn.sources) == {"cpu", "disk"}, churn.sources
        churn.stop()
        assert not churn.held and all(slot not in runner.lora.assigned for slot in (1, 2))
    finally:
        runner.close()


def test_tensor_parallel_sweep_runs_two_ranks_beside_one(demo_model_dir, tmp_path) -> None:
    """--tensor-parallel-size 2 --compare-tp1 on the CPU: two rank processes (gloo) and one, each
    row with its step time, all-reduce time (none with one rank), shard floor and, with
    --profile-steps, rank 0's host parts of a step and per-op table (the all-reduce among the ops only
    with two ranks)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "tp.json"
    argv = ["--tensor-parallel-size", "2", "--compare-tp1", "--device", "cpu", "--model-dir", demo_model_dir]
    argv += ["--batch-sizes", "2", "--adapters", "1", "--rank", "4", "--prompt-len", "8", "--warmup", "1"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.decode.bench_decode",
            *argv,
            "--steps",
            "2",
            "--profile-steps",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    tp1, tp2 = report["tp1"], report["tp2"]
    assert (tp1["tensor_parallel_size"], tp2["tensor_parallel_size"]) == (1, 2)
    assert tp1["tp_layout"] == "" and "kv heads 2 -> 1/rank (split)" in tp2["tp_layout"]
    for run in (tp1, tp2):
        [row] = run["results"]
        assert (row["batch"], row["adapters"]) == (2, 1) and row["step_ms"] > 0 and row["shard_floor_ms"] > 0
    assert tp1["results"][0]["all_reduce_ms"] == 0 and tp2["results"][0]["all_reduce_ms"] > 0
    ops = {name: {k["kernel"]: k for k in run["results"][0]["kernels"]} for name, run in report.items() if "tp" in name}
    assert ops["tp1"]["aten::mm"]["calls"] > 0 and ops["tp2"]["aten::mm"]["calls"] > 0
    assert "c10d::allreduce_" not in ops["tp1"] and ops["tp2"]["c10d::allreduce_"]["calls"] > 0
    for run in (tp1, tp2):  # eager on the CPU: no graph replays, the rest of a step's parts timed
        host_ms = run["results"][0]["host_ms"]
        assert host_ms["Requests.apply"] > 0 and host_ms["Sampler.launch"] > 0, host_ms
        assert "CUDAGraph.replay" not in host_ms, host_ms
    want = round(tp1["results"][0]["step_ms"] / tp2["results"][0]["step_ms"], 2)
    assert report["speedup"] == [want]


@pytest.mark.parametrize("flag", [["--churn-slots", "1"], ["--e2e"]])
def test_tensor_parallel_refuses_what_its_sweep_would_not_do(flag: list[str], capsys) -> None:
    """Its sweep has no churn and no end-to-end run: such a flag is an error there, not silently
    dropped; one rank takes it."""
    from scripts.decode.decode_args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--tensor-parallel-size", "2", *flag])
    assert f"{flag[0]}: not with --tensor-parallel-size" in capsys.readouterr().err
    parse_args(flag)


def test_tensor_parallel_sweep_runs_ahead_with_async_scheduling(demo_model_dir, tmp_path) -> None:
    """--async-scheduling at TP 2 on the CPU: each step launched before the one ahead of it is read
    back, rank 0's tokens reaching rank 1 over the side group (placeholders on the device only
    match tokens every rank knows: a rank left without them fails its step and the run)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "tp.json"
    argv = ["--tensor-parallel-size", "2", "--async-scheduling", "--device", "cpu", "--model-dir", demo_model_dir]
    argv += ["--batch-sizes", "2", "--adapters", "0,1", "--rank", "4", "--prompt-len", "8", "--warmup", "1"]
    cmd = [sys.executable, "-m", "scripts.decode.bench_decode", *argv, "--steps", "3", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["tp2"]["results"]
    assert [(r["batch"], r["adapters"]) for r in rows] == [(2, 0), (2, 1)]
    assert all(r["step_ms"] > 0 for r in rows)


def test_gemv_config_flags_name_a_shape_and_its_four_values(capsys) -> None:
    from scripts.decode.decode_args import parse_args

    args = parse_args(["--gemv-config", "4096x2048=2,2048,4,1", "--gemv-config", "3072x4096=8,4096,8,1"])
    assert args.gemv_configs == {(4096, 2048): (2, 2048, 4, 1), (3072, 4096): (8, 4096, 8, 1)}
    for bad in ("4096x2048=2,2048,4", "4096=2,2048,4,1", "4096x2048:2,2048,4,1"):
        with pytest.raises(SystemExit):
            parse_args(["--gemv-config", bad])
        assert f"--gemv-config {bad!r}" in capsys.readouterr().err


def test_gemv_configs_from_the_flags_come_before_the_kernels_own(monkeypatch) -> None:
    pytest.importorskip("triton")
    from ledgerserve.kernels import gemv
    from scripts.decode.decode_args import parse_args, use_gemv_configs

    monkeypatch.setattr(gemv, "MEASURED_BEST", dict(gemv.MEASURED_BEST))
    assert gemv.gemv_config(4096, 2048) != (4, 2048, 8, 1)
    use_gemv_configs(parse_args(["--gemv-config", "4096x2048=4,2048,8,1"]))
    assert gemv.gemv_config(4096, 2048) == (4, 2048, 8, 1)


class _Span:
    def __init__(self, name: str, start: float, end: float) -> None:
        import types

        import torch

        self.name, self.time_range = name, types.SimpleNamespace(start=start, end=end)
        self.device_type = torch.autograd.DeviceType.CUDA


def test_the_timeline_is_the_last_step_told_apart_by_the_hosts_gap() -> None:
    """Two steps of three kernels (the second's first 500 µs after the first's last ends), each
    followed by a bench's one-kernel hand-over: the last step's kernels; a short kernel overlapping
    a long one does not hide the long one's end."""
    import types

    from scripts.decode.profile_decode import last_step_timeline

    spans = [_Span("a", 0, 50), _Span("b", 10, 20), _Span("c", 60, 80), _Span("x", 300, 310)]  # b inside a
    spans += [_Span("a", 880, 930), _Span("b", 890, 900), _Span("c", 940, 960), _Span("x", 1200, 1205)]
    prof = types.SimpleNamespace(events=lambda: list(reversed(spans)))
    assert last_step_timeline(prof) == [["a", 0, 50], ["b", 10, 10], ["c", 60, 20]]
    whole = last_step_timeline(prof, gap_us=1000.0)
    assert whole[0] == ["a", 0, 50] and len(whole) == 8
    assert last_step_timeline(prof, "cpu") == [] and last_step_timeline(types.SimpleNamespace(events=list)) == []
