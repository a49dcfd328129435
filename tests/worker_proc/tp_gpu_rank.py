"""One rank of tests/worker_proc/test_tensor_parallel_gpu.py, run as its own process on cuda:RANK
in bfloat16: `python -m tests.worker_proc.tp_gpu_rank RANK SIZE RUN_DIR SPEC_JSON`. It
1. checks the group's all-reduce (one-shot or NCCL, eager and captured in a CUDA graph) against
   the sum it expects, for the sizes and dtypes a forward pass sends, and the all-reduce fused into
   the residual-add RMSNorm (with and without a pending LoRA delta) against the all-reduce followed
   by the norm;
2. loads the spec's adapters into slots 0.. and runs every prompt with its reference continuation
   appended (teacher forcing) as one mixed prefill step: the logits of the continuation's positions;
3. with decode graphs, runs one decode step through the graph and eagerly on the same inputs;
4. serves every prompt to completion (greedy, chunked prefill, base and adapters mixed) through the
   runner's own launch path, each rank taking rank 0's sampled tokens, as the scheduler hands them on.
Rank 0 writes the logits (safetensors) and the rest (JSON) to the spec's output directory."""

from __future__ import annotations

import faulthandler
import json
import os
import sys

import torch
from safetensors.torch import save_file

from ledgerserve.kernels import ops
from ledgerserve.kernels.lora_types import LoraDelta
from ledgerserve.shared.events import AdapterLoadCompleted, AdapterSlotAssigned, SampledToken, StepCompleted
from ledgerserve.worker_proc.parallel import TpGroup, clear_packets, init_group
from ledgerserve.worker_proc.requests import ReqState
from ledgerserve.worker_proc.runner import ModelRunner
from ledgerserve.worker_proc.step_inputs import build_step_inputs
from tests.kernels.lora_delta_data import make_delta
from tests.worker_proc.fake_scheduler import FakeScheduler
from tests.worker_proc.lora_setup import BLOCK_SIZE, GREEDY, NUM_BLOCKS, lora_config

STALL_S = 100  # a rank still running after this dumps its threads' stacks to stderr and exits
CHUNKS = {"base": 5, "head": 3, "attn": 7, "mlp": 4, "all": 6}
# name, shape, dtype: what a decode step, a long prefill chunk and the sampler's ids send
ALL_REDUCES = [
    ("bf16-row", (1, 64), torch.bfloat16),
    ("bf16-decode", (32, 4096), torch.bfloat16),
    ("bf16-prefill", (600, 4096), torch.bfloat16),  # past the one-shot buffer: NCCL
    ("fp32", (8, 64), torch.float32),
    ("int64", (8,), torch.int64),
]


def check_all_reduce(group: TpGroup, device: torch.device) -> dict[str, bool]:
    """Every ALL_REDUCES case summed right, eagerly and replayed from a CUDA graph; name -> whether
    it took the one-shot path."""
    one_shot = {}
    for name, shape, dtype in ALL_REDUCES:
        base = (torch.arange(torch.Size(shape).numel(), device=device) % 7 + 1).view(shape)  # small ints: exact
        x = (base * (group.rank + 1)).to(dtype)
        want = (base * sum(range(1, group.size + 1))).to(dtype)
        one_shot[name] = group.one_shot is not None and group.one_shot.fits(x)
        got = group.all_reduce(x.clone())
        assert torch.equal(got, want), f"{name}: eager all-reduce is wrong"
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = group.all_reduce(static)
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize(device)
        assert torch.equal(out, want), f"{name}: graphed all-reduce is wrong"
    return one_shot


def check_fused_norm(group: TpGroup, device: torch.device) -> bool:
    """Whether the group fuses the all-reduce into the norm; where it does, the fused kernel, eager
    and from a CUDA graph, against the all-reduce then fused_add_rms_norm, on rank-dependent partials."""
    peers = group.peer_buffers
    if peers is None:
        return False
    gen = torch.Generator().manual_seed(group.rank)
    for lora in (False, True):
        delta = make_delta([4096], torch.bfloat16, str(device), seed=group.rank) if lora else None
        rows = len(delta.token_slots) if delta is not None else 32
        x = torch.randn(rows, 4096, generator=gen).to(device, torch.bfloat16)  # this rank's partial
        residual = torch.randn(rows, 4096, generator=torch.Generator().manual_seed(7)).to(device, torch.bfloat16)
        weight = torch.rand(4096, generator=torch.Generator().manual_seed(8)).to(device, torch.bfloat16)
        summed, summed_delta = group.all_reduce(x.clone()), None
        if delta is not None:
            h = group.all_reduce(delta.h.contiguous())
            summed_delta = LoraDelta(h, delta.weights, delta.token_slots)
        want = ops.fused_add_rms_norm(summed, residual, weight, 1e-5, summed_delta)
        assert ops.fuses_all_reduce_norm(x, delta, peers), f"lora={lora}: not fused"
        for part in range(peers.num_parts):
            got = ops.all_reduce_add_rms_norm(x, residual, weight, 1e-5, delta, peers, part)
            for g, w, what in zip(got, want, ("normed", "residual"), strict=True):
                torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-2, msg=f"lora={lora} part={part}: {what}")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            parts = range(peers.num_parts)
            out = [ops.all_reduce_add_rms_norm(x, residual, weight, 1e-5, delta, peers, part) for part in parts]
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize(device)
        for got in out:
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, atol=1e-2, rtol=1e-2, msg=f"lora={lora}: graphed")
    normed, residual = ops.all_reduce_add_rms_norm(x, None, weight, 1e-5, None, peers, 0)  # the embedding's
    torch.testing.assert_close(residual, summed, atol=0, rtol=0, msg="no residual: the sum")
    torch.testing.assert_close(normed, ops.rms_norm(summed, weight, 1e-5), atol=1e-2, rtol=1e-2, msg="no residual")
    # the check's rows (hidden 4096, LoRA rank 16) are laid out unlike the model's: cleared on every
    # rank, as the worker clears its start-up trial's, before the model's first call
    clear_packets(peers, device)
    group.all_reduce(torch.zeros(1, device=device))  # every rank cleared before any sends again
    return True


