#!/usr/bin/env python3
"""Compare the core's adapter slot policies on the CPU, in logical time, without a GPU.

    python -m scripts.adapters.simulate_adapter_policy                # the table: workloads x policies
    python -m scripts.adapters.simulate_adapter_policy --json out.json --num-requests 200

The real Core is driven by ledgerserve/sim's Driver and its fake worker group
with overlapped loading on: every step takes `step_ms` of logical time and steps run back to
back (async scheduling: step s + 1 is planned while step s runs); every slot load or CPU
staging ends `load_steps` steps after the core decides it, on every rank; while nothing runs,
time jumps to the next arrival or load end. Requests have `prompt_tokens` distinct tokens
(no prefix reuse) and generate exactly `output_tokens` tokens; adapters are chosen uniformly.

Workloads, as in scripts/adapters/bench_adapter_churn.py: Poisson arrivals at `rate_rps`, and a burst
of `burst_requests` sent by a client that keeps `burst_concurrency` in flight (a request's
TTFT starts when the client sends it); 8 adapters, then 16 and 64 through `max_loras` slots.
Policies: `bar` (an aged request with no slot bars every adapter request behind it: schema 3
logs) and `drain` (one slot at a time is drained for it: scheduler_proc/core/drain.py).
Reported per run: TTFT p50 / p99 in steps and ms, output tokens per step and per second of
logical time, slot loads and drains started.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import random
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ledgerserve.scheduler_proc.core.policy import Policy  # noqa: E402
from ledgerserve.shared import events as ev  # noqa: E402
from ledgerserve.shared.sampling import SamplingParams  # noqa: E402
from ledgerserve.sim.driver import Driver  # noqa: E402
from ledgerserve.sim.rank import FakeWorker  # noqa: E402
from ledgerserve.sim.slots import PendingLoad  # noqa: E402
from scripts.serving import serving_report  # noqa: E402

POLICIES = ("bar", "drain")


@dataclass(frozen=True)
class SimSettings:
    step_ms: float = 15.0
    load_steps: int = 1
    max_loras: int = 8
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 8192
    prompt_tokens: int = 256
    output_tokens: int = 128
    lora_max_wait_steps: int = 16
    rate_rps: float = 10.0
    num_requests: int = 400  # Poisson
    burst_requests: int = 384
    burst_concurrency: int = 128
    seed: int = 0


@dataclass(frozen=True)
class Workload:
    name: str  # "poisson" or "burst"
    num_adapters: int


class LeanWorker(FakeWorker):
    """The fake worker without its per-block KV bookkeeping (quadratic in prompt length):
    the plans' token and sampling checks stay."""

    def check_cached_kv(self, req_id: str, num_computed: int) -> None:
        return None

    def _write_kv(self, req_id: str, num_computed: int, num_scheduled: int) -> None:
        return None


class SimDriver(Driver):
    """The Driver without the per-event integrity pass and decision history (`check` keeps the pass)."""

    def __init__(self, settings: SimSettings, policy: str, check: bool) -> None:
        super().__init__(
            settings.num_kv_blocks,
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            block_size=settings.block_size,
            max_model_len=settings.prompt_tokens + settings.output_tokens,
            enable_lora=True,
            max_loras=settings.max_loras,
            max_cpu_loras=4 * settings.max_loras + 64,
            lora_max_wait_steps=settings.lora_max_wait_steps,
            max_steps_in_flight=2,
            lora_overlap_loading=True,
            policy=Policy.current() if policy == "drain" else Policy.for_schema(3),  # schema 3: aging only
            ready=False,
        )
        self.group.worker = LeanWorker(settings.block_size, self.group.slots)
        self.check = check
        self.num_loads = 0
        self.num_drains = 0
        self.ready()

    def send(self, event: Any) -> list[Any]:
        decisions = self.core.apply(event)
        for decision in decisions:
            self._observe(decision)
            self.num_loads += isinstance(decision, ev.AdapterSlotAssigned)
            self.num_drains += isinstance(decision, ev.AdapterDrainStarted)
        if self.check:
            self.core.check_integrity()
        return decisions


