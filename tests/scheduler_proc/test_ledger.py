"""The scheduler's ledger (scheduler_proc/ledger.py), without sockets: each input is logged before
its decisions, the decisions in the core's order with the bytes that are sent, and each decision
goes to the workers, the HTTP process or nowhere as the event unions say."""

from __future__ import annotations

from ledgerserve.scheduler_proc.core import Core, CoreConfig
from ledgerserve.scheduler_proc.ledger import ROUTES, Ledger, Route
from ledgerserve.scheduler_proc.replay import replay
from ledgerserve.shared import codec
from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import EventLogReader, EventLogWriter
from ledgerserve.shared.sampling import SamplingParams
from tests.scheduler_proc.driver import FakeWorker
from tests.scheduler_proc.logtools import ENGINE

TO_WORKERS = {ev.StepPlan, ev.AdapterSlotAssigned, ev.AdapterEvicted, ev.AdapterCpuEvicted, ev.AdapterPrefetched}
TO_TOKENIZER = {ev.TokensEmitted, ev.RequestRejected, ev.EngineFailed, ev.AdapterOpReplied}


def test_each_decision_type_goes_where_its_channel_takes_it():
    for cls in ev.DECISION_TYPES:
        if cls is ev.Shutdown:  # the shell's own, sent to the workers at close; never the core's
            continue
        expected = Route.WORKERS if cls in TO_WORKERS else Route.TOKENIZER if cls in TO_TOKENIZER else Route.LOG_ONLY
        assert ROUTES.get(cls, Route.LOG_ONLY) is expected, cls.__name__


def test_inputs_are_logged_before_their_decisions_and_sent_as_logged(tmp_path):
    writer = EventLogWriter(str(tmp_path), ENGINE.to_json(), "ledger")
    ledger = Ledger(Core(CoreConfig.from_engine(ENGINE)), writer)
    worker = FakeWorker(ENGINE.block_size)
    expected: list[ev.Event] = []
    inputs = [ev.WorkerReady(0, 32, 1000, [2], "cpu", "float32")]
    inputs += [ev.RequestArrived(f"r{i}", [5] * (3 + i), SamplingParams(max_tokens=3)) for i in range(2)]
    routes: list[Route] = []
    while inputs:
        event = inputs.pop(0)
        routed = ledger.apply(event)
        expected += [event, *(r.decision for r in routed)]
        assert all(r.frame == codec.encode(r.decision) for r in routed)
        routes += [r.route for r in routed]
        for plan in [r.decision for r in routed if r.route is Route.WORKERS]:
            inputs.append(ev.StepCompleted(plan.step, 0, [ev.SampledToken(req, 7) for req in worker.apply(plan)]))
    writer.close()
    assert [e for _, e in EventLogReader(writer.path)] == expected
    assert {Route.WORKERS, Route.TOKENIZER, Route.LOG_ONLY} <= set(routes)
    assert not ledger.core.has_unfinished() and replay(writer.path).ok
