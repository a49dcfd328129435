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
    the log (scheduler_proc.core.adapter_stats); block gauges are 0 until capacity is known."""
    scheduler, adapters = core.scheduler, core.adapters
    num_free_blocks, num_total_blocks, num_cached_blocks = 0, 0, 0
    if scheduler.is_ready:
        blocks = scheduler.block_manager
        num_free_blocks, num_total_blocks = blocks.num_free_blocks, blocks.num_total_blocks
        num_cached_blocks = blocks.num_cached_blocks
    return ev.EngineStats(
        step=core.step,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_free_blocks=num_free_blocks,
        num_total_blocks=num_total_blocks,
        num_pinned_slots=adapters.num_pinned_slots,
        num_deferred_evictions=adapters.num_deferred_evictions,
        num_cached_blocks=num_cached_blocks,
        num_loading_slots=adapters.num_loading_slots,
        num_cpu_tier_versions=adapters.num_cpu_tier_versions,
        cpu_tier_bytes=adapters.cpu_tier_bytes,
        num_lora_wait_steps=scheduler.num_lora_wait_steps,
        adapter_rows=adapter_rows if adapter_rows is not None else [],
        num_used_slots=adapters.slots.num_used,
        lora_wait_ms=lora_wait_ms,
    )
