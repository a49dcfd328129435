"""The engine's gauges, read from the core's state in one place: the `EngineStats` the shell
publishes after each input, and what tests and replay read (derived from logged state, so not logged)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ledgerserve.shared import events as ev

if TYPE_CHECKING:
    from ledgerserve.scheduler_proc.core.core import Core


def engine_stats(
    core: Core, adapter_rows: list[ev.AdapterRow] | None = None, lora_wait_ms: float = 0.0
) -> ev.EngineStats:
    """The core's gauges now. `adapter_rows` and `lora_wait_ms` come from the shell's fold of
    the log (scheduler_proc.views.adapter_stats); block gauges are 0 until capacity is known.
    A deferred eviction is an unregistered version that requests still hold."""
    scheduler, adapters = core.scheduler, core.adapters
    blocks = scheduler.block_manager if scheduler.is_ready else None
    return ev.EngineStats(
        step=core.step,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_free_blocks=blocks.num_free_blocks if blocks is not None else 0,
        num_total_blocks=blocks.num_total_blocks if blocks is not None else 0,
        num_pinned_slots=adapters.slots.num_pinned,
        num_deferred_evictions=sum(not version.is_registered for version in adapters.versions.values()),
        num_cached_blocks=blocks.num_cached_blocks if blocks is not None else 0,
        num_loading_slots=adapters.slots.num_loading,
        num_cpu_tier_versions=len(adapters.cpu_last_used_step),
        cpu_tier_bytes=adapters.cpu_tier_bytes,
        num_lora_wait_steps=scheduler.num_lora_wait_steps,
        adapter_rows=adapter_rows if adapter_rows is not None else [],
        num_used_slots=adapters.slots.num_used,
        lora_wait_ms=lora_wait_ms,
        num_available_blocks=blocks.num_available_blocks if blocks is not None else 0,
    )
