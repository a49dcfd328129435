"""The engine in one process: the scheduler core and one runner, with no sockets.

The core decides; the runner (worker_proc.runner.ModelRunner, or a test's fake) carries out the
commands in the order they were decided, as a worker applies its command stream, and its results go
back into the core as inputs. With a log directory every input and its decisions go through the
scheduler's ledger (scheduler_proc/ledger.py), as in the scheduler process, so `ledgerserve replay
--verify` checks the run.

    engine = Engine(config, ModelRunner(config))
    engine.apply(events.RequestArrived("a", prompt_ids, sampling))
    decisions = engine.run_until_idle()
"""

from __future__ import annotations

import time
from collections import deque
from typing import Protocol

from ledgerserve.scheduler_proc.core import Core, CoreConfig
from ledgerserve.scheduler_proc.ledger import Ledger, Route, route
from ledgerserve.scheduler_proc.redaction import Redactor
from ledgerserve.shared import events
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import EventLogWriter

LOAD_POLL_S = 0.001  # how often run_until_idle looks at adapter loads under way when nothing else is left


class AdapterPort(Protocol):
    """A worker rank's adapter commands (worker_proc.adapter_commands.AdapterCommands)."""

    def command(self, cmd: events.Event, arrival_s: float) -> list[events.Event]: ...

    def poll(self) -> list[events.Event]: ...

    def busy(self) -> bool: ...


class Runner(Protocol):
    """What a worker rank does: ModelRunner has all of it; its adapter commands go through `adapters`."""

    @property
    def adapters(self) -> AdapterPort: ...

    def ready(self) -> events.WorkerReady: ...

    def execute(self, plan: events.StepPlan) -> tuple[events.StepCompleted, events.RankDigest]: ...


class Engine:
    def __init__(self, config: EngineConfig, runner: Runner, log_dir: str = "", run_id: str | None = None) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError(f"the in-process engine runs one rank, not {config.tensor_parallel_size}")
        self.core = Core(CoreConfig.from_engine(config))
        self.runner = runner
        self.commands: deque[events.Event] = deque()  # decided for the worker, not yet carried out; in order
        self.log: EventLogWriter | None = None
        self.ledger: Ledger | None = None  # with a log: the shell's order of record (scheduler_proc/ledger.py)
        if log_dir:
            self.log = EventLogWriter(log_dir, config.to_json(), run_id, fsync=config.event_log_fsync)
            self.ledger = Ledger(self.core, self.log, Redactor(config.event_log_content))
        self.ready_decisions = self.apply(runner.ready())

    def step(self) -> list[events.Event]:
        """One engine step: carry out the commands decided up to the core's next plan (its schedule), run
        that plan on the runner, and apply the results (load replies, the step's tokens and digest) to the
        core, which plans the step after. Returns the decisions they caused."""
        results = self._run_adapter_commands()
        if self.commands:
            completed, digest = self.runner.execute(self.commands.popleft())
            results += [completed, digest]
        results += self.runner.adapters.poll()
        decisions: list[events.Event] = []
        for result in results:
            decisions += self.apply(result)
        return decisions

    def apply(self, event: events.Event) -> list[events.Event]:
        """Log the input, apply it, log the decisions and commit, as the scheduler's shell does; the
        worker's commands among them queue for step(). Returns the decisions."""
        if self.ledger is None:
            decisions = self.core.apply(event)
        else:
            decisions = [routed.decision for routed in self.ledger.apply(event)]
        self.commands.extend(d for d in decisions if route(d) is Route.WORKERS)
        return decisions

    def has_work(self) -> bool:
        """Whether step() may make progress: commands to carry out, or adapter loads under way."""
        return bool(self.commands) or self.runner.adapters.busy()

    def run_until_idle(self, max_steps: int = 10_000) -> list[events.Event]:
        """Step until nothing is left to do; the decisions, in order."""
        decisions: list[events.Event] = []
        num_steps = 0
        while self.has_work():
            if num_steps == max_steps:
                raise RuntimeError(f"the engine did not go idle in {max_steps} steps")
            if self.commands:
                num_steps += 1
            else:
                time.sleep(LOAD_POLL_S)  # only loads under way: their replies come from adapters.poll
            decisions += self.step()
        return decisions

    def close(self, reason: str = "stopped") -> None:
        """End the log with LogClosed, as the shell does when it stops."""
        if self.log is not None:
            self.log.append(events.LogClosed(reason))
            self.log.close()

    def _run_adapter_commands(self) -> list[events.Event]:
        """Carry out the adapter commands ahead of the next plan, in order; their replies due now."""
        replies: list[events.Event] = []
        while self.commands and not isinstance(self.commands[0], events.StepPlan):
            replies += self.runner.adapters.command(self.commands.popleft(), time.monotonic())
        return replies
