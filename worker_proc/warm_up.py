"""Start-up warm-up: the batches a worker runs once before it reports ready, so that the
first real requests do not wait for Triton to compile the prefill, mixed-batch and
sampling kernels (seconds each on a fresh machine; the decode kernels compile while the
CUDA graphs are captured). The batches write KV only into blocks no request holds yet,
and sample with their own seed, so nothing a later request sees changes."""

from __future__ import annotations

from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.requests import ReqState

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, logprobs=2)
# penalties and min_tokens masking; random draws are torch ops only (nothing to compile), and
# would touch the CUDA generators, so the warm-up samples greedily
PENALISED = SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.1, min_tokens=2, logprobs=0)


def warm_up_batches(
    block_size: int, num_blocks: int, max_model_len: int, vocab_size: int, lora_slot: int
) -> list[list[ReqState]]:
    """Batches of (num_computed, num_tokens) shapes a serving step takes: fresh prefills, prefills
    over a cached prefix, one beside a decode row (a mixed batch), and a lone decode row.
    Adapter rows use `lora_slot` (-1: LoRA off). Batches that don't fit the pool or
    max_model_len are left out."""
    shapes = [  # Triton compiles apart for integer arguments divisible by 16: token counts of both kinds
        [(0, block_size + 5, -1, GREEDY), (0, 2 * block_size, lora_slot, GREEDY)],
        [(0, 2 * block_size, -1, GREEDY), (0, block_size, lora_slot, GREEDY)],
        [(block_size, 2 * block_size + 3, -1, PENALISED), (block_size, block_size + 1, lora_slot, PENALISED)],
        [(block_size, 3 * block_size, -1, GREEDY), (block_size, 2 * block_size, lora_slot, GREEDY)],
        [(block_size, block_size + 1, lora_slot, GREEDY)],
    ]
    batches = [_batch(shape, block_size, vocab_size) for shape in shapes]
    return [batch for batch in batches if _fits(batch, num_blocks, max_model_len)]


PROMPT_TOKENS = 256  # the prompt each serving-sized batch is cut into (capped by max_model_len)
NUM_DECODE_ROWS = 2  # decode rows mixed into each serving-sized batch


def serving_batches(
    block_size: int, num_blocks: int, max_model_len: int, vocab_size: int, lora_slot: int, max_batched_tokens: int
) -> list[list[ReqState]]:
    """Batches the size serving steps reach: for each power of two from 64 tokens up to the step's
    token budget, prompts of up to PROMPT_TOKENS tokens filling it (every other one on `lora_slot`)
    beside NUM_DECODE_ROWS decode rows. What a first pass would otherwise pay at these sizes (the
    GEMM kernels of each row count loaded and chosen, the allocator grown, the LoRA and attention
    kernels at long segments) is paid here, once with a base prompt first and once with an adapter's
    (when LoRA is on). Batches that don't fit the pool are left out."""
    sizes, size = [], 64
    while size < max_batched_tokens:
        sizes.append(size)
        size *= 2
    sizes.append(max_batched_tokens)
    prompt_len = max(1, min(PROMPT_TOKENS, max_model_len - 1))
    batches = []
    orders = (-1, lora_slot) if lora_slot >= 0 else (-1,)  # the first prompt's slot; without LoRA, one order
    for total, first_slot in [(total, slot) for total in sizes for slot in orders]:
        prompts = [prompt_len] * ((total - NUM_DECODE_ROWS) // prompt_len)
        prompts += [(total - NUM_DECODE_ROWS) % prompt_len] if (total - NUM_DECODE_ROWS) % prompt_len else []
        slots = [first_slot if i % 2 == 0 else (lora_slot if first_slot == -1 else -1) for i in range(len(prompts))]
        shape = [(0, n, slot, GREEDY) for n, slot in zip(prompts, slots)]
        shape += [(block_size, block_size + 1, lora_slot if i % 2 else -1, GREEDY) for i in range(NUM_DECODE_ROWS)]
        batch = _batch(shape, block_size, vocab_size)
        if _fits(batch, num_blocks, max_model_len):
            batches.append(batch)
    return batches


def _batch(shape: list[tuple[int, int, int, SamplingParams]], block_size: int, vocab_size: int) -> list[ReqState]:
    """(num_computed, num_tokens, lora_slot, sampling) rows on consecutive blocks from block 0; each
    row's prompt is its first block (or all of it, if shorter)."""
    reqs, next_block = [], 0
    for i, (num_computed, num_tokens, lora_slot, sampling) in enumerate(shape):
        num_req_blocks = -(-num_tokens // block_size)
        token_ids = [(7 * i + t) % vocab_size for t in range(num_tokens)]
        block_ids = list(range(next_block, next_block + num_req_blocks))
        num_prompt, num_new = min(num_tokens, block_size), num_tokens - num_computed
        row = (num_prompt, sampling, block_ids, num_computed, num_new, lora_slot)
        reqs.append(ReqState(f"warm-up-{i}", token_ids, *row))
        next_block += num_req_blocks
    return reqs


def _fits(batch: list[ReqState], num_blocks: int, max_model_len: int) -> bool:
    """Whether the batch's blocks fit the pool and each request max_model_len."""
    return sum(len(r.block_ids) for r in batch) <= num_blocks and all(len(r.token_ids) <= max_model_len for r in batch)
