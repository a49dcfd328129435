"""A rank's adapter commands (AdapterSlotAssigned, AdapterPrefetched, AdapterEvicted,
AdapterCpuEvicted) and the replies of the loads they start. With overlapped loading a load only
starts with its command and its reply comes from `poll` when it ends; without, the command runs
its load to the end first (the reference path, in command order). A bad adapter fails its load,
never the worker. A ModelRunner holds one as `runner.adapters` (ledgerserve/engine.py's
AdapterPort), beside its steps."""

from __future__ import annotations

import os
import time

from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import (
    AdapterCpuEvicted,
    AdapterEvicted,
    AdapterLoadCompleted,
    AdapterLoadFailed,
    AdapterPrefetched,
    AdapterSlotAssigned,
    Event,
)
from ledgerserve.worker_proc.lora.manager import LoraManager


class AdapterCommands:
    """Carries out adapter commands on one rank's LoRA manager (None: LoRA is off, loads fail)."""

    def __init__(self, config: EngineConfig, rank: int, lora: LoraManager | None) -> None:
        self.config, self.rank, self.lora = config, rank, lora

    def command(self, cmd: Event, arrival_s: float) -> list[Event]:
        """Apply one adapter command -> the replies due now. With overlapped loading a load only
        starts here and its reply comes from `poll`; without, it runs to its end first."""
        if isinstance(cmd, AdapterEvicted):
            self.evict(cmd)
            return []
        if isinstance(cmd, AdapterCpuEvicted):
            self.drop_cpu(cmd)
            return []
        if not isinstance(cmd, (AdapterSlotAssigned, AdapterPrefetched)):
            raise ValueError(f"unexpected command {type(cmd).__name__}")
        if self.lora is None:
            slot = cmd.slot if isinstance(cmd, AdapterSlotAssigned) else -1
            return [
                AdapterLoadFailed(
                    self.rank, slot, cmd.version_id, f"adapter {_name(cmd.path)}: LoRA is not enabled (--enable-lora)"
                )
            ]
        if isinstance(cmd, AdapterPrefetched):
            self.lora.prefetch(cmd.version_id, cmd.path, cmd.content_sha256, arrival_s)
            return self.lora.poll() if not self.config.lora_overlap_loading else []
        if not self.config.lora_overlap_loading:
            return self._load_now(cmd, arrival_s)
        try:
            self.lora.assign(cmd.slot, cmd.version_id, cmd.path, cmd.content_sha256, arrival_s)
        except ValueError as e:
            return [AdapterLoadFailed(self.rank, cmd.slot, cmd.version_id, f"adapter {_name(cmd.path)}: {e}")]
        return []

    def poll(self) -> list[Event]:
        """Replies of loads that ended since the last call (none waits)."""
        return list(self.lora.poll()) if self.lora is not None else []

    def busy(self) -> bool:
        """Whether a load is still under way (its reply, or freeing its CPU pages, is pending)."""
        return self.lora is not None and self.lora.is_busy()

    def load(self, ev: AdapterSlotAssigned) -> AdapterLoadCompleted | AdapterLoadFailed:
        """Load `ev.version_id` into `ev.slot` and wait for it to end; a bad adapter fails the load,
        never the worker, and leaves the slot unusable."""
        if self.lora is None:
            return self.command(ev, time.monotonic())[0]  # type: ignore[return-value]
        return self._load_now(ev, time.monotonic())[-1]  # type: ignore[return-value]

    def evict(self, ev: AdapterEvicted) -> None:
        if self.lora is not None and 0 <= ev.slot < self.config.max_loras:
            self.lora.evict(ev.slot, ev.version_id)

    def drop_cpu(self, ev: AdapterCpuEvicted) -> None:
        if self.lora is not None:
            self.lora.drop_cpu(ev.version_id)

    def _load_now(self, ev: AdapterSlotAssigned, arrival_s: float) -> list[Event]:
        """The load's replies, its own last."""
        assert self.lora is not None
        try:
            replies = self.lora.load_now(ev.slot, ev.version_id, ev.path, ev.content_sha256, arrival_s)
        except ValueError as e:
            return [AdapterLoadFailed(self.rank, ev.slot, ev.version_id, f"adapter {_name(ev.path)}: {e}")]
        own = [r for r in replies if r.slot == ev.slot and r.version_id == ev.version_id]
        return [r for r in replies if r not in own] + own


def _name(path: str) -> str:
    return os.path.basename(os.path.normpath(path)) or path
