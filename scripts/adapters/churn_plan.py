"""bench_adapter_churn's settings (the full GPU run and the tiny `--quick` one) and how its
workloads are grouped by server flags, so that each server is started once. Pure."""

from __future__ import annotations

from dataclasses import dataclass

SERVER_DEFAULT_MIN_CPU_LORAS = 32  # the server's --max-cpu-loras default is max(32, --max-loras)
PROBE_CASES = ("base", "disk_at_registration", "warm", "cpu_tier", "disk_after_cpu_eviction")
ARRIVALS = ("burst", "poisson")


@dataclass(frozen=True)
class TableSetup:
    """One row group of the serving table: `num_adapters` used uniformly through `max_loras` slots."""

    num_adapters: int
    max_loras: int

    @property
    def label(self) -> str:
        return f"{self.num_adapters}a/{self.max_loras}s"


@dataclass(frozen=True)
class ChurnSettings:
    input_len: int
    output_len: int
    ranks: tuple[int, ...]  # the table's adapters: adapter i has rank ranks[i % len]
    min_cpu_loras: int  # a table server's --max-cpu-loras is max(this, --max-loras)
    probe_reps: int
    probe_rank: int
    touch_input_len: int  # prompt tokens of the requests that only move adapters between tiers
    burst_requests: int
    burst_in_flight: int
    poisson_rate: float
    poisson_requests: int
    table: tuple[TableSetup, ...]
    zipf_adapters: int
    zipf_distinct_weights: int  # distinct weight files; the other directories hard-link them
    zipf_rank: int
    zipf_s: float
    zipf_max_loras: int
    zipf_max_cpu_loras: int
    zipf_requests: int
    zipf_load: float  # the Poisson rate as a share of the single-adapter burst capacity
    read_bandwidth_bytes: int
    load_concurrency: int  # /v1/load_lora_adapter calls in flight while registering a workload's adapters

    @property
    def max_rank(self) -> int:
        return max(*self.ranks, self.probe_rank, self.zipf_rank)

    def cpu_loras(self, max_loras: int) -> int:
        return max(self.min_cpu_loras, max_loras)


FULL = ChurnSettings(
    input_len=256,
    output_len=128,
    ranks=(8, 16),
    min_cpu_loras=SERVER_DEFAULT_MIN_CPU_LORAS,
    probe_reps=5,
    probe_rank=16,
    touch_input_len=16,
    burst_requests=384,
    burst_in_flight=128,
    poisson_rate=10.0,
    poisson_requests=200,
    table=(TableSetup(1, 8), TableSetup(8, 8), TableSetup(16, 8), TableSetup(64, 8), TableSetup(64, 64)),
    zipf_adapters=512,
    zipf_distinct_weights=64,
    zipf_rank=8,
    zipf_s=1.1,
    zipf_max_loras=32,
    zipf_max_cpu_loras=128,
    zipf_requests=400,
    zipf_load=0.7,
    read_bandwidth_bytes=1 << 30,
    load_concurrency=8,
)

QUICK = ChurnSettings(
    input_len=32,
    output_len=4,
    ranks=(4, 8),
    min_cpu_loras=3,
    probe_reps=1,
    probe_rank=8,
    touch_input_len=8,
    burst_requests=12,
    burst_in_flight=6,
    poisson_rate=40.0,
    poisson_requests=8,
    table=(TableSetup(1, 2), TableSetup(2, 2), TableSetup(4, 2), TableSetup(6, 2), TableSetup(6, 6)),
    zipf_adapters=16,
    zipf_distinct_weights=4,
    zipf_rank=4,
    zipf_s=1.1,
    zipf_max_loras=2,
    zipf_max_cpu_loras=4,
    zipf_requests=12,
    zipf_load=0.7,
    read_bandwidth_bytes=32 << 20,
    load_concurrency=4,
)


@dataclass(frozen=True)
class ServerGroup:
    """The workloads that one server start-up serves: same --max-loras and --max-cpu-loras."""

    max_loras: int
    max_cpu_loras: int
    runs_probe: bool
    setups: tuple[TableSetup, ...]
    runs_zipf: bool

    @property
    def label(self) -> str:
        return f"max_loras={self.max_loras},max_cpu_loras={self.max_cpu_loras}"


def server_groups(settings: ChurnSettings) -> list[ServerGroup]:
    """Table setups grouped by their server flags (the probe rides with the first group), then
    the Zipf run: after the setups of a group with its flags if there is one, else in a group
    of its own, last (it needs the single-adapter capacity that the first setup measures)."""
    groups: list[ServerGroup] = []
    for setup in settings.table:
        flags = (setup.max_loras, settings.cpu_loras(setup.max_loras))
        index = next((i for i, g in enumerate(groups) if (g.max_loras, g.max_cpu_loras) == flags), None)
        if index is None:
            groups.append(ServerGroup(*flags, runs_probe=not groups, setups=(setup,), runs_zipf=False))
        else:
            g = groups[index]
            groups[index] = ServerGroup(g.max_loras, g.max_cpu_loras, g.runs_probe, g.setups + (setup,), False)
    zipf_flags = (settings.zipf_max_loras, settings.zipf_max_cpu_loras)
    index = next((i for i, g in enumerate(groups) if (g.max_loras, g.max_cpu_loras) == zipf_flags), None)
    if index is None:
        groups.append(ServerGroup(*zipf_flags, runs_probe=False, setups=(), runs_zipf=True))
    else:
        g = groups[index]
        groups[index] = ServerGroup(g.max_loras, g.max_cpu_loras, g.runs_probe, g.setups, True)
    return groups


def check_settings(settings: ChurnSettings) -> None:
    """What the plan relies on; ValueError naming what does not hold."""
    first = settings.table[0] if settings.table else None
    checks = [
        (first is not None and first.num_adapters == 1, "the first table setup must be the single adapter (capacity)"),
        (
            first is not None and settings.cpu_loras(first.max_loras) >= first.max_loras + 1,
            "the probe's CPU tier must hold an adapter beside a full set of slots",
        ),
        (
            max((s.num_adapters for s in settings.table), default=0)
            >= settings.cpu_loras(first.max_loras if first else 1),
            "the probe needs as many table adapters as its server's CPU tier holds, to evict one from it",
        ),
        (
            1 <= settings.zipf_distinct_weights <= settings.zipf_adapters,
            "zipf_distinct_weights must be in 1..zipf_adapters",
        ),
        (0 < settings.zipf_load <= 1, "zipf_load must be in (0, 1]"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)
