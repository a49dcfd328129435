"""The records of `adapter_stats.AdapterStats`: what it folds the event log into (one
adapter's figures since its registration, a completed slot load, a request's wait for its
adapter), and the state it follows on the way (versions, loads in progress, live requests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SOURCE_TIERS = ("cpu", "disk")


@dataclass(frozen=True)
class LoadRecord:
    """A slot load done on every rank: the slowest rank's duration; "disk" if any rank read the files."""

    name: str
    version_id: int
    source_tier: str
    duration_ms: float


@dataclass(frozen=True)
class ReqWait:
    """An adapter request's wait for its adapter. `hit`: its version was ready from its arrival
    to its first plan (None: not planned yet, or never). `wait_ms` None: the log has no times."""

    req_id: str
    name: str
    hit: bool | None
    wait_steps: int
    wait_ms: float | None

    def to_json(self) -> dict[str, Any]:
        return {
            "req_id": self.req_id,
            "adapter": self.name,
            "hit": self.hit,
            "wait_steps": self.wait_steps,
            "wait_ms": _round(self.wait_ms),
        }


@dataclass
class AdapterFigures:
    name: str
    version_id: int  # the current version
    registration: int  # which registration of the name these count since
    pinned: bool = False
    num_running: int = 0
    num_waiting: int = 0
    num_loads: dict[str, int] = field(default_factory=dict)  # slot loads by source tier
    load_ms_total: float = 0.0
    load_ms_max: float = 0.0
    num_stagings: int = 0  # into the CPU tier, done on every rank
    num_hits: int = 0
    num_misses: int = 0
    wait_steps: int = 0  # summed over the misses
    wait_ms: float = 0.0  # summed over the misses whose wait the log times
    num_timed_waits: int = 0
    num_prompt_tokens: int = 0  # of finished requests
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def num_loads_total(self) -> int:
        return sum(self.num_loads.values())

    def add_load(self, record: LoadRecord) -> None:
        self.num_loads[record.source_tier] = self.num_loads.get(record.source_tier, 0) + 1
        self.load_ms_total += record.duration_ms
        self.load_ms_max = max(self.load_ms_max, record.duration_ms)

    def add_wait(self, wait: ReqWait) -> None:
        """A request's first plan: a hit, or a miss and its wait."""
        if wait.hit:
            self.num_hits += 1
            return
        self.num_misses += 1
        self.wait_steps += wait.wait_steps
        if wait.wait_ms is not None:
            self.wait_ms += wait.wait_ms
            self.num_timed_waits += 1

    def to_json(self, tier: str) -> dict[str, Any]:
        num_loads = self.num_loads_total
        return {
            "adapter": self.name,
            "version_id": self.version_id,
            "tier": tier,
            "pinned": self.pinned,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "loads": {tier_name: self.num_loads.get(tier_name, 0) for tier_name in SOURCE_TIERS},
            "load_ms": {
                "count": num_loads,
                "total": _round(self.load_ms_total),
                "mean": _round(self.load_ms_total / num_loads if num_loads else 0.0),
                "max": _round(self.load_ms_max),
            },
            "num_stagings": self.num_stagings,
            "slot_hits": self.num_hits,
            "slot_misses": self.num_misses,
            "wait_steps": self.wait_steps,
            "wait_ms": _round(self.wait_ms) if self.num_timed_waits else None,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_cached_tokens": self.num_cached_tokens,
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


@dataclass
class VersionState:
    """What the fold knows of one adapter version."""

    version_id: int
    name: str
    registration: int  # which registration of the name it belongs to
    is_current: bool = True
    slot: int = -1  # the slot it was assigned, -1: none
    is_ready: bool = False  # that slot is loaded on every rank
    num_readies: int = 0  # times it became ready
    ready_step: int = 0  # planned steps when it last became ready
    ready_time_s: float = 0.0  # wall clock of that load's end (0: not in the log)
    in_cpu_tier: bool = False  # the core keeps it in the CPU tier
    staged_ranks: list[int] = field(default_factory=list)
    num_reqs: int = 0  # live requests of it


@dataclass
class PendingLoad:
    """A load not yet reported done by every rank."""

    ranks: list[int] = field(default_factory=list)
    source_tier: str = "cpu"
    duration_ms: float = 0.0
    end_time_s: float = 0.0


@dataclass
class ReqState:
    """A live adapter request, as the fold follows it."""

    req_id: str
    name: str
    version_id: int
    registration: int
    arrival_step: int
    arrival_time_s: float
    num_prompt_tokens: int
    was_ready: bool  # its version was ready at arrival
    num_readies: int  # the version's readies at arrival
    is_running: bool = False
    wait: ReqWait | None = None  # set at its first plan
    num_cached_tokens: int = 0
