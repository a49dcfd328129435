"""Replay an event log: re-feed its inputs into a fresh core and check every decision.

    ledgerserve replay LOG_OR_DIR [--verify] [--show] [--step N]

Exit status: 0 all decisions match, 1 divergence, 2 the log is corrupt or unreadable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from shared import codec
from shared import events as ev
from shared.config import EngineConfig
from shared.eventlog import EventLogReader, LogCorruption, newest_log

from scheduler_proc.core import Core, CoreConfig

SHELL_ONLY = (ev.LogClosed, ev.Shutdown)  # logged by the shell, never produced by the core


@dataclass(frozen=True)
class Divergence:
    seq: int  # the logged record that disagrees (or the next input, when one is missing)
    input_seq: int  # the input whose decisions disagree
    logged: Any | None
    recomputed: Any | None

    def describe(self) -> str:
        lines = [f"divergence at seq {self.seq} (decisions of input seq {self.input_seq}):"]
        lines.append(f"  logged:     {_show(self.logged)}")
        lines.append(f"  recomputed: {_show(self.recomputed)}")
        lines += [f"    {line}" for line in field_diff(self.logged, self.recomputed)]
        return "\n".join(lines)


@dataclass
class ReplayResult:
    path: str
    core: Core
    num_inputs: int = 0
    num_decisions: int = 0  # logged decisions checked against the core
    divergence: Divergence | None = None
    truncated_tail: bool = False  # the log ends before the last input's decisions

    @property
    def ok(self) -> bool:
        return self.divergence is None


def replay(path: str, verify: bool = True, until_step: int | None = None) -> ReplayResult:
    """Raises LogCorruption for a damaged log; returns at the first divergence."""
    reader = EventLogReader(path)
    core = Core(CoreConfig.from_engine(EngineConfig.from_json(reader.config_json)))
    result = ReplayResult(path, core)
    pending: deque[Any] = deque()
    input_seq = 0
    for seq, event in reader:
        if isinstance(event, ev.INPUT_TYPES):
            if verify and pending:
                result.divergence = Divergence(seq, input_seq, None, pending[0])
                return result
            if until_step is not None and core.step >= until_step:
                return result
            pending = deque(core.apply(event))
            input_seq = seq
            result.num_inputs += 1
        elif verify and not isinstance(event, SHELL_ONLY):
            expected = pending.popleft() if pending else None
            if expected is None or codec.encode(expected) != codec.encode(event):
                result.divergence = Divergence(seq, input_seq, event, expected)
                return result
            result.num_decisions += 1
    result.truncated_tail = verify and bool(pending)
    return result


def field_diff(logged: Any, recomputed: Any) -> list[str]:
    if logged is None or recomputed is None or type(logged) is not type(recomputed):
        return []
    return [
        f"{name}: logged {getattr(logged, name)!r}, recomputed {getattr(recomputed, name)!r}"
        for name in logged.__struct_fields__
        if getattr(logged, name) != getattr(recomputed, name)
    ]


def _show(event: Any) -> str:
    if event is None:
        return "(nothing)"
    text = repr(event)
    return text if len(text) <= 400 else text[:400] + "..."


# ---------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ledgerserve replay", description="Replay and verify a scheduler event log.")
    parser.add_argument("log", help="an events-*.log file, or a directory (its newest log is used)")
    parser.add_argument("--verify", action="store_true", help="check every logged decision (the default unless --show)")
    parser.add_argument("--show", action="store_true", help="print the core's state where the replay stops")
    parser.add_argument("--step", type=int, default=None, help="stop once the core has planned this step")
    args = parser.parse_args(argv)
    verify = args.verify or not args.show
    try:
        path = newest_log(args.log) if os.path.isdir(args.log) else args.log
        result = replay(path, verify=verify, until_step=args.step)
    except (LogCorruption, OSError, msgspec.DecodeError) as exc:
        print(f"ledgerserve replay: {exc}", file=sys.stderr)
        return 2
    if args.show:
        print(json.dumps(result.core.snapshot(), indent=2))
    if result.divergence is not None:
        print(result.divergence.describe())
        return 1
    if verify:
        tail = " (log ends before the last input's decisions)" if result.truncated_tail else ""
        print(f"OK {path}: {result.num_inputs} inputs, {result.num_decisions} decisions match, step {result.core.step}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
