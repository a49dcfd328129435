"""Replay an event log: re-feed its inputs into a fresh core and check every decision.

    ledgerserve replay LOG_OR_DIR [--verify] [--until SEQ | --at-step N]
                       [--show queues,slots,namespaces,requests,adapters] [--json]
                       [--diff OTHER_LOG]

LOG_OR_DIR is any segment of a run (the whole run is read) or a directory (its newest run).
Exit status: 0 all decisions match (or the logs agree), 1 divergence (or a difference),
2 the log is corrupt or unreadable, 3 the run's history is trimmed (its first segment is
gone, to retention): what is left is checked, but cannot be verified or shown without the
start of the run. Replay is read-only: a torn tail is skipped, not cut.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

import msgspec

from ledgerserve.scheduler_proc.replay.diff import LogDiff, diff_logs
from ledgerserve.scheduler_proc.replay.figures import FIGURE_SECTIONS, figure_sections, render_figures
from ledgerserve.scheduler_proc.replay.state import SECTIONS, parse_sections, render, sections
from ledgerserve.scheduler_proc.replay.verify import Divergence, HistoryTrimmed, ReplayResult, replay
from ledgerserve.scheduler_proc.views.engine_stats import engine_stats
from ledgerserve.shared.eventlog import LogCorruption
from ledgerserve.shared.events import LogClosed, WorkerReady
from ledgerserve.shared.progress import ready_line

__all__ = ["Divergence", "HistoryTrimmed", "ReplayResult", "main", "replay"]

OK, DIFFERENT, CORRUPT, TRIMMED = 0, 1, 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ledgerserve replay", description="Replay and verify a scheduler event log.")
    add = parser.add_argument
    add("log", help="an events-*.log file (any segment of its run), or a directory: its newest run")
    add("--verify", action="store_true", help="check every logged decision (the default unless --show)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--until", type=int, default=None, metavar="SEQ", help="stop after record SEQ")
    where.add_argument("--at-step", type=int, default=None, metavar="N", help="stop once the core has planned step N")
    where.add_argument("--step", type=int, default=None, dest="at_step", help=argparse.SUPPRESS)  # old spelling
    add(
        "--show",
        default=None,
        metavar="SECTIONS",
        help=f"print the state where the replay stops: 'all', or comma-separated of {', '.join(SECTIONS)}",
    )
    add("--json", action="store_true", help="machine-readable output on stdout")
    add(
        "--diff",
        default=None,
        metavar="OTHER_LOG",
        help="report the first decision where this log and OTHER_LOG differ",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        names = parse_sections(args.show) if args.show is not None else []
    except ValueError as exc:
        parser.error(str(exc))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _diff(args) if args.diff else _replay(args, names)
        except HistoryTrimmed as exc:
            return _report_error(args.json, "trimmed", TRIMMED, str(exc))
        except (
            LogCorruption,
            OSError,
            msgspec.DecodeError,
            msgspec.ValidationError,
            ValueError,
            RecursionError,
        ) as exc:
            return _report_error(args.json, "corrupt", CORRUPT, str(exc))
        finally:
            for warning in caught:
                print(f"ledgerserve replay: warning: {warning.message}", file=sys.stderr)


def _replay(args: argparse.Namespace, names: list[str]) -> int:
    verify = args.verify or not names
    with_figures = any(name in FIGURE_SECTIONS for name in names)
    result = replay(
        args.log, verify=verify, until_seq=args.until, until_step=args.at_step, with_adapter_stats=with_figures
    )
    state = sections(result.core.snapshot(), names)
    num_lora_wait_steps = engine_stats(result.core).num_lora_wait_steps
    figures = figure_sections(result.adapter_stats, names, num_lora_wait_steps) if with_figures else {}
    code = DIFFERENT if result.divergence is not None else OK
    if args.json:
        print(json.dumps({**_result_json(result, verify, state, code), "figures": figures}))
        return code
    if names:
        print("\n".join(render(state) + render_figures(figures)))
    if result.divergence is not None:
        print(result.divergence.describe())
    elif verify:
        tail = " (log ends before the last input's decisions)" if result.truncated_tail else ""
        print(
            f"OK {result.path}: {result.num_inputs} inputs, {result.num_decisions} decisions match, "
            f"step {result.core.step}, {len(result.segments)} segment(s), last seq {result.last_seq}{tail}"
        )
        print(describe_closed(result.closed))
        print(f"tensor parallel: {result.core.config.tensor_parallel_size} rank(s) {result.tp_layout}".rstrip())
        for ready in _ready_ranks(result):
            print(f"  rank {ready.rank}: {ready_line(ready)}")
    return code


def _ready_ranks(result: ReplayResult) -> list[WorkerReady]:
    """Each rank's WorkerReady that the replay took in, by rank."""
    return [result.core.ready[rank] for rank in sorted(result.core.ready)]


def describe_closed(closed: LogClosed | None) -> str:
    if closed is None:
        return "log not closed (the scheduler was killed, or the replay stopped early)"
    died = f" [dead process: {closed.dead_process}" if closed.dead_process else ""
    if died and closed.exit_code is not None:
        died += f", exit code {closed.exit_code}"
    return f"log closed: {closed.reason}{died + ']' if died else ''}"


def _result_json(result: ReplayResult, verify: bool, state: dict[str, Any], code: int) -> dict[str, Any]:
    return {
        "status": "divergence" if code else "ok",
        "exit_code": code,
        "path": result.path,
        "segments": result.segments,
        "verified": verify,
        "last_seq": result.last_seq,
        "step": result.core.step,
        "num_inputs": result.num_inputs,
        "num_decisions": result.num_decisions,
        "truncated_tail": result.truncated_tail,
        "torn_tail": list(result.torn_tail) if result.torn_tail else None,
        "divergence": result.divergence.to_json() if result.divergence else None,
        "closed": _closed_json(result.closed),
        "tensor_parallel_size": result.core.config.tensor_parallel_size,
        "tp_layout": result.tp_layout,
        "ranks": [
            {"rank": r.rank, "num_kv_blocks": r.num_kv_blocks, "num_weight_bytes": r.num_weight_bytes}
            for r in _ready_ranks(result)
        ],
        "state": state,
    }


def _closed_json(closed: LogClosed | None) -> dict[str, Any] | None:
    if closed is None:
        return None
    return {"reason": closed.reason, "dead_process": closed.dead_process, "exit_code": closed.exit_code}


def _diff(args: argparse.Namespace) -> int:
    found: LogDiff = diff_logs(args.log, args.diff)
    code = OK if found.same else DIFFERENT
    if args.json:
        print(json.dumps({"status": "same" if found.same else "different", "exit_code": code, **found.to_json()}))
    else:
        print("\n".join(found.describe()))
    return code


def _report_error(as_json: bool, status: str, code: int, message: str) -> int:
    if as_json:
        print(json.dumps({"status": status, "exit_code": code, "error": message}))
    print(f"ledgerserve replay: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
