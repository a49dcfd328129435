"""The committed logs under tests/data/logs keep decoding and replaying. If this fails
after a format change, bump SCHEMA_VERSION and add a migration; after a deliberate change
of the core's decisions, re-record them with scripts/repo/make_compat_logs.py.

`events-000001-base.log` and `events-000002-lora.log` are schema 1. `events-000003-lora-schema2.log`
is the same adapter workload recorded by the schema 2 code (before overlapped adapter
loading): its header's engine config has no `lora_overlap_loading`, which reads as today's
default (on), so it replays only because schema 2 logs replay with overlapped loading off.
`events-000004-lora-overlap-schema3.log` is a random adapter workload with overlapped loading
and async scheduling over two ranks (ledgerserve/sim/workload.py, seed 5, 200 events,
max_loras 2, lora_max_wait_steps 3), recorded by the schema 3 code (before targeted drains):
it replays only because schema 3 logs replay with targeted drains off.
`events-000005-marked-schema4.log` is the adapter workload with pinned and on-demand loads
(tests/scheduler_proc/test_adapter_random.py's marked driver, seed 5, 200 events, overlapped
loading, max_on_demand_loras 1), recorded by the schema 4 code: its AdapterOpReplied records carry
the whole registry, so it replays only because logs of schema 4 and before replay with
`Policy.op_reply_registry` on; a log written today replays with it off.
`events-000006-marked-schema5.log` is the same workload recorded by the schema 5 code: its
StateDigests hash which ranks had reported each slot load in flight and each CPU-tier staging, so
it replays only because logs of schema 5 and before replay with `Policy.digest_load_reports` on; a log
written today (schema 6) replays with it off."""

from __future__ import annotations

import dataclasses
import glob
import os

import pytest

from ledgerserve.scheduler_proc.core import CoreConfig
from ledgerserve.scheduler_proc.replay import replay
from ledgerserve.scheduler_proc.replay import verify as replay_verify
from ledgerserve.scheduler_proc.replay.diff import diff_logs
from ledgerserve.scheduler_proc.replay.verify import core_config
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import SCHEMA_VERSION, EventLogReader, EventLogWriter, RunScanner
from ledgerserve.sim.workload import run_adapter_workload
from tests.scheduler_proc.logtools import rewrite
from tests.scheduler_proc.test_adapter_random import _marked_driver

LOG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "logs")
LOGS = sorted(glob.glob(os.path.join(LOG_DIR, "events-*.log")))


def _forced(config: CoreConfig, **policy: bool) -> CoreConfig:
    """`config` with some of its policy's behaviours set otherwise than its schema's."""
    return dataclasses.replace(config, policy=dataclasses.replace(config.policy, **policy))


def test_committed_logs_exist():
    names = [os.path.basename(p) for p in LOGS]
    assert names == [
        "events-000001-base.log",
        "events-000002-lora.log",
        "events-000003-lora-schema2.log",
        "events-000004-lora-overlap-schema3.log",
        "events-000005-marked-schema4.log",
        "events-000006-marked-schema5.log",
    ]
    assert [RunScanner(p).header.schema_version for p in LOGS] == [1, 1, 2, 3, 4, 5]


def test_schema_2_log_replays_only_with_overlapped_loading_off(monkeypatch):
    path = os.path.join(LOG_DIR, "events-000003-lora-schema2.log")
    scanner = RunScanner(path)
    assert b"lora_overlap_loading" not in scanner.config_json
    assert EngineConfig.from_json(scanner.config_json).lora_overlap_loading  # today's default ...
    assert not core_config(scanner).lora_overlap_loading  # ... which the schema migration turns off
    assert replay(path).ok
    forced = dataclasses.replace(_forced(core_config(scanner), overlap_loading=True), lora_overlap_loading=True)
    monkeypatch.setattr(replay_verify, "core_config", lambda _: forced)
    assert not replay(path).ok  # the migration is what makes it verify


