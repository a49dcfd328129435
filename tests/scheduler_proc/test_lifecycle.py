"""Lifecycle edges, engine failures and tensor-parallel digest checks."""

import pytest

from ledgerserve.scheduler_proc.core import IllegalTransition, Request, RequestStatus, transition
from ledgerserve.shared import events as ev
from ledgerserve.shared.sampling import SamplingParams
from tests.scheduler_proc.driver import Driver


def _req(status: RequestStatus) -> Request:
    req = Request("r", [1, 2], SamplingParams(), arrival_order=1)
    req.status = status
    return req


@pytest.mark.parametrize(
    "start, end",
    [
        (RequestStatus.WAITING, RequestStatus.PREEMPTED),
        (RequestStatus.WAITING, RequestStatus.FINISHED_LENGTH),
        (RequestStatus.RUNNING, RequestStatus.WAITING),
        (RequestStatus.PREEMPTED, RequestStatus.RUNNING),
        (RequestStatus.FINISHED_STOPPED, RequestStatus.RUNNING),
        (RequestStatus.FINISHED_ABORTED, RequestStatus.WAITING),
        (RequestStatus.RUNNING, RequestStatus.RUNNING),
    ],
)
def test_illegal_transitions_raise(start, end):
    req = _req(start)
    with pytest.raises(IllegalTransition):
        transition(req, end)
    assert req.status == start


def test_legal_path():
    req = _req(RequestStatus.WAITING)
    for status in (
        RequestStatus.RUNNING,
        RequestStatus.PREEMPTED,
        RequestStatus.WAITING,
        RequestStatus.RUNNING,
        RequestStatus.FINISHED_LENGTH,
    ):
        transition(req, status)
    assert req.status.is_finished


def test_rank_digests_disagree_fails_engine():
    d = Driver(tensor_parallel_size=2)
    d.arrive("a", 3)
    assert d.send(ev.RankDigest(1, 0, 0xAA)) == []
    mismatch, failed = d.send(ev.RankDigest(1, 1, 0xBB))
    assert mismatch == ev.DigestMismatch(1, [0xAA, 0xBB], [1])
    assert isinstance(failed, ev.EngineFailed)
    assert "after step 1" in failed.message and "ranks [1]" in failed.message
    assert d.complete() == []  # a failed engine plans nothing more
    assert d.arrive("b", 3)[0].code == 503


def test_rank_digests_agree():
    d = Driver(tensor_parallel_size=2)
    d.arrive("a", 3)
    assert d.send(ev.RankDigest(1, 1, 5)) == [] and d.send(ev.RankDigest(1, 0, 5)) == []
    assert d.core.rank_digests == {}


def test_worker_failed_and_protocol_errors():
    d = Driver()
    assert isinstance(d.send(ev.WorkerFailed(0, "CUDA OOM"))[0], ev.EngineFailed)
    d = Driver()
    d.arrive("a", 3)
    (failed,) = d.send(ev.StepCompleted(7, 0, []))
    assert "step 7" in failed.message
    d = Driver()
    assert "twice" in d.ready()[0].message


def test_unknown_adapter_is_rejected_404():
    d = Driver()
    d.send(ev.RequestArrived("a", [1, 2], SamplingParams(), lora_name="sql"))
    assert d.of_type(ev.RequestRejected)[0].code == 404


def test_non_input_event_raises():
    d = Driver()
    with pytest.raises(TypeError):
        d.core.apply(ev.StateDigest(1, 2))


def test_core_imports_nothing_nondeterministic_or_io():
    import ast
    import pathlib

    core_dir = pathlib.Path(__file__).parents[2] / "scheduler_proc" / "core"
    forbidden = {"zmq", "torch", "time", "random", "os", "datetime", "uuid", "threading", "asyncio"}
    for path in sorted(core_dir.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not {n.split(".")[0] for n in names} & forbidden, f"{path.name} imports {names}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("hash", "set", "frozenset"), f"{path.name} calls {node.func.id}()"


def test_snapshot_and_integrity_helpers():
    d = Driver(num_kv_blocks=8, block_size=4)
    d.arrive("a", 6)
    snap = d.core.snapshot()
    assert snap["running"] == ["a"] and snap["requests"][0]["block_ids"] == [0, 1]
    assert d.engine_stats.num_free_blocks == 6 and d.core.has_unfinished()
    d.core.scheduler.block_manager.pool.free_block_ids.append(0)  # corrupt: block 0 twice
    with pytest.raises(RuntimeError, match="block 0"):
        d.core.check_integrity()


def test_token_ids_between_is_a_slice_of_token_ids() -> None:
    req = Request("r", [1, 2, 3], SamplingParams(), arrival_order=1)
    req.output_token_ids += [4, 5]
    for start in range(6):
        for end in range(start, 6):
            assert req.token_ids_between(start, end) == req.token_ids[start:end], (start, end)
