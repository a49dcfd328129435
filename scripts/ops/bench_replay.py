#!/usr/bin/env python3
"""Replay speed: generate synthetic logs (the real core driven by a fake worker, many
requests) of about 10k, 100k and 1M records, then time `replay --verify` on each, pinned
to one core. Prints one JSON object per size: wall and CPU time of the verify alone.

    python -m scripts.ops.bench_replay [--sizes 10000,100000,1000000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ledgerserve.scheduler_proc.core import Core, CoreConfig  # noqa: E402
from ledgerserve.scheduler_proc.replay.verify import replay  # noqa: E402
from ledgerserve.shared import events as ev  # noqa: E402
from ledgerserve.shared.config import EngineConfig  # noqa: E402
from ledgerserve.shared.eventlog import EventLogWriter  # noqa: E402
from ledgerserve.shared.sampling import SamplingParams  # noqa: E402
from ledgerserve.sim.rank import FakeWorker  # noqa: E402

CONFIG = EngineConfig(
    model_dir="bench",
    served_model_name="bench",
    max_model_len=1024,
    max_num_seqs=32,
    max_num_batched_tokens=1024,
    block_size=16,
)
NUM_LIVE = 48  # requests kept arrived (running + waiting)


class Generator:
    def __init__(self, directory: str, name: str, seed: int) -> None:
        self.writer = EventLogWriter(directory, CONFIG.to_json(), run_id=name, fsync="never")
        self.core = Core(CoreConfig.from_engine(CONFIG))
        self.worker = FakeWorker(CONFIG.block_size)
        self.rng = random.Random(seed)
        self.plan: ev.StepPlan | None = None
        self.num_reqs = 0

    def send(self, event: Any) -> None:
        self.writer.append(event)
        for decision in self.core.apply(event):
            self.writer.append(decision)
            if isinstance(decision, ev.StepPlan):
                self.plan = decision

    def run(self, num_events: int) -> str:
        self.send(ev.WorkerReady(0, 4096, 32000, [2], "cpu", "float32"))
        while self.writer.last_seq < num_events:
            while len(self.core.requests) < NUM_LIVE:
                self.arrive()
            if self.plan is not None:
                self.complete()
        self.writer.append(ev.LogClosed("bench"))
        self.writer.close()
        return self.writer.path

    def arrive(self) -> None:
        self.num_reqs += 1
        rng = self.rng
        prompt = [rng.randint(3, 31999) for _ in range(rng.randint(8, 200))]
        sampling = SamplingParams(max_tokens=rng.randint(4, 64))
        self.send(ev.RequestArrived(f"req-{self.num_reqs}", prompt, sampling, arrival_time_s=time.time()))

    def complete(self) -> None:
        plan, self.plan = self.plan, None
        samplers = self.worker.apply(plan)
        sampled = [ev.SampledToken(req_id, self.rng.randint(3, 31999)) for req_id in samplers]
        self.send(ev.StepCompleted(plan.step, 0, sampled))
        self.send(ev.RankDigest(plan.step, 0, 0x1234))


def bench(directory: str, num_events: int) -> dict[str, Any]:
    path = Generator(directory, f"bench{num_events}", seed=num_events).run(num_events)
    start, cpu_start = time.perf_counter(), time.process_time()
    result = replay(path)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    if not result.ok or result.truncated_tail:
        raise RuntimeError(f"bench log {path} did not verify: {result.divergence}")
    return {
        "events": result.last_seq,
        "bytes": sum(os.path.getsize(p) for p in result.segments),
        "steps": result.core.step,
        "seconds": round(seconds, 3),
        "events_per_s": round(result.last_seq / seconds),
        "cpu_seconds": round(cpu_seconds, 3),  # this process only: honest on a busy machine
        "events_per_cpu_s": round(result.last_seq / cpu_seconds),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--dir", default=None, help="where to write the logs (default: a temp dir, removed)")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.dir or tmp
        for size in (int(s) for s in args.sizes.split(",")):
            print(json.dumps(bench(directory, size)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
