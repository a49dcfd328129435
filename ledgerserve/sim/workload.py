"""Seeded random workloads over the driver (driver.py): arrivals, aborts, scripted EOS, a small pool
so preemption happens; adapter loads, unloads and reloads. The scheduler tests run them (integrity,
determinism, replay), and scripts/repo/make_compat_logs.py records them as the committed logs."""

from __future__ import annotations

import random

from ledgerserve.shared import events as ev
from ledgerserve.sim.driver import Driver
from ledgerserve.sim.group import EOS


def run_workload(d: Driver, seed: int, num_events: int = 60) -> None:
    rng = random.Random(seed)
    num_reqs = 0
    for _ in range(num_events):
        roll = rng.random()
        if roll < 0.35:
            num_reqs += 1
            req_id = f"req-{rng.choice('abcdefgh')}{num_reqs}"
            d.script(req_id, [rng.choice([5, 6, 9, EOS]) for _ in range(rng.randint(0, 6))])
            d.arrive(
                req_id,
                rng.randint(1, 20),
                max_tokens=rng.randint(1, 12),
                min_tokens=rng.randint(0, 2),
                stop_token_ids=(9,) if rng.random() < 0.3 else (),
            )
        elif roll < 0.45 and num_reqs:
            d.abort(f"req-{rng.choice('abcdefgh')}{rng.randint(1, num_reqs)}")
        elif d.in_flight is not None:
            d.complete()
    d.run()


ADAPTERS = ("a", "b", "c", "d")


def run_adapter_workload(d: Driver, seed: int, num_events: int = 80, marks: bool = False) -> None:
    """Base and adapter requests (some for unknown names), aborts, loads, unloads, in-place
    reloads and the odd failed load, over a small pool and few slots. With overlapped
    loading, a moment with no step in flight ends one pending load (the driver's policy).
    `marks`: loads are also pinned or on demand at random (a second generator, so the
    workload without them stays what it was)."""
    rng = random.Random(seed)
    mark_rng = random.Random(seed + 1)
    num_reqs = 0
    for _ in range(num_events):
        roll = rng.random()
        if roll < 0.35:
            num_reqs += 1
            req_id = f"req-{num_reqs}"
            lora = rng.choice((None, None) + ADAPTERS + ("nope",))
            d.script(req_id, [rng.choice([5, 6, EOS]) for _ in range(rng.randint(0, 5))])
            d.arrive(req_id, rng.randint(1, 16), lora=lora, max_tokens=rng.randint(1, 10))
        elif roll < 0.42 and num_reqs:
            d.abort(f"req-{rng.randint(1, num_reqs)}")
        elif roll < 0.52:
            name, inplace = rng.choice(ADAPTERS), rng.random() < 0.6
            kind = mark_rng.choice(("plain", "pinned", "on_demand")) if marks else "plain"
            d.load(name, inplace=inplace, pinned=kind == "pinned", on_demand=kind == "on_demand")
        elif roll < 0.57:
            d.unload(rng.choice(ADAPTERS))
        elif roll < 0.59 and d.registry:
            name = rng.choice(sorted(d.registry))
            d.send(ev.AdapterLoadFailed(0, -1, d.registry[name], "safetensors header truncated"))
        elif d.in_flight is not None:
            d.complete()
        elif d.pending_loads and d.load_policy is not None:
            d.deliver_one()
    d.run()
