"""The serving-sized warm-up batches (worker_proc/warm_up.py): every power of two up to the step's
token budget, base and adapter prompts in both orders, decode rows beside them, inside the pool."""

from ledgerserve.worker_proc.warm_up import NUM_DECODE_ROWS, serving_batches


def _shape(batch):
    return [(r.num_computed_tokens, r.num_scheduled_tokens, r.lora_slot) for r in batch]


def test_serving_batches_fill_each_size_up_to_the_budget():
    batches = serving_batches(16, 10_000, 1024, 1000, lora_slot=3, max_batched_tokens=1000)
    totals = [sum(r.num_scheduled_tokens for r in b) for b in batches]
    assert totals == [64, 64, 128, 128, 256, 256, 512, 512, 1000, 1000]
    for batch in batches:
        assert all(r.samples for r in batch)  # every row reaches its end: the sampler runs too
        assert [s for _, n, s in _shape(batch)[-NUM_DECODE_ROWS:] if n == 1] == [-1, 3]
        prompts = _shape(batch)[:-NUM_DECODE_ROWS]
        assert all(c == 0 and n <= 256 for c, n, _ in prompts)
    assert {_shape(b)[0][2] for b in batches} == {-1, 3}  # a base prompt first, and an adapter's


def test_without_lora_one_order_and_the_pool_bounds_them():
    assert len(serving_batches(16, 10_000, 1024, 1000, lora_slot=-1, max_batched_tokens=256)) == 3
    assert all(r.lora_slot == -1 for b in serving_batches(16, 10_000, 1024, 1000, -1, 256) for r in b)
    small = serving_batches(16, 12, 1024, 1000, lora_slot=0, max_batched_tokens=2048)
    assert small and all(sum(len(r.block_ids) for r in b) <= 12 for b in small)
    assert serving_batches(16, 2, 1024, 1000, lora_slot=0, max_batched_tokens=2048) == []
