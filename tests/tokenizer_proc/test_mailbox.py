"""A request's mailbox: outputs its reader has not taken merge; order, ends and errors stay."""

from __future__ import annotations

import asyncio
import random

from ledgerserve.shared.events import PromptLogprobs, TokenLogprobs, TokensEmitted
from ledgerserve.tokenizer_proc.mailbox import Mailbox, merged


def _out(ids: list[int], finish: str | None = None, cached: int = 0, logprobs: bool = False) -> TokensEmitted:
    lps = [TokenLogprobs(-float(i)) for i in ids] if logprobs else None
    return TokensEmitted("r", ids, finish, lps, num_prompt_tokens=5, num_cached_tokens=cached)


def _take_all(box: Mailbox) -> list[TokensEmitted | Exception]:
    async def take() -> list[TokensEmitted | Exception]:
        return [await box.get() for _ in range(len(box))]

    return asyncio.run(take())


def test_outputs_waiting_for_the_reader_merge_into_one() -> None:
    box = Mailbox()
    for out in (_out([1], cached=4, logprobs=True), _out([2, 3], logprobs=True), _out([4], "length", logprobs=True)):
        box.put(out)
    [one] = _take_all(box)
    assert one.new_token_ids == [1, 2, 3, 4] and one.finish_reason == "length" and one.num_cached_tokens == 4
    assert [lp.logprob for lp in one.logprobs] == [-1.0, -2.0, -3.0, -4.0]


def test_a_reader_that_keeps_up_gets_each_output() -> None:
    async def run() -> list[list[int]]:
        box, taken = Mailbox(), []
        reader = asyncio.ensure_future(_read_until_finished(box, taken))
        for i in range(5):
            box.put(_out([i], "length" if i == 4 else None))
            await asyncio.sleep(0)  # the reader runs between puts
            await asyncio.sleep(0)
        await reader
        return taken

    assert asyncio.run(run()) == [[0], [1], [2], [3], [4]]


async def _read_until_finished(box: Mailbox, taken: list[list[int]]) -> None:
    while True:
        out = await box.get()
        taken.append(out.new_token_ids)
        if out.finish_reason is not None:
            return


def test_what_must_stay_apart_does() -> None:
    prompt = TokensEmitted("r", [], prompt_logprobs=PromptLogprobs("r", 1, [-1.0], [1]))
    assert merged(_out([1], "stop"), _out([2])) is None  # nothing after the end
    assert merged(prompt, _out([2])) is None and merged(_out([1]), prompt) is None
    assert merged(_out([1], logprobs=True), _out([2])) is None
    box = Mailbox()
    error = RuntimeError("engine failed")
    for item in (_out([1]), error, _out([2]), _out([3])):
        box.put(item)
    taken = _take_all(box)
    assert taken[0].new_token_ids == [1] and taken[1] is error and taken[2].new_token_ids == [2, 3]


def test_random_interleavings_keep_every_token_in_order() -> None:
    rng = random.Random(7)
    for _ in range(200):
        box, sent, taken = Mailbox(), [], []
        num_outputs = rng.randint(1, 12)
        for i in range(num_outputs):
            ids = [rng.randrange(100) for _ in range(rng.randint(0, 3))]
            sent += ids
            box.put(_out(ids, "length" if i == num_outputs - 1 else None, cached=rng.randint(0, 9)))
            if rng.random() < 0.4:
                taken += _take_all(box)
        taken += _take_all(box)
        assert [t for out in taken for t in out.new_token_ids] == sent
        assert [out.finish_reason for out in taken][-1] == "length"
        assert all(out.finish_reason is None for out in taken[:-1])
