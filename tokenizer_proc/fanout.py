"""`n` choices per prompt: n engine requests per prompt run side by side, merged back by index
(prompt i's choice j is choice i * n + j). Prompt logprobs are the same for every choice of a
prompt: its choice 0 alone asks the engine for them (the others may then use the prefix cache),
and the responses copy them to each choice of that prompt."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import msgspec

from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.tokenizer_proc.generation import Delta, RequestRun, Usage, collect

SEED_SPAN = 1 << 64
SEED_LOW = -(1 << 63)


def choice_req_id(req_id: str, index: int, n: int) -> str:
    """The engine request id of choice `index`: `<id>` alone, `<id>-<index>` when n > 1."""
    return req_id if n == 1 else f"{req_id}-{index}"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice i samples with seed + i (wrapped into int64), so choices differ reproducibly; only
    choice 0 computes prompt logprobs."""
    if index == 0:
        return params
    seed = None if params.seed is None else (params.seed + index - SEED_LOW) % SEED_SPAN + SEED_LOW
    return msgspec.structs.replace(params, seed=seed, prompt_logprobs=None)


def total_usage(runs: Sequence[RequestRun], n: int) -> Usage:
    """Runs in groups of n (one prompt's choices): each prompt counted once, completion tokens
    summed over every choice; cached tokens the most any choice of a prompt found, summed over prompts."""
    groups = [runs[start : start + n] for start in range(0, len(runs), n)]
    usage = Usage(num_prompt_tokens=sum(group[0].usage.num_prompt_tokens for group in groups))
    usage.num_output_tokens = sum(run.usage.num_output_tokens for run in runs)
    usage.num_cached_tokens = sum(max(run.usage.num_cached_tokens for run in group) for group in groups)
    return usage


async def collect_all(runs: Sequence[RequestRun]) -> list[Delta]:
    """Each run's whole output; the first failure cancels (and so aborts) the others."""
    tasks = [asyncio.ensure_future(collect(run)) for run in runs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _cancel(tasks)


async def merged(runs: Sequence[RequestRun], group_size: int = 0) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) as each run produces them; stopping early aborts every run. With a
    `group_size` n, the runs are groups of n (one prompt's choices), and the deltas of a group's
    other choices wait until its first choice's first delta (which carries the prompt logprobs
    every choice's first chunk shows) has gone out."""
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(index, run, queue)) for index, run in enumerate(runs)]
    starts = range(0, len(runs), group_size) if group_size else range(0)
    held: dict[int, list[tuple[int, Delta]]] = {start: [] for start in starts}  # group start -> deltas held
    try:
        remaining = len(runs)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            leader = index - index % group_size if group_size else index
            if item is not None and leader != index and leader in held:
                held[leader].append((index, item))
                continue
            if item is not None:
                yield index, item
            if index in held:  # a group's first choice: its first delta, or its end
                for pair in held.pop(index):
                    yield pair
            remaining -= item is None
    finally:
        await _cancel(tasks)


async def _pump(index: int, run: RequestRun, queue: asyncio.Queue) -> None:
    try:
        async for delta in run.deltas():
            queue.put_nowait((index, delta))
    except Exception as exc:  # handed to the consumer, which raises it
        queue.put_nowait((index, exc))
    finally:
        queue.put_nowait((index, None))


async def _cancel(tasks: list[asyncio.Future]) -> None:
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
