#!/usr/bin/env python3
"""Record the small event logs under tests/data/logs that CI replays.

They pin the log format: every committed log must keep decoding. A change that breaks
decoding bumps `shared.eventlog.SCHEMA_VERSION` and brings a migration. A deliberate
change of the core's decisions makes `--verify` diverge on them: re-record with

    python -m scripts.repo.make_compat_logs

and say in the commit why the decisions changed.
"""

from __future__ import annotations

import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from ledgerserve.shared import events as ev  # noqa: E402
from ledgerserve.shared.config import EngineConfig  # noqa: E402
from ledgerserve.shared.eventlog import EventLogWriter  # noqa: E402
from ledgerserve.sim.driver import Driver  # noqa: E402
from ledgerserve.sim.workload import run_adapter_workload, run_workload  # noqa: E402

OUT_DIR = os.path.join(ROOT, "tests", "data", "logs")

# name: (workload, seed, num_events, engine settings). The core's settings come from the
# header's engine config on replay, so they are written there too.
LOGS = {
    "base": (run_workload, 11, 120, dict(max_num_seqs=4, max_num_batched_tokens=16, block_size=4, num_kv_blocks=12)),
    "lora": (
        run_adapter_workload,
        5,
        200,
        dict(
            max_num_seqs=4,
            max_num_batched_tokens=16,
            block_size=4,
            num_kv_blocks=12,
            enable_lora=True,
            max_loras=2,
            max_cpu_loras=3,
        ),
    ),
}


def record(name: str, out_dir: str) -> str:
    workload, seed, num_events, settings = LOGS[name]
    num_kv_blocks = settings.pop("num_kv_blocks")
    engine = EngineConfig(model_dir="compat", served_model_name="compat", max_model_len=32, **settings)
    writer = EventLogWriter(out_dir, engine.to_json(), run_id=name)
    driver = Driver.from_engine(engine, num_kv_blocks, log=writer)  # the core replay derives from the header
    workload(driver, seed, num_events)
    writer.append(ev.LogClosed("recorded by scripts/repo/make_compat_logs.py"))
    writer.close()
    settings["num_kv_blocks"] = num_kv_blocks
    return writer.path


def main() -> int:
    os.makedirs(OUT_DIR, exist_ok=True)
    for old in glob.glob(os.path.join(OUT_DIR, "events-*.log")):
        os.remove(old)
    for name in LOGS:
        print(record(name, OUT_DIR))
    return 0


if __name__ == "__main__":
    sys.exit(main())
