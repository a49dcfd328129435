"""Judge one GPU run against the five decode targets (BENCHMARKS.md), from the JSON the benches wrote:
`bench_decode.py --batch-sizes 1,32 --adapters 0,4,32 ...` (TARGETS), `bench_decode.py --e2e`
(E2E) and `bench_peft.py` (PEFT). Prints one line a target and, with `--out`, the same as JSON;
exits 1 if any target is missed, with a message if the reports cannot be judged. The step time
judged is the bench's `step_ms` (wall time a step in the loop); the GPU time alone is printed beside it.

    python -m scripts.repo.check_targets targets.json e2e.json peft.json --out verdict.json
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

from scripts.common.report_files import read_json, write_json

FLOOR_MAX = 1.25  # step time / its bandwidth floor
ADAPTERS_32_MIN = 0.80  # 32-adapter throughput / base throughput, batch 32
ADAPTERS_4_MIN = 0.92  # 4-adapter throughput / base throughput, batch 32
PEFT_MIN = 100.0  # our end-to-end throughput / transformers + PEFT


@dataclass(frozen=True)
class Verdict:
    target: str
    value: float
    limit: float
    met: bool
    detail: str


def _row(results: list[dict], batch: int, adapters: int) -> dict:
    """The last row for (batch, adapters): the bench runs batch 1 with one adapter more than once."""
    rows = [r for r in results if r["batch"] == batch and r["adapters"] == adapters]
    if not rows:
        raise ValueError(f"the targets run has no row for batch {batch} with {adapters} adapters")
    return rows[-1]


def _floor_verdict(name: str, row: dict) -> Verdict:
    ratio = row["step_ms"] / row["floor_ms"]
    detail = (
        f"{row['step_ms']:.3f} ms / floor {row['floor_ms']:.3f} ms"
        f" (GPU alone {row['gpu_ms']:.3f} ms = {row['gpu_ms'] / row['floor_ms']:.3f}x)"
    )
    return Verdict(name, round(ratio, 4), FLOOR_MAX, ratio <= FLOOR_MAX, detail)


def _throughput_verdict(name: str, row: dict, base: dict, limit: float) -> Verdict:
    ratio = row["tok_s"] / base["tok_s"]
    detail = f"{row['tok_s']:.1f} / {base['tok_s']:.1f} tok/s"
    return Verdict(name, round(ratio, 4), limit, ratio >= limit, detail)


def judge(targets: dict, e2e: dict, peft: dict) -> list[Verdict]:
    """The five targets, in the issue's order. Pure: the three reports in, the verdicts out.
    Reports from different GPU models are an error: a target compares figures of one device."""
    devices = {report.get("device") for report in (targets, e2e, peft)}
    if len(devices) != 1:
        raise ValueError(f"the reports come from different devices: {sorted(map(str, devices))}")
    results = targets["results"]
    base_32, adapters_32 = _row(results, 32, 0), _row(results, 32, 32)
    ours, theirs = e2e["tok_s"], peft["tok_s"]
    return [
        _floor_verdict(f"batch 1 step <= {FLOOR_MAX}x floor", _row(results, 1, 0)),
        _floor_verdict(f"batch 32, 32 adapters step <= {FLOOR_MAX}x floor", adapters_32),
        _throughput_verdict(f"batch 32, 32 adapters >= {ADAPTERS_32_MIN}x base", adapters_32, base_32, ADAPTERS_32_MIN),
        _throughput_verdict(
            f"batch 32, 4 adapters >= {ADAPTERS_4_MIN}x base", _row(results, 32, 4), base_32, ADAPTERS_4_MIN
        ),
        Verdict(
            f">= {PEFT_MIN:g}x transformers + PEFT",
            round(ours / theirs, 1),
            PEFT_MIN,
            ours / theirs >= PEFT_MIN,
            f"{ours:.1f} / {theirs:.1f} tok/s",
        ),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("targets")
    ap.add_argument("e2e")
    ap.add_argument("peft")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    try:
        targets = read_json(args.targets, "the targets report")
        verdicts = judge(targets, read_json(args.e2e, "the e2e report"), read_json(args.peft, "the PEFT report"))
    except ValueError as e:
        raise SystemExit(f"check_targets: {e}") from None
    print(f"{targets['device']}, copy bandwidth {targets['copy_bw_GBps']} GB/s")
    for v in verdicts:
        print(f"{'met   ' if v.met else 'MISSED'} {v.target}: {v.value} (limit {v.limit}); {v.detail}")
    if args.out:
        summary = {"device": targets["device"], "copy_bw_GBps": targets["copy_bw_GBps"]}
        write_json(args.out, {**summary, "verdicts": [asdict(v) for v in verdicts]}, indent=1)
    raise SystemExit(0 if all(v.met for v in verdicts) else 1)


if __name__ == "__main__":
    main()
