"""The committed logs under tests/data/logs keep decoding and replaying. If this fails
after a format change, bump SCHEMA_VERSION and add a migration; after a deliberate change
of the core's decisions, re-record them with scripts/make_compat_logs.py."""

from __future__ import annotations

import glob
import os

import pytest

from scheduler_proc.replay import replay
from shared import events as ev
from shared.eventlog import EventLogReader

LOG_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "logs")
LOGS = sorted(glob.glob(os.path.join(LOG_DIR, "events-*.log")))


def test_committed_logs_exist():
    assert {os.path.basename(p).split("-")[-1] for p in LOGS} == {"base.log", "lora.log"}


@pytest.mark.parametrize("path", LOGS, ids=os.path.basename)
def test_committed_log_decodes_and_verifies(path):
    records = list(EventLogReader(path, repair=False))
    assert [seq for seq, _ in records] == list(range(1, len(records) + 1))
    assert isinstance(records[-1][1], ev.LogClosed)
    result = replay(path)
    assert result.ok, result.divergence.describe() if result.divergence else ""
    assert result.num_decisions > 0
