"""scripts/serving/bench_serving.py without a server: workload generation, statistics, the report,
argument and workload-file handling, and the PNG plot (with and without matplotlib)."""

from __future__ import annotations

import json
import random
import struct
import sys
import zlib

import pytest

from ledgerserve.tokenizer_proc.protocol import CompletionRequest
from scripts.common.plot import PNG_SIGNATURE, write_png
from scripts.serving.bench_serving import main
from scripts.serving.serving_report import (
    RequestResult,
    StreamTally,
    fairness,
    jain_index,
    latency_stats,
    percentile,
    plot_panels,
    result_of,
    summarize,
)
from scripts.serving.serving_workload import (
    AdapterSpec,
    PlannedRequest,
    arrival_times_s,
    choose_targets,
    parse_config,
    plan_workload,
    popularity_shares,
    popularity_weights,
    random_prompt,
    request_body,
    workload_argv,
)

HF_CONFIG = {"vocab_size": 300, "bos_token_id": 0, "eos_token_id": [1, 2], "pad_token_id": None}
BASE_ARGV = ["--base-url", "http://127.0.0.1:1", "--model-dir", "/nonexistent", "--adapter-dir", "/tmp/a"]


def _top1_share(num_adapters: int, popularity: str, zipf_s: float, num_requests: int = 20000) -> float:
    weights = popularity_weights(num_adapters, popularity, zipf_s, random.Random(1))
    return popularity_shares(choose_targets(num_requests, weights, 0.0, random.Random(2)), weights)["top1_share"]


def test_zipf_top1_share_grows_with_s_and_uniform_is_about_one_over_n():
    shares = [_top1_share(20, "zipf", s) for s in (0.5, 1.1, 2.0)]
    assert shares[0] < shares[1] < shares[2]
    expected = 1 / sum(1 / k**2.0 for k in range(1, 21))
    assert shares[2] == pytest.approx(expected, abs=0.02)
    assert _top1_share(10, "uniform", 1.1) == pytest.approx(0.1, abs=0.01)


def test_zipf_weights_sum_to_one_and_shuffle_who_is_popular():
    weights = popularity_weights(8, "zipf", 1.1, random.Random(3))
    assert sum(weights) == pytest.approx(1.0)
    tops = {
        max(range(8), key=popularity_weights(8, "zipf", 1.1, random.Random(seed)).__getitem__) for seed in range(20)
    }
    assert len(tops) > 1  # the most popular adapter is not always adapter 0
    assert popularity_weights(0, "zipf", 1.1, random.Random(0)) == []


def test_popularity_shares_top1_and_top10():
    targets = [0] * 50 + [1] * 30 + list(range(2, 22)) + [None] * 25  # 22 adapters, 100 adapter requests
    pop = popularity_shares(targets, [1 / 22] * 22)
    assert pop["top1_share"] == 0.5 and pop["top10_share"] == pytest.approx(0.88)
    assert pop["base_share"] == 0.2 and pop["num_adapters_used"] == 22
    assert pop["expected_top1_share"] == pytest.approx(1 / 22, abs=1e-4)


def test_base_share_is_exact_and_within_tolerance_at_a_seed():
    targets = choose_targets(1000, [0.5, 0.5], 0.3, random.Random(7))
    assert sum(t is None for t in targets) == 300
    assert choose_targets(5, [], 0.0, random.Random(0)) == [None] * 5  # no adapters: all base
    args = parse_config([*BASE_ARGV, "--num-requests", "200", "--base-share", "0.2", "--seed", "5"])
    plan, _ = plan_workload(args, HF_CONFIG)
    assert sum(p.adapter is None for p in plan) / len(plan) == pytest.approx(0.2, abs=0.01)
    first_half = sum(p.adapter is None for p in plan[:100])
    assert 5 <= first_half <= 35  # spread over the run, not bunched at one end


def test_poisson_gaps_average_one_over_rate():
    times = arrival_times_s(5000, "poisson", 8.0, None, 1.0, random.Random(11))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8.0, rel=0.05)


