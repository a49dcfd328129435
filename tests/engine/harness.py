"""Run the scheduler core and one model runner in-process (ledgerserve.engine), with no IPC: the
same events the processes exchange. For parity tests against transformers/PEFT."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ledgerserve.engine import Engine
from ledgerserve.scheduler_proc.core.core import Core
from ledgerserve.shared import events
from ledgerserve.shared.config import EngineConfig
from ledgerserve.worker_proc.runner import ModelRunner


@dataclass
class EngineRun:
    outputs: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    finish_reasons: dict[str, str] = field(default_factory=dict)
    decisions: list[events.Event] = field(default_factory=list)

    def count(self, kind: type) -> int:
        return sum(isinstance(d, kind) for d in self.decisions)


def run_engine(
    config: EngineConfig, arrivals: list[events.RequestArrived], max_steps: int = 10_000
) -> tuple[EngineRun, Core]:
    engine = Engine(config, ModelRunner(config, rank=0))
    decisions = list(engine.ready_decisions)
    for arrived in arrivals:
        decisions += engine.apply(arrived)
    decisions += engine.run_until_idle(max_steps)
    run = EngineRun()
    _collect(run, decisions)
    return run, engine.core


def _collect(run: EngineRun, decisions: list[events.Event]) -> None:
    run.decisions.extend(decisions)
    for d in decisions:
        if isinstance(d, events.TokensEmitted):
            run.outputs[d.req_id].extend(d.new_token_ids)
            if d.finish_reason is not None:
                run.finish_reasons[d.req_id] = d.finish_reason
