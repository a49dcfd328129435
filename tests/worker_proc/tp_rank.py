"""One tensor-parallel rank of tests/worker_proc/test_tensor_parallel.py, run as its own process:
`python -m tests.worker_proc.tp_rank RANK SIZE RUN_DIR SPEC_JSON`. It joins the group, builds a
ModelRunner for it, loads the spec's adapters into slots 0.., runs three steps through the model
(chunked prefill; prefill chunks beside decode rows; decode on the stacked-A path the decode graphs
take) with base and adapter requests mixed, and writes every row's logits (safetensors) and what it
holds (JSON: model weights, KV heads, the adapter bytes its CPU tier keeps) to the spec's output directory."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch
from safetensors.torch import save_file

from ledgerserve.kernels.lora_types import Tiles, group_tiles, max_tiles
from ledgerserve.shared.events import AdapterLoadCompleted, AdapterSlotAssigned
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.lora.mapping import LoraMapping
from ledgerserve.worker_proc.models.layers import RMSNorm
from ledgerserve.worker_proc.models.moe import SparseMoeBlock
from ledgerserve.worker_proc.parallel import close_group, init_group, share_cpu_cores
from ledgerserve.worker_proc.requests import ReqState
from ledgerserve.worker_proc.runner import ModelRunner
from ledgerserve.worker_proc.step_inputs import build_step_inputs
from tests.worker_proc.lora_setup import BLOCK_SIZE, lora_config

MAX_LORAS = 4
BLOCKS_PER_REQ = 5
# (name, slot, prompt length, tokens of the first step): slot -1 is the base model
REQS = [("base", -1, 11, 7), ("a0", 0, 9, 9), ("a1", 1, 13, 5), ("a2", 2, 6, 6), ("base2", -1, 5, 5), ("a0b", 0, 8, 3)]


def _req(index: int, name: str, slot: int, prompt_len: int) -> ReqState:
    gen = torch.Generator().manual_seed(100 + index)
    prompt = torch.randint(3, 250, (prompt_len,), generator=gen).tolist()  # within every test vocabulary
    blocks = list(range(index * BLOCKS_PER_REQ, (index + 1) * BLOCKS_PER_REQ))
    return ReqState(name, prompt, prompt_len, SamplingParams(max_tokens=4), blocks, 0, 0, slot)


def _schedule(req: ReqState, num_tokens: int, next_token: int | None) -> None:
    """Advance `req` past its last step and schedule `num_tokens` more (a decode row appends `next_token`)."""
    req.num_computed_tokens += req.num_scheduled_tokens
    if next_token is not None:
        req.token_ids.append(next_token)
    req.num_scheduled_tokens = num_tokens


def _logits(runner: ModelRunner, reqs: list[ReqState], graph_layout: bool) -> torch.Tensor:
    """[num_tokens, vocab]: every scheduled row's logits; `graph_layout`: the decode graphs' LoRA
    mapping (grouped tiles over every slot), so projections take the stacked-A path."""
    inputs = build_step_inputs(reqs, BLOCK_SIZE, runner.device)
    if graph_layout:
        slots = inputs.lora_slots.tolist()
        order, starts, tile_slots = group_tiles(slots, max_tiles(len(slots), MAX_LORAS))
        tiles = Tiles(*(torch.tensor(v, dtype=torch.long) for v in (order, starts, tile_slots)))
        inputs = dataclasses.replace(inputs, lora=LoraMapping.for_graph(inputs.lora_slots, tiles, MAX_LORAS))
    hidden = runner.model(inputs, runner.kv_cache.layers)  # [num_tokens, hidden]
    return runner.model.compute_logits(hidden, inputs.lora)


def run_steps(runner: ModelRunner) -> dict[str, torch.Tensor]:
    reqs = [_req(i, name, slot, n) for i, (name, slot, n, _) in enumerate(REQS)]
    for req, (_, _, _, first) in zip(reqs, REQS):
        _schedule(req, first, None)
    out = {"prefill": _logits(runner, reqs, False)}
    for i, req in enumerate(reqs):  # finished prompts decode; the others take their next chunk
        left = req.num_prompt_tokens - req.num_tokens_after_step
        _schedule(req, left or 1, None if left else 7 + i)
    out["mixed"] = _logits(runner, reqs, False)
    for i, req in enumerate(reqs):
        _schedule(req, 1, 30 + i)
    out["decode"] = _logits(runner, reqs, True)
    return out


def held_bytes(runner: ModelRunner) -> dict[str, int]:
    model = runner.model
    # replicated on every rank: the norms, and a mixture of experts' router
    norms = [m.weight for m in model.modules() if isinstance(m, RMSNorm)]
    norms += [m.gate.weight for m in model.modules() if isinstance(m, SparseMoeBlock)]
    k_cache = runner.kv_cache.layers[0][0]  # [num_blocks, block_size, num_kv_heads, head_dim]
    images = [entry.image for entry in runner.lora.loader.cpu.entries.values()]
    return {
        "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "norm_bytes": sum(p.numel() * p.element_size() for p in norms),
        "num_kv_heads": k_cache.shape[2],
        "adapter_bytes": sum(run.stop - run.start for image in images for run in image.layout.runs),
        "num_adapters": len(images),
    }


def main() -> None:
    rank, size, run_dir, spec_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    group = init_group(rank, size, run_dir, torch.device("cpu"), timeout_s=120)
    share_cpu_cores(group, torch.device("cpu"))  # as the worker does
    config = lora_config(spec["base_dir"], max_loras=MAX_LORAS, num_kv_blocks=len(REQS) * BLOCKS_PER_REQ)
    runner = ModelRunner(config, rank, group)
    for slot, path in enumerate(spec["adapter_dirs"]):
        done = runner.adapters.load(AdapterSlotAssigned(slot, 100 + slot, path))
        if not isinstance(done, AdapterLoadCompleted):
            raise RuntimeError(f"adapter {path} did not load: {done}")
    logits = run_steps(runner)
    out = os.path.join(spec["out_dir"], f"tp{size}-rank{rank}")
    save_file({k: v.contiguous() for k, v in logits.items()}, f"{out}.safetensors")
    with open(f"{out}.json", "w", encoding="utf-8") as f:
        json.dump(held_bytes(runner), f)
    close_group(group)


if __name__ == "__main__":
    main()