def test_burst_timing():
    assert arrival_times_s(4, "burst", 1.0, None, 9.0, random.Random(0)) == [0.0] * 4
    assert arrival_times_s(7, "burst", 1.0, 3, 0.5, random.Random(0)) == [0, 0, 0, 0.5, 0.5, 0.5, 1.0]


def test_plan_is_reproducible_and_prompts_avoid_special_ids():
    args = parse_config([*BASE_ARGV, "--num-requests", "20", "--input-len", "50", "--popularity", "zipf"])
    plan_a, weights_a = plan_workload(args, HF_CONFIG)
    plan_b, weights_b = plan_workload(args, HF_CONFIG)
    assert plan_a == plan_b and weights_a == weights_b
    ids = {t for p in plan_a for t in p.prompt}
    assert all(len(p.prompt) == 50 for p in plan_a) and ids <= set(range(3, 300))
    assert len(random_prompt(random.Random(0), 10, 4, {0, 1, 2})) == 10


def test_request_body_forces_the_output_length_in_the_servers_schema():
    body = request_body("bench-a0", [5, 6, 7], 8)
    req = CompletionRequest.model_validate(body)
    req.check()
    assert req.max_tokens == req.min_tokens == 8 and req.ignore_eos and req.include_usage() and req.stream


def test_percentiles_and_latency_stats_on_known_values():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    values = list(range(1, 101))
    assert percentile(values, 95) == pytest.approx(95.05) and percentile(values, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0 and percentile([], 50) is None
    assert latency_stats([1, 2, 3, 4]) == {"mean": 2.5, "p50": 2.5, "p95": 3.85, "p99": 3.97}
    assert latency_stats([]) == {"mean": None, "p50": None, "p95": None, "p99": None}


def test_jain_index_on_known_values():
    assert jain_index([3, 3, 3]) == pytest.approx(1.0)
    assert jain_index([1, 0, 0]) == pytest.approx(1 / 3)
    assert jain_index([1, 2]) == pytest.approx(0.9)
    assert jain_index([]) is None and jain_index([0, 0]) is None


def test_fairness_leaves_out_the_base_model():
    rows = [
        {"adapter": None, "mean_tpot_ms": 100.0},
        {"adapter": 0, "mean_tpot_ms": 10.0},
        {"adapter": 1, "mean_tpot_ms": 20.0},
        {"adapter": 2, "mean_tpot_ms": None},
    ]
    fair = fairness(rows)
    assert fair["num_adapters"] == 2 and fair["jain_index"] == 0.9 and fair["max_min_ratio"] == 2.0


def _lines(token_times: list[float]) -> list[tuple[str, float]]:
    lines = [(f'data: {{"choices":[{{"text":"","token_ids":[{i}]}}]}}', t) for i, t in enumerate(token_times)]
    usage = '{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":' + str(len(token_times)) + "}}"
    return lines + [
        (f"data: {usage}", token_times[-1]),
        ("", token_times[-1]),
        ("data: [DONE]", token_times[-1] + 0.01),
    ]


def test_stream_tally_measures_ttft_tpot_and_tokens():
    tally = StreamTally()
    for line, now in _lines([1.1, 1.2, 1.3, 1.5]):
        tally.feed(line, now)
    result = result_of(PlannedRequest(0, 0.0, 1, [5, 6, 7]), tally, 1.0, 1.6)
    assert result.status == 200 and result.output_tokens == 4 and result.prompt_tokens == 3
    assert result.ttft_ms == pytest.approx(100.0) and result.tpot_ms == pytest.approx(400 / 3)
    assert result.e2e_ms == pytest.approx(600.0)


def test_stream_errors_are_results_with_a_status():
    tally = StreamTally()
    tally.feed('data: {"error":{"message":"gone","code":404}}', 1.0)
    tally.feed("data: [DONE]", 1.1)
    assert result_of(PlannedRequest(0, 0.0, 0, [1]), tally, 0.5, 1.2).status == 404
    cut = StreamTally()
    for line, now in _lines([1.1, 1.2])[:2]:
        cut.feed(line, now)
    result = result_of(PlannedRequest(0, 0.0, 0, [1]), cut, 1.0, 1.3)
    assert result.status == -1 and "DONE" in result.detail


def _results() -> tuple[list[PlannedRequest], list[RequestResult], list[AdapterSpec]]:
    specs = [AdapterSpec("bench-a0", "/a/adapter-0", 4), AdapterSpec("bench-a1", "/a/adapter-1", 8)]
    plan = [PlannedRequest(i, 0.0, t, [1, 2]) for i, t in enumerate([None, 0, 0, 1, 1])]
    results = [
        RequestResult(0, None, 200, 0.0, 1.0, ttft_ms=50, tpot_ms=10, e2e_ms=1000, prompt_tokens=2, output_tokens=8),
        RequestResult(1, 0, 200, 0.0, 1.5, ttft_ms=60, tpot_ms=20, e2e_ms=1500, prompt_tokens=2, output_tokens=8),
        RequestResult(2, 0, 200, 0.5, 2.0, ttft_ms=80, tpot_ms=20, e2e_ms=1500, prompt_tokens=2, output_tokens=8),
        RequestResult(3, 1, 200, 0.5, 1.5, ttft_ms=70, tpot_ms=40, e2e_ms=1000, prompt_tokens=2, output_tokens=7),
        RequestResult(4, 1, 503, 0.5, 0.6, detail="overloaded"),
    ]
    return plan, results, specs


def test_summary_reports_throughput_latency_per_adapter_and_errors():
    plan, results, specs = _results()
    report = summarize({"output_len": 8}, plan, [0.5, 0.5], results, specs, "base")
    assert report["num_completed"] == 4 and report["num_errors"] == 1
    assert report["errors"]["by_status"] == {"503": 1} and report["num_output_len_mismatches"] == 1
    assert report["duration_s"] == 2.0
    assert report["throughput"] == {"requests_per_s": 2.0, "output_tokens_per_s": 15.5, "total_tokens_per_s": 19.5}
    assert report["ttft_ms"]["mean"] == 65.0 and report["by_kind"]["base"]["tpot_ms"]["p50"] == 10.0
    rows = {row["model"]: row for row in report["per_adapter"]}
    assert list(rows) == ["base", "bench-a0", "bench-a1"]
    assert rows["bench-a0"]["num_requests"] == 2 and rows["bench-a0"]["mean_tpot_ms"] == 20.0
    assert rows["bench-a1"]["num_errors"] == 1 and rows["bench-a1"]["output_tokens_per_s"] == 3.5
    assert report["fairness"]["max_min_ratio"] == 2.0 and report["fairness"]["jain_index"] == 0.9
    assert report["popularity"]["top1_share"] == 0.5 and report["popularity"]["base_share"] == 0.2
    json.dumps(report)  # serialisable as is


def _png_chunks(png: bytes) -> dict[bytes, bytes]:
    assert png.startswith(PNG_SIGNATURE)
    chunks, pos = {}, len(PNG_SIGNATURE)
    while pos < len(png):
        (length,), kind = struct.unpack(">I", png[pos : pos + 4]), png[pos + 4 : pos + 8]
        data = png[pos + 8 : pos + 8 + length]
        assert struct.unpack(">I", png[pos + 8 + length : pos + 12 + length])[0] == zlib.crc32(kind + data)
        chunks[kind] = chunks.get(kind, b"") + data
        pos += 12 + length
    return chunks


def _panels() -> list:
    plan, results, specs = _results()
    report = summarize({"output_len": 8}, plan, [0.5, 0.5], results, specs, "base")
    return plot_panels(results, report["per_adapter"])


def test_plot_panels_hold_the_cdfs_by_kind_and_the_mean_tpot_bars():
    ttft, tpot, bars = _panels()
    assert ttft.series == {"base": [50], "adapter": [60, 80, 70]}  # the 503 is left out
    assert tpot.series == {"base": [10], "adapter": [20, 20, 40]}
    assert bars.bars == [("B", 10.0), ("0", 20.0), ("1", 40.0)] and bars.colors[0] != bars.colors[1]


def test_plot_is_a_png_that_decodes_to_its_size(tmp_path):
    path = tmp_path / "plots" / "report.png"
    assert write_png(str(path), _panels())
    png = path.read_bytes()
    chunks = _png_chunks(png)
    width, height, depth, color_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (width, height, depth) == (1800, 500, 8) and color_type in (2, 6)  # 3 panels of 6x5 inches at 100 dpi
    raw = zlib.decompress(chunks[b"IDAT"])
    assert len(raw) == height * (1 + (3 if color_type == 2 else 4) * width) and b"IEND" in chunks
    assert len(png) > 20_000 and len(set(raw)) > 16  # lines, bars and text were drawn


def test_without_matplotlib_no_plot_is_written_and_one_line_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    path = tmp_path / "report.png"
    assert not write_png(str(path), _panels())
    assert not path.exists()
    [line] = capsys.readouterr().err.splitlines()
    assert "matplotlib" in line and "pip install 'ledgerserve[plot]'" in line


def test_workload_file_then_flags_override_it(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(
        json.dumps(
            {
                "num_adapters": 6,
                "ranks": [4, 8],
                "popularity": "zipf",
                "zipf-s": 1.5,
                "num_requests": 40,
                "burst_size": None,
            }
        )
    )
    args = parse_config([*BASE_ARGV, "--workload", str(path), "--num-requests", "9"])
    assert (args.num_adapters, args.ranks, args.popularity, args.zipf_s) == (6, [4, 8], "zipf", 1.5)
    assert args.num_requests == 9 and args.burst_size is None  # the flag wins; null keeps the default
    assert parse_config(BASE_ARGV).num_adapters == 4  # the defaults without a file


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"num_adaptrs": 3}', "unknown field"),
        ('{"workload": "x.json"}', "unknown field"),
        ("[1, 2]", "JSON object"),
        ('{"num_requests": ', "cannot read"),
        ('{"ranks": {"a": 1}}', "unusable"),
        ('{"num_requests": "many"}', "invalid int"),
    ],
)
def test_bad_workload_files_are_refused(tmp_path, content, match):
    path = tmp_path / "w.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        parse_config([*BASE_ARGV, "--workload", str(path)])


