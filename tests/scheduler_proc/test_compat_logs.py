"""The committed logs under tests/data/logs keep decoding and replaying. If this fails
after a format change, bump SCHEMA_VERSION and add a migration; after a deliberate change
of the core's decisions, re-record them with scripts/make_compat_logs.py."""

from __future__ import annotations

import glob
import os

import pytest

from scheduler_proc.replay import replay
from scheduler_proc.replay_diff import diff_logs
from shared import events as ev
from shared.eventlog import EventLogReader, RunScanner
from tests.scheduler_proc.logtools import rewrite

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


@pytest.mark.parametrize("path", LOGS, ids=os.path.basename)
def test_committed_log_diffs_clean_against_its_copy_in_todays_format(path, tmp_path):
    """Records written before fields were added at the end of a struct are the same decisions
    as those written with today's structs (which carry the fields' defaults)."""
    copy = rewrite(path, tmp_path, lambda seq, event: event)
    old_bytes = [bytes(raw) for _, raw in RunScanner(path)]
    new_bytes = [bytes(raw) for _, raw in RunScanner(copy)]
    assert old_bytes != new_bytes  # today's encoding differs: the comparison has work to do
    assert diff_logs(path, copy).decision is None
    assert replay(copy).ok
