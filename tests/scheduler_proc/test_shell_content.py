"""The scheduler's shell (SchedulerShell.handle, fake sockets): what an adapter op changed in the
registry goes to the HTTP process, unlogged, before the op's reply."""

from __future__ import annotations

import dataclasses

from ledgerserve.scheduler_proc.core import Core, CoreConfig
from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import EventLogReader
from tests.scheduler_proc.logtools import ENGINE
from tests.scheduler_proc.test_log_writes import make_shell


def test_registry_changes_go_before_the_reply_and_stay_out_of_the_log(tmp_path):
    shell = make_shell(tmp_path)
    shell.core = Core(dataclasses.replace(CoreConfig.from_engine(ENGINE), enable_lora=True))
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
