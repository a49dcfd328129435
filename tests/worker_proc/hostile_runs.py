"""The same batches run twice on one ModelRunner: first with a clean adapter in slot 0, then with a
hostile one there (finite weights huge enough to overflow, tests/shared/hostile_adapters.py), beside
base requests and requests on other adapters, greedy, seeded-random and with logprobs, prefill
chunks and decode steps mixed, then a second wave of base requests on the blocks the first freed.
Every request not on slot 0 must get the same tokens and the same logits, bit for bit; slot 0's
own rows must really break. A second hostile adapter, whose values overflow only once cast to the
model's dtype, is registered with the true SHA-256 of its files (as if its validation had been
bypassed) and must still fail its load. Shared by the CPU test and the GPU (eager, graph) tests."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ledgerserve.kernels.lora_types import LoraLayout
from ledgerserve.shared.adapter_digest import content_sha256
from ledgerserve.shared.adapter_types import CONFIG_FILE, WEIGHTS_FILE
from ledgerserve.shared.events import AdapterEvicted, AdapterLoadCompleted, AdapterLoadFailed, AdapterSlotAssigned
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.lora import layout
from ledgerserve.worker_proc.runner import ModelRunner
from tests.shared.hostile_adapters import huge_weights, poison_weights
from tests.worker_proc.fake_scheduler import FakeScheduler, run_to_completion
from tests.worker_proc.lora_setup import BLOCK_SIZE, NUM_BLOCKS, LoraSetup

NUM_TOKENS = 10
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
WITH_LOGPROBS = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.8, top_k=20, top_p=0.9, seed=7, ignore_eos=True)
HOSTILE_SLOT, CAST_SLOT = 0, 3
SLOTS = {"hostile": HOSTILE_SLOT, "mlp": 1, "head": 2}  # slot 0 holds "all" in the control run
# (request, adapter or None, prompt, chunk, sampling): base rows between and beside slot 0's
FIRST_WAVE = [
    ("base-a", None, "base", 5, WITH_LOGPROBS),
    ("hostile-a", "hostile", "all", 3, WITH_LOGPROBS),
    ("mlp", "mlp", "mlp", 4, GREEDY),
    ("base-b", None, "attn", 1, SEEDED),
    ("head", "head", "head", 2, GREEDY),
    ("hostile-b", "hostile", "base", 1, SEEDED),
    ("base-c", None, "all", 7, GREEDY),
]
SECOND_WAVE = [("base-d", None, "head", 6, GREEDY), ("base-e", None, "mlp", 1, WITH_LOGPROBS)]
# the model dtype -> (file dtype, a value finite in it that becomes infinite once cast to the model's)
OVERFLOW_ONCE_CAST = {
    torch.float32: (torch.float64, 1e39),
    torch.bfloat16: (torch.float32, 3.4e38),
    torch.float16: (torch.float32, 1e5),
}
HUGE = {torch.float32: 1e38, torch.bfloat16: 1e38, torch.float16: 6e4}  # finite in each


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list] = field(default_factory=dict)
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # per step, [vocab] float32 on the host
    layouts: set[str] = field(default_factory=set)  # the LoRA layouts the layers ran with slot 0 in the batch


def hostile_dirs(setup: LoraSetup, root: Path, dtype: torch.dtype) -> dict[str, str]:
    """The huge-weight adapter (the "all" adapter, its layer 0 blown up) and the overflow-once-cast one."""
    huge = Path(shutil.copytree(setup.adapter_dirs["all"], root / "hostile"))
    huge_weights(HUGE[dtype])(huge, root)
    cast = Path(shutil.copytree(setup.adapter_dirs["mlp"], root / "overflows-once-cast"))
    file_dtype, value = OVERFLOW_ONCE_CAST[dtype]
    poison_weights(value, file_dtype)(cast, root)
    return {"hostile": str(huge), "cast": str(cast)}


def files_sha256(path: str) -> str:
    """What the HTTP process would have registered for the files at `path`."""
    return content_sha256((Path(path) / CONFIG_FILE).read_bytes(), (Path(path) / WEIGHTS_FILE).read_bytes())


def load_control(runner: ModelRunner, setup: LoraSetup) -> None:
    for version_id, (name, slot) in enumerate([("all", HOSTILE_SLOT), ("mlp", 1), ("head", 2)], start=100):
        done = runner.adapters.load(AdapterSlotAssigned(slot, version_id, setup.adapter_dirs[name]))
        assert isinstance(done, AdapterLoadCompleted), done


def load_hostile(runner: ModelRunner, dirs: dict[str, str]) -> AdapterLoadFailed:
    """Slot 0's clean adapter replaced by the huge one (which loads), and the overflow-once-cast one
    assigned with its files' true SHA-256 (which must fail): that failure."""
    runner.adapters.evict(AdapterEvicted(HOSTILE_SLOT, 100))
    path = dirs["hostile"]
    done = runner.adapters.load(AdapterSlotAssigned(HOSTILE_SLOT, 200, path, content_sha256=files_sha256(path)))
    assert isinstance(done, AdapterLoadCompleted), done
    path = dirs["cast"]
    return runner.adapters.load(AdapterSlotAssigned(CAST_SLOT, 201, path, content_sha256=files_sha256(path)))


