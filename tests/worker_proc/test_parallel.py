"""The tensor-parallel group on the CPU (gloo): two real processes meet through the run
directory's file store and their collectives give torch's sums and concatenations."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from ledgerserve.worker_proc.parallel import (
    OneShotAllReduce,
    TpGroup,
    cpu_threads_of_rank,
    share_cpu_cores,
    with_one_shot,
)

RANK_SCRIPT = """
import sys, torch
from ledgerserve.worker_proc.parallel import init_group, close_group, with_one_shot
rank, run_dir = int(sys.argv[1]), sys.argv[2]
group = init_group(rank, 2, run_dir, torch.device("cpu"), timeout_s=60)
assert with_one_shot(group, torch.float32, torch.device("cpu")) is group  # one-shot is CUDA's only
x = torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1)
reduced = group.all_reduce(x.clone())
gathered = group.all_gather(x)
cast = group.all_gather(x.to(torch.bfloat16), torch.float32)  # gathered, then cast in the same copy
assert cast.dtype == torch.float32 and torch.equal(cast, gathered), cast
print(reduced.flatten().tolist(), gathered.flatten().tolist())
close_group(group)
"""


def test_one_rank_needs_no_group():
    x = torch.ones(2, 3)
    group = TpGroup()
    assert group.all_reduce(x) is x and group.all_gather(x) is x


def test_cpu_ranks_share_the_cores_evenly_at_least_one_thread_each():
    assert [cpu_threads_of_rank(16, n) for n in (1, 2, 3, 4)] == [16, 8, 5, 4]
    assert cpu_threads_of_rank(2, 4) == 1 and cpu_threads_of_rank(1, 1) == 1


def test_a_cpu_rank_of_several_takes_its_share_unless_omp_num_threads_names_one(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        assert share_cpu_cores(TpGroup(), torch.device("cpu")) is None  # one rank: every core
        assert share_cpu_cores(TpGroup(0, 2), torch.device("cuda")) is None  # a GPU rank
        assert torch.get_num_threads() == before
        want = cpu_threads_of_rank(len(os.sched_getaffinity(0)), 64)
        assert share_cpu_cores(TpGroup(3, 64), torch.device("cpu")) == want == torch.get_num_threads()
        torch.set_num_threads(before)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert share_cpu_cores(TpGroup(0, 2), torch.device("cpu")) is None
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_one_shot_takes_contiguous_aligned_tensors_of_its_dtype_that_fit_its_buffer():
    one_shot = OneShotAllReduce(torch.empty(64, dtype=torch.bfloat16), "group")
    assert with_one_shot(TpGroup(), torch.bfloat16, torch.device("cpu")) == TpGroup()
    x = torch.ones(4, 16, dtype=torch.bfloat16)
    assert one_shot.fits(x)
    assert not one_shot.fits(torch.ones(5, 16, dtype=torch.bfloat16))  # past the buffer: NCCL's
    assert not one_shot.fits(x.float())  # another dtype (the sampler's ids, float32 scores)
    assert not one_shot.fits(x.t())  # not contiguous
    assert not one_shot.fits(torch.ones(65, dtype=torch.bfloat16)[1:])  # 2 bytes past an aligned address


def test_two_gloo_ranks_reduce_and_gather(tmp_path):
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(rank), str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
        )
        for rank in range(2)
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0]
    base = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    want_reduced = [3 * v for v in base]  # rank 0 holds x, rank 1 holds 2x
    want_gathered = [0.0, 1.0, 2.0, 0.0, 2.0, 4.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0]  # rows side by side
    for out in outputs:
        assert out.strip() == f"{want_reduced} {want_gathered}"


FAULT_SCRIPT = """
import os, sys, time, torch
from ledgerserve.worker_proc.parallel import CollectiveFailed, init_group, close_group
rank, run_dir, fault = int(sys.argv[1]), sys.argv[2], sys.argv[3]
group = init_group(rank, 2, run_dir, torch.device("cpu"), timeout_s=2)
group.all_reduce(torch.ones(4))  # a first collective that both ranks reach
if rank == 1:
    if fault == "stall":
        time.sleep(60)  # alive, but never reaches the next collective
    os._exit(0)  # gone without a word
started = time.monotonic()
try:
    group.all_reduce(torch.ones(4))
except CollectiveFailed as e:
    print(f"{e.timed_out} {time.monotonic() - started:.1f} {e}")
close_group(group)  # as the worker does: without it, the process aborts at exit after a timeout
"""


def _rank_zero_against(fault: str, run_dir: str) -> str:
    """What rank 0 prints after its second all_reduce, rank 1 having stalled or exited; rank 0 exits cleanly."""
    env = os.environ | {"GLOO_SOCKET_IFNAME": "lo"}
    argv = [sys.executable, "-c", FAULT_SCRIPT]
    procs = [
        subprocess.Popen([*argv, str(r), run_dir, fault], stdout=subprocess.PIPE, text=True, env=env) for r in (0, 1)
    ]
    try:
        out = procs[0].communicate(timeout=120)[0]
        assert procs[0].returncode == 0
        return out.strip()
    finally:
        procs[1].kill()
        procs[1].wait()


def test_a_stalled_rank_makes_the_waiting_rank_raise_after_the_timeout(tmp_path):
    timed_out, waited_s, message = _rank_zero_against("stall", str(tmp_path)).split(" ", 2)
    assert timed_out == "True" and 1.5 <= float(waited_s) < 30
    assert (
        message == "tensor-parallel collective all_reduce timed out after 2 s waiting for another rank (a rank stalled)"
    )


def test_a_dead_rank_makes_the_waiting_rank_raise_at_once(tmp_path):
    out = _rank_zero_against("exit", str(tmp_path))
    timed_out, waited_s, _ = out.split(" ", 2)
    assert timed_out == "False" and float(waited_s) < 2, out
    assert "tensor-parallel collective all_reduce failed" in out, out
