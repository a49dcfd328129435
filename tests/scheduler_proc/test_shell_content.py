"""The scheduler's shell (SchedulerShell.handle, fake sockets): with `--event-log-content hashed` it
logs what the core saw (digests) and sends token ids; what an adapter op changed in the registry
goes to the HTTP process, unlogged, before the op's reply."""

from __future__ import annotations

import dataclasses

from ledgerserve.scheduler_proc.core import Core, CoreConfig
from ledgerserve.scheduler_proc.redaction import MIN_DIGEST, Redactor
from ledgerserve.scheduler_proc.replay import main as replay_main
from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import EventLogReader
from ledgerserve.shared.sampling import SamplingParams
from tests.scheduler_proc.driver import FakeWorker
from tests.scheduler_proc.logtools import ENGINE
from tests.scheduler_proc.test_log_writes import make_shell

PROMPT = [40009, 40013, 40031, 40037, 40039, 40063]
SAMPLED = [41011, 41017, 41023]  # the last is a stop id of the request


def test_the_shell_logs_digests_and_sends_token_ids(tmp_path):
    shell = make_shell(tmp_path, content=Redactor("hashed"))
    worker, script = FakeWorker(ENGINE.block_size), list(SAMPLED)
    shell.handle(ev.WorkerReady(0, 32, 50000, [2], "cpu", "float32"))
    shell.handle(ev.RequestArrived("r", PROMPT, SamplingParams(max_tokens=8, stop_token_ids=(SAMPLED[-1],))))
    while shell.core.in_flight:
        plan = shell.to_workers[0].sent[-1]
        sampled = [ev.SampledToken(req_id, script.pop(0)) for req_id in worker.apply(plan)]
        worker.record_samples(sampled)  # every token the shell sends back must be the one sampled
        shell.handle(ev.StepCompleted(plan.step, 0, sampled))
    assert shell.to_workers[0].sent[0].new_reqs[0].token_ids == PROMPT
    emitted = [e for e in shell.to_tokenizer.sent if isinstance(e, ev.TokensEmitted)]
    assert [t for e in emitted for t in e.new_token_ids] == SAMPLED
    assert (emitted[-1].finish_reason, emitted[-1].stop_token_id) == ("stop", SAMPLED[-1])
    shell.log.close()
    logged = [e for _, e in EventLogReader(shell.log.path)]
    (arrived,) = [e for e in logged if isinstance(e, ev.RequestArrived)]
    assert all(v >= MIN_DIGEST for v in arrived.prompt_token_ids)
    values = [t.token_id for e in logged if isinstance(e, ev.StepCompleted) for t in e.sampled]
    assert all(v >= MIN_DIGEST for v in values[:-1]) and values[-1] == SAMPLED[-1]  # the stop keeps its id
    assert shell.ledger.content.reqs == {}
    assert replay_main(["--verify", shell.log.path]) == 0


def test_registry_changes_go_before_the_reply_and_stay_out_of_the_log(tmp_path):
    shell = make_shell(tmp_path, core=Core(dataclasses.replace(CoreConfig.from_engine(ENGINE), enable_lora=True)))
    shell.handle(ev.WorkerReady(0, 32, 1000, [2], "cpu", "float32"))
    shell.handle(ev.AdapterLoadRequested("op-1", "a", "/adapters/a", 8, 100, pinned=True))
    shell.handle(ev.AdapterLoadRequested("op-2", "b", "/adapters/b", 8, 100))
    shell.handle(ev.AdapterUnloadRequested("op-3", "a"))
    sent = [e for e in shell.to_tokenizer.sent if isinstance(e, (ev.AdapterRegistryChanged, ev.AdapterOpReplied))]
    assert sent == [
        ev.AdapterRegistryChanged([ev.AdapterInfo("a", 1, "/adapters/a", pinned=True)]),
        ev.AdapterOpReplied("op-1", 200, "", 1),
        ev.AdapterRegistryChanged([ev.AdapterInfo("b", 2, "/adapters/b")]),
        ev.AdapterOpReplied("op-2", 200, "", 2),
        ev.AdapterRegistryChanged([], ["a"]),
        ev.AdapterOpReplied("op-3", 200, "", 1),
    ]
    shell.log.close()
    logged = [type(e) for _, e in EventLogReader(shell.log.path)]
    assert ev.AdapterOpReplied in logged and ev.AdapterRegistryChanged not in logged
    rows = [row for e in shell.to_tokenizer.sent if isinstance(e, ev.EngineStats) for row in e.adapter_rows]
    assert [(row.name, row.pinned) for row in rows][:2] == [("a", True), ("b", False)]  # the pin, from the load
