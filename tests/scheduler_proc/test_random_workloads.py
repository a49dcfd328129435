"""Block accounting stays exact under random workloads; decisions are byte-identical
across runs and across PYTHONHASHSEED values."""

import os
import subprocess
import sys

import xxhash
from hypothesis import given, settings

from ledgerserve.shared import codec
from ledgerserve.shared import events as ev
from ledgerserve.sim.workload import run_workload
from tests.scheduler_proc.driver import Driver
from tests.scheduler_proc.workload import WORKLOAD_SPACE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@settings(max_examples=60, deadline=None)
@given(**WORKLOAD_SPACE)
def test_integrity_after_random_workloads(seed, num_kv_blocks, max_num_seqs, max_num_batched_tokens):
    d = Driver(
        num_kv_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=4,
        max_model_len=32,
    )
    run_workload(d, seed)  # the driver checks integrity after every event
    d.check_idle()
    assert not d.of_type(ev.EngineFailed)
    finished = {x.req_id for x in d.of_type(ev.RequestFinished)} | {x.req_id for x in d.of_type(ev.RequestRejected)}
    assert finished == {x.req_id for x in d.inputs if isinstance(x, ev.RequestArrived)}


def decisions_fingerprint(seed: int) -> str:
    d = Driver(10, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, max_model_len=32)
    run_workload(d, seed, num_events=120)
    return xxhash.xxh64_hexdigest(b"".join(codec.encode(x) for x in d.decisions))


def test_workload_exercises_preemption():
    d = Driver(10, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, max_model_len=32)
    run_workload(d, 3, num_events=120)
    assert d.of_type(ev.RequestPreempted) and d.of_type(ev.RequestRejected) is not None


def test_decisions_identical_across_pythonhashseed():
    code = "from tests.scheduler_proc.test_random_workloads import decisions_fingerprint as f; print(f(3), f(11))"
    outputs = []
    for hash_seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed, PYTHONPATH=ROOT)
        proc = subprocess.run(
            [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, check=True
        )
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1] == outputs[2]
    assert outputs[0].split() == [decisions_fingerprint(3), decisions_fingerprint(11)]


@settings(max_examples=20, deadline=None)
@given(**WORKLOAD_SPACE)
def test_overlapped_loading_changes_nothing_without_adapters(seed, num_kv_blocks, max_num_seqs, max_num_batched_tokens):
    """The flag's default is on: a base-model engine must decide (and digest) exactly as before."""
    runs = [
        Driver(
            num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            block_size=4,
            max_model_len=32,
            lora_overlap_loading=overlap,
        )
        for overlap in (False, True)
    ]
    for d in runs:
        run_workload(d, seed)
    assert [codec.encode(x) for x in runs[0].decisions] == [codec.encode(x) for x in runs[1].decisions]
