"""GPU time of one step by its mix of decode rows and prompt tokens, as serving runs them.

Llama-3-8B shapes (dummy bf16), no LoRA, `ModelRunner` with its decode and mixed-step CUDA
graphs. Decode rows have 320-token contexts; "cached-prefix" rows are the last 16 tokens of a
256-token prompt whose first 240 are cached (what a repeated prompt costs). Each case runs
twice to warm up, then five times queued behind a 50 ms device sleep so the host is ahead: the
time between CUDA events around the launch is the device's. Prints the median and the minimum.

    python -m scripts.decode.bench_step_mix
"""

from __future__ import annotations

import tempfile
import time

import torch

from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import NewReq, StepPlan
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.runner import ModelRunner
from scripts.common.bench_fixtures import write_model_dir

GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
NUM_BLOCKS = 8192
# name: (decode rows, prompt rows as (cached tokens, new tokens))
CASES = {
    "decode 100": (100, []),
    "100 + 16 cached-prefix": (100, [(240, 16)]),
    "100 + 2x16": (100, [(240, 16), (240, 16)]),
    "64 + 256 prompt": (64, [(0, 256)]),
}


class Plans:
    """Step plans of fresh requests over blocks reused round-robin (the KV contents do not matter)."""

    def __init__(self) -> None:
        self.num_reqs, self.next_block = 0, 0

    def req(self, total: int, computed: int) -> NewReq:
        num_blocks = total // 16 + 2
        if self.next_block + num_blocks > NUM_BLOCKS - 192:
            self.next_block = 0
        blocks = list(range(self.next_block, self.next_block + num_blocks))
        self.next_block += num_blocks
        self.num_reqs += 1
        tokens = list(range(1000, 1000 + total))
        return NewReq(f"r{self.num_reqs}", tokens, total, GREEDY, blocks, computed, total - computed, -1)

    def plan(self, num_decodes: int, prompts: list[tuple[int, int]]) -> StepPlan:
        reqs = [self.req(320, 319) for _ in range(num_decodes)]
        reqs += [self.req(cached + new, cached) for cached, new in prompts]
        return StepPlan(self.num_reqs, new_reqs=reqs)


def device_ms(runner: ModelRunner, plan: StepPlan) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9 * 0.05))  # the host runs ahead of the device
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launched = runner.launch(plan)
    end.record()
    runner.complete(launched)
    torch.cuda.synchronize()
    runner.requests.reqs.clear()
    return start.elapsed_time(end)


def main() -> None:
    config = EngineConfig(
        model_dir=write_model_dir(tempfile.mkdtemp(prefix="bench_step_mix_")),
        served_model_name="bench",
        max_model_len=1024,
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=256,
        block_size=16,
        load_format="dummy",
        num_kv_blocks=NUM_BLOCKS,
        max_num_batched_tokens=2048,
    )
    started = time.time()
    runner = ModelRunner(config)
    print(f"runner built in {time.time() - started:.1f} s", flush=True)
    plans = Plans()
    for name, (num_decodes, prompts) in CASES.items():
        for _ in range(2):
            runner.execute(plans.plan(num_decodes, prompts))
            runner.requests.reqs.clear()
        times = sorted(device_ms(runner, plans.plan(num_decodes, prompts)) for _ in range(5))
        print(f"{name}: device ms median {times[2]:.3f} min {times[0]:.3f}", flush=True)


if __name__ == "__main__":
    main()