class Clock:
    """Logical time: when each step in flight ends, when each pending load ends, who arrives when."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.now_ms = 0.0
        self.gpu_free_ms = 0.0
        self.step_ends: deque[float] = deque()  # one per plan in flight, oldest first
        self.load_ends: list[tuple[float, int, PendingLoad]] = []  # heap
        self.known_loads: set[PendingLoad] = set()
        self.num_events = 0

    def note(self, d: SimDriver) -> None:
        """Give new plans their end time (after the GPU's current work) and new loads theirs."""
        for _ in range(d.num_in_flight - len(self.step_ends)):
            start_ms = max(self.now_ms, self.gpu_free_ms)
            self.gpu_free_ms = start_ms + self.settings.step_ms
            self.step_ends.append(self.gpu_free_ms)
        for load in d.pending_loads:
            if load not in self.known_loads:
                self.known_loads.add(load)
                self.num_events += 1
                end_ms = self.now_ms + self.settings.load_steps * self.settings.step_ms
                heapq.heappush(self.load_ends, (end_ms, self.num_events, load))


def arrivals(settings: SimSettings, workload: Workload) -> tuple[list[float], list[int]]:
    """Arrival times (ms; the burst's are filled in by the client as it goes) and adapters."""
    rng = random.Random(settings.seed * 1000 + workload.num_adapters)
    num = settings.num_requests if workload.name == "poisson" else settings.burst_requests
    adapters = [rng.randrange(workload.num_adapters) for _ in range(num)]
    if workload.name == "burst":
        return [0.0] * num, adapters
    times, t = [], 0.0
    for _ in range(num):
        t += rng.expovariate(settings.rate_rps) * 1000.0
        times.append(t)
    return times, adapters


def simulate(settings: SimSettings, workload: Workload, policy: str, check: bool = False) -> dict[str, Any]:
    d = SimDriver(settings, policy, check)
    for i in range(workload.num_adapters):
        d.load(f"adapter-{i}")
    clock = Clock(settings)
    clock.note(d)
    times, adapters = arrivals(settings, workload)
    limit = settings.burst_concurrency if workload.name == "burst" else len(times)
    sent_ms: dict[str, float] = {}
    ttft_ms: dict[str, float] = {}
    num_sent = num_tokens = 0
    while len(ttft_ms) < len(times) or d.core.has_unfinished():
        num_live = num_sent - sum(1 for req_id in sent_ms if req_id in d.finish_reasons)
        next_arrival = times[num_sent] if num_sent < len(times) and num_live < limit else None
        if workload.name == "burst" and next_arrival is not None:
            next_arrival = clock.now_ms
        step_end = clock.step_ends[0] if clock.step_ends else None
        load_end = clock.load_ends[0][0] if clock.load_ends else None
        if (
            step_end is not None
            and (load_end is None or step_end <= load_end)
            and (next_arrival is None or step_end <= next_arrival)
        ):
            clock.now_ms = clock.step_ends.popleft()
            out = d.complete()
        elif load_end is not None and (next_arrival is None or load_end <= next_arrival):
            clock.now_ms, _, load = heapq.heappop(clock.load_ends)
            out = d.send(d.worker.slots.finish(load, None))
        elif next_arrival is not None:
            clock.now_ms = max(clock.now_ms, next_arrival)
            req_id = f"r{num_sent}"
            prompt = [1000 + (num_sent * settings.prompt_tokens + j) % 50_000 for j in range(settings.prompt_tokens)]
            sampling = SamplingParams(max_tokens=settings.output_tokens, ignore_eos=True)
            name = f"adapter-{adapters[num_sent]}"
            d.worker.req_versions[req_id] = d.registry[name]
            sent_ms[req_id] = clock.now_ms
            num_sent += 1
            out = d.send(ev.RequestArrived(req_id, prompt, sampling, lora_name=name))
        else:
            raise RuntimeError(f"the core is stuck at {clock.now_ms} ms: {len(d.core.scheduler.waiting)} waiting")
        for x in out:
            if isinstance(x, ev.TokensEmitted) and x.new_token_ids:
                num_tokens += len(x.new_token_ids)
                ttft_ms.setdefault(x.req_id, clock.now_ms - sent_ms[x.req_id])
        clock.note(d)
    return _summary(settings, d, list(ttft_ms.values()), num_tokens, clock.now_ms)


def _summary(
    settings: SimSettings, d: SimDriver, ttft_ms: list[float], num_tokens: int, end_ms: float
) -> dict[str, Any]:
    num_steps = len(d.plans)
    p50, p99 = percentile(ttft_ms, 50), percentile(ttft_ms, 99)
    return {
        "ttft_p50_ms": round(p50, 1),
        "ttft_p99_ms": round(p99, 1),
        "ttft_p50_steps": round(p50 / settings.step_ms, 1),
        "ttft_p99_steps": round(p99 / settings.step_ms, 1),
        "tokens_per_step": round(num_tokens / max(num_steps, 1), 2),
        "tok_per_s": round(num_tokens / (end_ms / 1000.0), 1) if end_ms else 0.0,
        "num_steps": num_steps,
        "num_slot_loads": d.num_loads,
        "num_drains": d.num_drains,
    }


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); 0 for no values."""
    return serving_report.percentile(values, q) or 0.0


def run_table(
    settings: SimSettings, workloads: list[Workload], policies: list[str], check: bool
) -> list[dict[str, Any]]:
    rows = []
    for workload in workloads:
        for policy in policies:
            result = simulate(settings, workload, policy, check)
            rows.append({"workload": workload.name, "num_adapters": workload.num_adapters, "policy": policy, **result})
            print(_format_row(rows[-1], settings), flush=True)
    return rows


def _format_row(row: dict[str, Any], settings: SimSettings) -> str:
    name = f"{row['workload']:<8} {row['num_adapters']:>2} adapters / {settings.max_loras} slots  {row['policy']:<5}"
    ttft = (
        f"TTFT p50 {row['ttft_p50_ms']:>8.0f} ms ({row['ttft_p50_steps']:>6.1f} steps)  "
        f"p99 {row['ttft_p99_ms']:>8.0f} ms ({row['ttft_p99_steps']:>6.1f} steps)"
    )
    moves = f"loads {row['num_slot_loads']:>4}  drains {row['num_drains']:>4}"
    rest = f"{row['tokens_per_step']:>6.2f} tok/step {row['tok_per_s']:>7.0f} tok/s  {moves}"
    return f"{name}  {ttft}  {rest}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--adapters", default="8,16,64", help="comma-separated adapter counts")
    add("--workloads", default="poisson,burst")
    add("--policies", default=",".join(POLICIES))
    add("--num-requests", type=int, default=SimSettings.num_requests, help="Poisson requests")
    add("--burst-requests", type=int, default=SimSettings.burst_requests)
    add("--max-wait-steps", type=int, default=SimSettings.lora_max_wait_steps)
    add("--load-steps", type=int, default=SimSettings.load_steps)
    add("--seed", type=int, default=SimSettings.seed)
    add("--check", action="store_true", help="check the core's integrity after every event (slow)")
    add("--json", default=None, metavar="PATH", help="write the rows as JSON")
    args = parser.parse_args(argv)
    settings = dataclasses.replace(
        SimSettings(),
        num_requests=args.num_requests,
        burst_requests=args.burst_requests,
        lora_max_wait_steps=args.max_wait_steps,
        load_steps=args.load_steps,
        seed=args.seed,
    )
    policies = args.policies.split(",")
    if any(p not in POLICIES for p in policies):
        parser.error(f"--policies: choose from {', '.join(POLICIES)}")
    workloads = [Workload(name, int(n)) for name in args.workloads.split(",") for n in args.adapters.split(",")]
    rows = run_table(settings, workloads, policies, args.check)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": dataclasses.asdict(settings), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
