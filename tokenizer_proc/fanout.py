"""`n` choices per request: n engine requests run side by side, merged back by index. Prompt
logprobs are the same for every choice: choice 0 alone asks the engine for them (the others
may then use the prefix cache), and the responses copy them to every choice."""

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


def total_usage(runs: Sequence[RequestRun]) -> Usage:
    """The prompt counted once; completion tokens summed over the choices."""
    usage = Usage(num_prompt_tokens=runs[0].usage.num_prompt_tokens)
    usage.num_output_tokens = sum(run.usage.num_output_tokens for run in runs)
    usage.num_cached_tokens = max(run.usage.num_cached_tokens for run in runs)
    return usage


async def collect_all(runs: Sequence[RequestRun]) -> list[Delta]:
    """Each run's whole output; the first failure cancels (and so aborts) the others."""
    tasks = [asyncio.ensure_future(collect(run)) for run in runs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        await _cancel(tasks)


async def merged(runs: Sequence[RequestRun], choice_0_first: bool = False) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) as each run produces them; stopping early aborts every run. With
    `choice_0_first`, the other choices' deltas wait until choice 0's first one (which carries
    the prompt logprobs every choice's first chunk shows) has gone out."""
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()
    tasks = [asyncio.ensure_future(_pump(index, run, queue)) for index, run in enumerate(runs)]
    held: list[tuple[int, Delta]] | None = [] if choice_0_first else None
    try:
        remaining = len(runs)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is not None and held is not None and index != 0:
                held.append((index, item))
                continue
            if item is not None:
                yield index, item
            if held is not None and index == 0:  # choice 0's first delta, or its end
                for pair in held:
                    yield pair
                held = None
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
