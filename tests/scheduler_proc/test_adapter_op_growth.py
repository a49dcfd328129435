"""The event log grows by what each adapter op changes, never by the size of the registry: a
client churning loads and unloads cannot make it grow with the square of its ops (and so push
retention to delete history). The HTTP process's mirror still learns every change."""

from __future__ import annotations

import os

from ledgerserve.scheduler_proc.core import CoreConfig
from ledgerserve.scheduler_proc.replay import replay
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import EventLogReader, EventLogWriter
from tests.scheduler_proc.driver import Driver

NUM_OPS = 500


def _bytes_per_op(tmp_path, num_registered: int) -> float:
    config = EngineConfig(
        model_dir="m",
        served_model_name="m",
        max_model_len=64,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        block_size=4,
        enable_lora=True,
        lora_overlap_loading=False,
    )
    writer = EventLogWriter(str(tmp_path / str(num_registered)), config.to_json(), run_id="ops")
    d = Driver(16, enable_lora=True, max_model_len=64, log=writer)
    assert CoreConfig.from_engine(config) == d.config
    for i in range(num_registered):
        assert d.load(f"adapter-{i:04d}").code == 200
    writer.flush()
    before = os.path.getsize(writer.path)
    for _ in range(NUM_OPS // 2):
        assert d.load("churn").code == 200
        assert d.unload("churn").code == 200
    writer.append(ev.LogClosed("done"))
    writer.close()
    assert replay(writer.path).ok
    replies = [e for _, e in EventLogReader(writer.path) if isinstance(e, ev.AdapterOpReplied)]
    assert len(replies) == num_registered + NUM_OPS and all(r.adapters == [] for r in replies)
    assert len(d.registry_changes) == num_registered + NUM_OPS  # the mirror hears of every op, unlogged
    return (os.path.getsize(writer.path) - before) / NUM_OPS


def test_log_bytes_per_adapter_op_do_not_grow_with_the_registry(tmp_path):
    few, many = _bytes_per_op(tmp_path, 10), _bytes_per_op(tmp_path, 100)
    assert many <= few * 1.02, (few, many)  # the same records, only the op ids' digits may differ
    assert few < 256, few  # an op's input, its registration or unload, its reply
