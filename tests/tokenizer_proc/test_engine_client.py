"""EngineClient over real ipc sockets, with the test playing the scheduler."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from ledgerserve.shared import codec, ipc
from ledgerserve.shared.events import (
    AdapterInfo,
    AdapterLoadRequested,
    AdapterOpReplied,
    AdapterRegistryChanged,
    AdapterUnloadRequested,
    EngineFailed,
    RequestAborted,
    RequestArrived,
    RequestRejected,
    TokensEmitted,
)
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.tokenizer_proc.engine_client import EngineDeadError, RequestRejectedError
from ledgerserve.tokenizer_proc.engine_socket import EngineClient

pytestmark = pytest.mark.anyio


class Scheduler:
    def __init__(self, run_dir: str) -> None:
        ctx = zmq.asyncio.Context.instance()
        self.pull = ipc.bind(ctx, zmq.PULL, run_dir, ipc.SCHED_IN)
        self.push = ipc.bind(ctx, zmq.PUSH, run_dir, ipc.TO_TOKENIZER)
        self.decoder = codec.to_scheduler_decoder()

    async def recv(self):
        return self.decoder.decode(await asyncio.wait_for(self.pull.recv(), 5))

    async def send(self, event) -> None:
        await self.push.send(codec.encode(event))

    def close(self) -> None:
        self.pull.close()
        self.push.close()


@pytest.fixture
async def pair() -> AsyncIterator[tuple[EngineClient, Scheduler]]:
    run_dir = ipc.make_run_dir()
    scheduler = Scheduler(run_dir)
    client = EngineClient(run_dir)
    await client.start()
    yield client, scheduler
    await client.close()
    scheduler.close()
    shutil.rmtree(run_dir, ignore_errors=True)


def _arrived(req_id: str) -> RequestArrived:
    return RequestArrived(req_id, [1, 2, 3], SamplingParams(max_tokens=2))


async def test_stream_and_garbage_frames(pair) -> None:
    client, scheduler = pair
    stream = client.generate(_arrived("r1"))
    first = asyncio.ensure_future(stream.__anext__())
    assert (await scheduler.recv()).req_id == "r1"
    await scheduler.push.send(b"\x93garbage")  # dropped and counted, never executed
    await scheduler.send(RequestAborted("r1"))  # decodes, but not a FromScheduler event
    await scheduler.send(TokensEmitted("other", [9]))  # unknown request: dropped
    await scheduler.send(TokensEmitted("r1", [7]))
    assert (await first).new_token_ids == [7]  # taken before [8] arrives: not merged with it (mailbox.py)
    await scheduler.send(TokensEmitted("r1", [8], finish_reason="length"))
    rest = [out async for out in stream]
    assert [o.new_token_ids for o in rest] == [[8]] and rest[0].finish_reason == "length"
    assert client.num_bad_frames == 2
    assert client.num_in_flight == 0


async def test_rejected_raises_typed_error(pair) -> None:
    client, scheduler = pair
    task = asyncio.ensure_future(_drain(client, "r2"))
    await scheduler.recv()
    await scheduler.send(RequestRejected("r2", "cannot fit", 400, "max_tokens"))
    with pytest.raises(RequestRejectedError) as info:
        await task
    assert info.value.status_code == 400 and info.value.param == "max_tokens"


async def test_early_exit_sends_abort(pair) -> None:
    client, scheduler = pair
    stream = client.generate(_arrived("r3"))
    first = asyncio.ensure_future(stream.__anext__())
    await scheduler.recv()
    await scheduler.send(TokensEmitted("r3", [5]))
    await first
    await stream.aclose()
    aborted = await scheduler.recv()
    assert aborted == RequestAborted("r3", "abort")


async def test_explicit_abort_is_sent_once(pair) -> None:
    client, scheduler = pair
    stream = client.generate(_arrived("r4"))
    first = asyncio.ensure_future(stream.__anext__())
    await scheduler.recv()
    await scheduler.send(TokensEmitted("r4", [5]))
    await first
    await client.abort("r4", "stop")
    await stream.aclose()
    assert await scheduler.recv() == RequestAborted("r4", "stop")
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(scheduler.pull.recv(), 0.2)


async def test_engine_failed_fails_everyone(pair) -> None:
    client, scheduler = pair
    task = asyncio.ensure_future(_drain(client, "r5"))
    await scheduler.recv()
    await scheduler.send(EngineFailed("rank 1 died"))
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        await task
    assert not client.is_healthy
    with pytest.raises(EngineDeadError):
        await _drain(client, "r6")


async def test_engine_died_notice_fails_everyone(pair) -> None:
    client, scheduler = pair
    task = asyncio.ensure_future(_drain(client, "r7"))
    await scheduler.recv()
    assert client.unavailable_reason() is None
    client.engine_died("engine process 'worker-0' died (exit code -9)")
    with pytest.raises(EngineDeadError, match="worker-0"):
        await task
    assert "worker-0" in client.unavailable_reason()


async def test_draining_refuses_new_requests_but_finishes_old_ones(pair) -> None:
    client, scheduler = pair
    task = asyncio.ensure_future(_drain(client, "r8"))
    await scheduler.recv()
    client.is_draining = True
    with pytest.raises(EngineDeadError, match="shutting down"):
        await _drain(client, "r9")
    await scheduler.send(TokensEmitted("r8", [5], "length"))
    assert [out.new_token_ids for out in await task] == [[5]]


async def _drain(client: EngineClient, req_id: str) -> list[TokensEmitted]:
    return [out async for out in client.generate(_arrived(req_id))]


async def test_adapter_ops_get_their_own_replies(pair) -> None:
    client, scheduler = pair
    seen: list[list[AdapterInfo]] = []
    client.on_adapters = seen.append
    load = asyncio.ensure_future(client.adapter_op(AdapterLoadRequested("op1", "a", "/p/a", 8, 100)))
    unload = asyncio.ensure_future(client.adapter_op(AdapterUnloadRequested("op2", "b")))
    assert {(await scheduler.recv()).op_id, (await scheduler.recv()).op_id} == {"op1", "op2"}
    a, c = AdapterInfo("a", 1, "/p/a"), AdapterInfo("c", 3, "/p/c")
    await scheduler.send(AdapterOpReplied("op2", 404, "The lora adapter 'b' cannot be found."))
    await scheduler.send(AdapterRegistryChanged([c]))  # an op of another HTTP process
    await scheduler.send(AdapterOpReplied("op-unknown", 200, "", 3))  # answers no one
    await scheduler.send(AdapterRegistryChanged([a]))  # op1's change, before its reply
    await scheduler.send(AdapterOpReplied("op1", 200, "", 1))
    assert (await unload).code == 404 and (await load).version_id == 1
    assert seen == [[c], [a, c]] and client.adapters == {"a": a, "c": c}
    await scheduler.send(AdapterRegistryChanged([], ["c", "gone-already"]))  # an unload, a failed load, an LRU one
    await scheduler.send(AdapterRegistryChanged([AdapterInfo("a", 4, "/p/a2")]))  # a load_inplace
    await _until(lambda: len(seen) == 4)
    assert seen[2:] == [[a], [AdapterInfo("a", 4, "/p/a2")]]
    pending = asyncio.ensure_future(client.adapter_op(AdapterUnloadRequested("op3", "a")))
    await scheduler.recv()
    await scheduler.send(EngineFailed("boom"))
    with pytest.raises(EngineDeadError):
        await pending
    with pytest.raises(EngineDeadError):
        await client.adapter_op(AdapterUnloadRequested("op4", "a"))


async def _until(condition, timeout_s: float = 5.0) -> None:
    """Wait for the client's reader to take what the test sent."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("the client did not take the events in time")
        await asyncio.sleep(0.01)