def test_workload_argv_turns_lists_into_comma_lists():
    assert workload_argv({"ranks": [8, 16], "seed": 3}, ["ranks", "seed"]) == ["--ranks", "8,16", "--seed", "3"]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--num-requests", "0"], "num-requests"),
        (["--base-share", "1.5"], "base-share"),
        (["--popularity", "pareto"], "popularity"),
        (["--arrival", "poisson", "--rate", "0"], "rate"),
        (["--rate", "inf"], "rate"),
        (["--num-adapters", "0"], "base-share 1"),
        (["--ranks", "8,x"], "ranks"),
        (["--ranks", "0"], "ranks"),
        (["--target-modules", "lm_head"], "target-modules"),
        (["--burst-size", "0"], "burst-size"),
        (["--zipf-s", "0"], "zipf-s"),
        (["--output-len", "0"], "output-len"),
        (["--unknown-flag", "1"], "unrecognized"),
    ],
)
def test_bad_arguments_raise_a_clear_value_error(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_config([*BASE_ARGV, *argv])


def test_missing_dirs_are_refused():
    with pytest.raises(ValueError, match="model-dir"):
        parse_config(["--base-url", "http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="adapter-dir"):
        parse_config(["--base-url", "http://127.0.0.1:1", "--model-dir", "/m"])
    parse_config(["--base-url", "http://127.0.0.1:1", "--model-dir", "/m", "--num-adapters", "0", "--base-share", "1"])
    with pytest.raises(ValueError, match="config"):
        main(BASE_ARGV)  # /nonexistent/config.json


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000"])
def test_refuses_non_loopback_hosts(url):
    with pytest.raises(ValueError, match="non-loopback"):
        main(["--base-url", url, "--model-dir", "/m", "--adapter-dir", "/a"])
