"""The engine's gauges (scheduler_proc.views.engine_stats): one EngineStats read from the core's state,
checked against the queues, the block accounting and the slot table."""

from ledgerserve.scheduler_proc.core.slots import SlotState
from tests.scheduler_proc.driver import Driver


def test_before_capacity_is_known_the_queue_counts_and_no_block_does():
    d = Driver(ready=False)
    d.arrive("a", 4)
    stats = d.engine_stats
    assert (stats.step, stats.num_running, stats.num_waiting) == (0, 0, 1)
    assert (stats.num_free_blocks, stats.num_total_blocks, stats.num_cached_blocks) == (0, 0, 0)


def test_block_gauges_follow_the_block_accounting_through_a_run():
    d = Driver(num_kv_blocks=16, max_num_seqs=1)
    d.arrive("a", 9, max_tokens=2)
    d.arrive("b", list(range(300, 305)), max_tokens=2)  # no prefix shared with a
    while d.in_flight is not None:
        stats, counts = d.engine_stats, d.blocks.block_accounting()
        assert (stats.step, stats.num_running, stats.num_waiting) == (
            d.in_flight.step,
            len(d.core.scheduler.running),
            len(d.core.scheduler.waiting),
        )
        assert (stats.num_free_blocks, stats.num_cached_blocks, stats.num_total_blocks) == (
            counts.num_free,
            counts.num_cached,
            counts.num_total,
        )
        d.complete()
    stats = d.engine_stats
    assert (stats.num_running, stats.num_waiting, stats.num_total_blocks) == (0, 0, 16)
    assert stats.num_cached_blocks == 3 and stats.num_free_blocks == 13  # a's two full blocks, b's one


def test_slot_gauges_count_the_slot_table():
    d = Driver(enable_lora=True, max_loras=2)
    d.load("a")
    d.arrive("a1", 4, lora="a", max_tokens=3)
    slots = d.core.adapters.slots.slots
    stats = d.engine_stats
    assert stats.num_used_slots == sum(slot.state != SlotState.FREE for slot in slots) == 1
    assert stats.num_pinned_slots == 1  # its running request holds it
    d.run()
    assert (d.engine_stats.num_used_slots, d.engine_stats.num_pinned_slots) == (1, 0)  # loaded, idle