def teacher_forced_logits(runner: ModelRunner, spec: dict, slots: dict[str, int]) -> dict[str, torch.Tensor]:
    """name -> [num_new, vocab] float32: each prompt + its reference continuation in one mixed step."""
    reqs, spans, start = [], {}, 0
    for i, (name, prompt) in enumerate(spec["prompts"].items()):
        tokens = prompt + spec["references"][name][:-1]
        blocks = list(range(12 * i, 12 * i + 12))
        reqs.append(ReqState(name, tokens, len(tokens), GREEDY, blocks, 0, len(tokens), slots.get(name, -1)))
        spans[name] = (start + len(prompt) - 1, start + len(tokens))
        start += len(tokens)
    inputs = build_step_inputs(reqs, BLOCK_SIZE, runner.device, runner.staging)
    hidden = runner.model(inputs, runner.kv_cache.layers)  # [num_tokens, hidden]
    logits = runner.model.compute_logits(hidden, inputs.lora).float()  # [num_tokens, vocab]
    return {name: logits[lo:hi].cpu() for name, (lo, hi) in spans.items()}


def graph_against_eager(runner: ModelRunner, spec: dict, slots: dict[str, int]) -> float:
    """Relative error of one decode step's logits, graph replay against the eager forward."""
    assert runner.graphs is not None
    reqs = []
    for i, name in enumerate(["all", "base", "mlp", "head"]):
        prompt = spec["prompts"][name]
        blocks = list(range(12 * i, 12 * i + 12))
        reqs.append(
            ReqState(f"g{i}", list(prompt), len(prompt), GREEDY, blocks, len(prompt) - 1, 1, slots.get(name, -1))
        )
    assert runner.graphs.fits(reqs)
    inputs = build_step_inputs(reqs, BLOCK_SIZE, runner.device, runner.staging)
    hidden = runner.model(inputs, runner.kv_cache.layers)
    eager = runner.model.compute_logits(hidden[inputs.sample_indices], inputs.sample_lora).float()
    graph = runner.graphs.replay(runner.inputs.stage_graph(reqs)).float()
    return float((graph - eager).norm() / eager.norm())


def serve_greedy(runner: ModelRunner, spec: dict, slots: dict[str, int]) -> dict[str, list[int]]:
    sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
    for name, prompt in spec["prompts"].items():
        sched.add(name, prompt, GREEDY, chunk=CHUNKS[name], lora_slot=slots.get(name, -1))
    names = sorted(sched.running)
    for _ in range(500):
        if not sched.running:
            runner.execute(sched.plan())  # tell the ranks about the last finished requests
            return {name: req.outputs for name, req in sched.done.items()}
        completed, _ = runner.execute(sched.plan())
        sched.complete(rank0_tokens(runner, names, completed))
    raise AssertionError("requests did not finish")


def rank0_tokens(runner: ModelRunner, names: list[str], completed: StepCompleted) -> StepCompleted:
    """Rank 0's sampled tokens on every rank (the others add zeros to the sum)."""
    ids = [0] * len(names)
    for token in completed.sampled:
        ids[names.index(token.req_id)] = token.token_id + 1
    summed = runner.group.all_reduce(torch.tensor(ids, dtype=torch.int64, device=runner.device)).tolist()
    sampled = [SampledToken(name, int(v) - 1) for name, v in zip(names, summed) if v > 0]
    return StepCompleted(completed.step, 0, sampled)


def main() -> None:
    rank, size, run_dir, spec_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    faulthandler.dump_traceback_later(STALL_S, exit=True)
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    group = init_group(rank, size, run_dir, device, timeout_s=120)
    config = lora_config(spec["base_dir"], device="cuda", dtype="bfloat16", **spec["config"])
    runner = ModelRunner(config, rank, group)
    print(f"rank {rank}: runner built", file=sys.stderr, flush=True)
    report: dict = {"one_shot": check_all_reduce(runner.group, device)}
    report["fused_norm"] = check_fused_norm(runner.group, device)
    print(f"rank {rank}: all-reduce checked", file=sys.stderr, flush=True)
    slots = {}
    for slot, (name, path) in enumerate(spec["adapter_dirs"].items()):
        done = runner.adapters.load(AdapterSlotAssigned(slot, 100 + slot, path))
        assert isinstance(done, AdapterLoadCompleted), f"adapter {name} did not load: {done}"
        slots[name] = slot
    logits = teacher_forced_logits(runner, spec, slots)
    print(f"rank {rank}: teacher forced", file=sys.stderr, flush=True)
    if runner.graphs is not None:
        report["graph_err"] = graph_against_eager(runner, spec, slots)
    report["outputs"] = serve_greedy(runner, spec, slots)
    report["graph_replays"] = runner.graphs.replays if runner.graphs is not None else 0
    runner.close()
    if rank == 0:
        out = os.path.join(spec["out_dir"], spec["name"])
        save_file(logits, f"{out}.safetensors")
        with open(f"{out}.json", "w", encoding="utf-8") as f:
            json.dump(report, f)
    # Every collective has completed on every rank (the last step was read back). The group is not
    # torn down: destroying an NCCL group whose collectives were captured in CUDA graphs can wait
    # on the peer indefinitely, and process exit releases it.
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
