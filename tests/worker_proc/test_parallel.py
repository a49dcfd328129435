"""The tensor-parallel group on the CPU (gloo): two real processes meet through the run
directory's file store and their collectives give torch's sums and concatenations."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from ledgerserve.worker_proc.parallel import TpGroup

RANK_SCRIPT = """
import sys, torch
from ledgerserve.worker_proc.parallel import init_group, close_group
rank, run_dir = int(sys.argv[1]), sys.argv[2]
group = init_group(rank, 2, run_dir, torch.device("cpu"), timeout_s=60)
x = torch.arange(6, dtype=torch.float32).view(2, 3) * (rank + 1)
reduced = group.all_reduce(x.clone())
gathered = group.all_gather(x)
print(reduced.flatten().tolist(), gathered.flatten().tolist())
close_group(group)
"""


def test_one_rank_needs_no_group():
    x = torch.ones(2, 3)
    group = TpGroup()
    assert group.all_reduce(x) is x and group.all_gather(x) is x


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