def test_schema_3_log_replays_only_without_targeted_drains(monkeypatch):
    path = os.path.join(LOG_DIR, "events-000004-lora-overlap-schema3.log")
    scanner = RunScanner(path)
    config = core_config(scanner)
    assert config.lora_overlap_loading and not config.policy.targeted_drain  # the schema migration
    result = replay(path)
    assert result.ok and any(isinstance(e, ev.AdapterLoadCompleted) for _, e in EventLogReader(path))
    forced = _forced(config, targeted_drain=True)
    monkeypatch.setattr(replay_verify, "core_config", lambda _: forced)
    assert not replay(path).ok  # the migration is what makes it verify


def test_schema_4_log_replays_only_with_the_registry_in_op_replies(monkeypatch):
    path = os.path.join(LOG_DIR, "events-000005-marked-schema4.log")
    config = core_config(RunScanner(path))
    assert config.policy.op_reply_registry  # the schema migration
    replies = [e for _, e in EventLogReader(path) if isinstance(e, ev.AdapterOpReplied) and e.code == 200]
    assert max(len(r.adapters) for r in replies) >= 3 and any(i.pinned for r in replies for i in r.adapters)
    assert replay(path).ok
    forced = _forced(config, op_reply_registry=False)
    monkeypatch.setattr(replay_verify, "core_config", lambda _: forced)
    assert not replay(path).ok  # the migration is what makes it verify


def test_todays_log_replays_without_the_registry_in_op_replies(tmp_path, monkeypatch):
    """The same workload recorded now: schema 5, op replies without the registry, and it verifies."""
    engine = EngineConfig.from_json(RunScanner(os.path.join(LOG_DIR, "events-000005-marked-schema4.log")).config_json)
    writer = EventLogWriter(str(tmp_path), engine.to_json(), run_id="marked")
    d = _marked_driver(5, True, max_on_demand_loras=1, log=writer)
    run_adapter_workload(d, 5, num_events=200, marks=True)
    writer.append(ev.LogClosed("done"))
    writer.close()
    scanner = RunScanner(writer.path)
    assert scanner.header.schema_version == SCHEMA_VERSION == 6 and not core_config(scanner).policy.op_reply_registry
    replies = [e for _, e in EventLogReader(writer.path) if isinstance(e, ev.AdapterOpReplied)]
    assert len(replies) > 20 and all(r.adapters == [] for r in replies)
    assert replay(writer.path).ok
    forced = _forced(core_config(scanner), op_reply_registry=True)
    monkeypatch.setattr(replay_verify, "core_config", lambda _: forced)
    assert not replay(writer.path).ok


def test_schema_5_log_replays_only_with_load_reports_in_its_digests(monkeypatch):
    path = os.path.join(LOG_DIR, "events-000006-marked-schema5.log")
    config = core_config(RunScanner(path))
    assert config.policy.digest_load_reports and not config.policy.op_reply_registry  # the schema migrations
    staged = [e for _, e in EventLogReader(path) if isinstance(e, ev.AdapterLoadCompleted) and e.slot == -1]
    assert staged  # CPU-tier stagings reported between plans
    assert replay(path).ok
    forced = _forced(config, digest_load_reports=False)
    monkeypatch.setattr(replay_verify, "core_config", lambda _: forced)
    assert not replay(path).ok  # the migration is what makes it verify


@pytest.mark.parametrize("path", LOGS, ids=os.path.basename)
def test_committed_log_decodes_and_verifies(path):
    records = list(EventLogReader(path, repair=False))
    assert [seq for seq, _ in records] == list(range(1, len(records) + 1))
    assert isinstance(records[-1][1], ev.LogClosed)
    result = replay(path)
    assert result.ok, result.divergence.describe() if result.divergence else ""
    assert result.num_decisions > 0


@pytest.mark.parametrize("path", LOGS[:3], ids=os.path.basename)
def test_committed_log_diffs_clean_against_its_copy_in_todays_format(path, tmp_path):
    """Records written before fields were added at the end of a struct are the same decisions
    as those written with today's structs (which carry the fields' defaults). (The schema 3
    log was written with today's structs.)"""
    copy = rewrite(path, tmp_path, lambda seq, event: event)
    old_bytes = [bytes(raw) for _, raw in RunScanner(path)]
    new_bytes = [bytes(raw) for _, raw in RunScanner(copy)]
    assert old_bytes != new_bytes  # today's encoding differs: the comparison has work to do
    assert diff_logs(path, copy).decision is None
    assert replay(copy).ok