def run(runner: ModelRunner, setup: LoraSetup) -> Run:
    """Both waves, recording each request's tokens, logprobs and logits."""
    out = Run()
    restore = _record(runner, out)
    try:
        sched = FakeScheduler(BLOCK_SIZE, NUM_BLOCKS)
        for wave in (FIRST_WAVE, SECOND_WAVE):
            for req_id, adapter, prompt, chunk, sampling in wave:
                slot = -1 if adapter is None else SLOTS[adapter]
                sched.add(req_id, setup.prompts[prompt], sampling, chunk=chunk, lora_slot=slot)
            for req_id, req in run_to_completion(runner, sched).items():
                out.tokens[req_id], out.logprobs[req_id] = req.outputs, req.logprobs
    finally:
        restore()
    return out


def assert_contained(control: Run, hostile: Run) -> None:
    """Every request but slot 0's: the same tokens, logprobs and logits; slot 0's rows broke."""
    others = [req_id for req_id, adapter, *_ in FIRST_WAVE + SECOND_WAVE if adapter != "hostile"]
    assert sorted(hostile.tokens) == sorted(control.tokens) and len(hostile.tokens) == 9
    for req_id in others:
        assert hostile.tokens[req_id] == control.tokens[req_id], req_id
        assert hostile.logprobs[req_id] == control.logprobs[req_id], req_id
        want, got = torch.stack(control.logits[req_id]), torch.stack(hostile.logits[req_id])
        assert torch.isfinite(want).all() and torch.equal(want, got), req_id
    broken = torch.stack(hostile.logits["hostile-a"] + hostile.logits["hostile-b"])
    assert not torch.isfinite(broken).all(), "the hostile adapter's own rows stayed finite: no overflow"
    vocab = broken.shape[1]
    assert all(0 <= t < vocab for t in hostile.tokens["hostile-a"] + hostile.tokens["hostile-b"])


def _record(runner: ModelRunner, out: Run) -> Callable[[], None]:
    """Wrap the runner's forward pass and layout choice to record logits rows and layouts."""
    forward, choose = runner.forward.run, layout.choose

    def recording_forward(batch, inputs):
        forwarded = forward(batch, inputs)
        if forwarded.logits is not None:  # a graph's logits are its static buffer: copied now
            for row, req in zip(forwarded.logits.float().cpu(), batch.sampling):
                out.logits.setdefault(req.req_id, []).append(row.clone())
        return forwarded

    def recording_choose(weights, stacked, mapping, x) -> layout.Stacked | LoraLayout | None:
        plan = choose(weights, stacked, mapping, x)
        if plan is not None and HOSTILE_SLOT in (mapping.slots or (HOSTILE_SLOT,)):
            out.layouts.add(type(plan).__name__)
        return plan

    runner.forward.run = recording_forward  # type: ignore[method-assign]
    layout.choose = recording_choose

    def restore() -> None:
        del runner.forward.run
        layout.choose = choose

    return restore
