"""The decode bench's core, which the single-rank sweep (bench_decode.py), the profiler
(profile_decode.py) and the tensor-parallel ranks (tp_steps.py, bench_decode_tp.py) share: `Bench`
feeds a ModelRunner hand-made decode plans and times them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from ledgerserve.kernels import ops
from ledgerserve.shared.events import CachedReq, NewReq, StepPlan
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.runner import InFlightStep, ModelRunner
from ledgerserve.worker_proc.step_inputs import build_step_inputs
from scripts.decode.decode_churn import LoadChurn, StepClock

BLOCK = 16
GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
SLEEP_CYCLES = 500_000_000  # ~0.25 s at ~2 GHz: longer than the CPU takes to queue one step


class NoClock:
    """Bench's step clock, unused by the rank sweep (the GPU-idle share is bench_decode's own figure)."""

    def begin(self) -> None:
        pass

    def end(self) -> None:
        pass


class Bench:
    """Feeds the runner hand-made StepPlans, not ledgerserve.engine: a timed step is the runner's launch and
    read-back alone, as the worker runs it, so its figures stay comparable across versions. The engine's step
    would add the core's host work (taking the tokens in, planning the next step, its state digest) into the
    timed region, and it reads each step back before the next is planned, so it cannot queue step s + 1 behind
    step s (--async-scheduling). The plans are what the core plans here: every request one decode token, its
    blocks allotted up front."""

    def __init__(self, runner: ModelRunner, prompt_len: int, warmup: int, steps: int, ahead: bool = False) -> None:
        self.runner, self.prompt_len, self.warmup, self.steps = runner, prompt_len, warmup, steps
        self.ahead = ahead  # async scheduling: one step in flight while the next is launched
        self.churn: LoadChurn | None = None  # loads kept running beside the timed steps, when set
        self.step_no = 0
        self.live: list[str] = []
        self.blocks_per_req = -(-(prompt_len + warmup + steps + 2) // BLOCK)
        self.slots: dict[str, int] = {}
        self.lengths: dict[str, int] = {}
        self.clock = StepClock()

    def next_plan(self, **kw) -> StepPlan:
        self.step_no += 1
        return StepPlan(self.step_no, **kw)

    def start(self, batch: int, num_adapters: int) -> dict[str, int]:
        """Prefill `batch` fresh requests (slot i % num_adapters, or base); req_id -> last token."""
        gen = torch.Generator().manual_seed(batch * 100 + num_adapters)
        high = min(100000, self.runner.model_cfg.vocab_size)  # Llama-3's ids 1000..99999, or a small model's
        new = []
        for i in range(batch):
            prompt = torch.randint(min(1000, high // 2), high, (self.prompt_len,), generator=gen).tolist()
            blocks = list(range(i * self.blocks_per_req, (i + 1) * self.blocks_per_req))
            slot = i % num_adapters if num_adapters else -1
            new.append(
                NewReq(
                    f"b{batch}a{num_adapters}r{i}", prompt, self.prompt_len, GREEDY, blocks, 0, self.prompt_len, slot
                )
            )
        sampled = self._read(self.runner.launch(self.next_plan(new_reqs=new, finished_req_ids=self.live)))
        self.live = [r.req_id for r in new]
        self.slots = {r.req_id: r.lora_slot for r in new}
        self.lengths = {r.req_id: self.prompt_len for r in new}
        return sampled

    def decode(self, last: dict[str, int]) -> tuple[dict[str, int], float]:
        """One decode step of every live request; (req_id -> sampled token, wall seconds)."""
        cached = [CachedReq(rid, [last[rid]], [], self.lengths[rid], 1, self.slots[rid]) for rid in self.live]
        t0 = time.perf_counter()
        sampled = self._read(self._launch(self.next_plan(cached_reqs=cached)))
        wall = time.perf_counter() - t0
        for rid in self.live:
            self.lengths[rid] += 1
        return sampled, wall

    def decode_ahead(self, last: dict[str, int], num_steps: int) -> tuple[dict[str, int], list[float], list[float]]:
        """`num_steps` decode steps, each launched while the one before runs: its plan sends the
        tokens read back since the last plan and schedules one token past them (the one the step
        in flight samples). Returns the last step's tokens, and per step after the first, the wall
        seconds from its launch to the read-back of the step before it and the mean length then."""
        walls: list[float] = []
        lens: list[float] = []
        to_send = last  # tokens read back, not yet sent to the worker
        in_flight = None
        for _ in range(num_steps):
            cached = [
                CachedReq(rid, [to_send[rid]] if to_send else [], [], self.lengths[rid], 1, self.slots[rid])
                for rid in self.live
            ]
            t0 = time.perf_counter()
            launched = self._launch(self.next_plan(cached_reqs=cached))
            to_send = {}
            if in_flight is not None:
                to_send = self._read(in_flight)
                walls.append(time.perf_counter() - t0)
                lens.append(statistics.mean(self.lengths.values()))
            in_flight = launched
            for rid in self.live:
                self.lengths[rid] += 1
        return self._read(in_flight), walls, lens

    def _launch(self, plan: StepPlan) -> InFlightStep:
        self.clock.begin()
        launched = self.runner.launch(plan)
        self.clock.end()
        if self.churn is not None:
            self.churn.pump()
        return launched

    def _read(self, in_flight: InFlightStep) -> dict[str, int]:
        done, _ = self.runner.complete(in_flight)
        assert not done.failed, done.failed
        return {s.req_id: s.token_id for s in done.sampled}

    def gpu_step(self, meet: Callable[[], None] | None = None) -> tuple[float, float]:
        """(GPU-busy ms, CPU enqueue ms) of the forward + logits + argmax (the sampler's, ops.argmax) of the
        current batch, queued behind a sleep kernel so the GPU never waits for the CPU inside it. `meet`:
        a collective every rank queues behind its sleep (whose length varies with each GPU's clock), so
        the timed step starts with the ranks in step."""
        runner = self.runner
        reqs = [runner.requests.reqs[rid] for rid in self.live]
        for req in reqs:  # re-run the last known decode position (rewrites the same KV slots)
            req.num_computed_tokens, req.num_scheduled_tokens, req.placeholder_row = len(req.token_ids) - 1, 1, -1
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        if meet is not None:
            meet()
        t0 = time.perf_counter()
        if runner.graphs is not None and runner.graphs.fits(reqs):  # inputs copied before `start`, as eager
            graphs, staging = runner.graphs, runner.staging
            assert staging is not None
            start.record()
            ops.argmax(graphs.replay(runner.inputs.stage_graph(reqs)))
        else:
            inputs = build_step_inputs(reqs, BLOCK, runner.device, runner.staging)
            start.record()
            hidden = runner.model(inputs, runner.kv_cache.layers)
            ops.argmax(runner.model.compute_logits(hidden[inputs.sample_indices], inputs.sample_lora))
        end.record()
        enqueue_ms = (time.perf_counter() - t0) * 1e3
        end.synchronize()
        return start.elapsed_time(end), enqueue_ms

    def run(
        self, batch: int, num_adapters: int, churn: LoadChurn | None = None
    ) -> tuple[float, float, float, float, float]:
        """(median step ms, GPU-busy ms, enqueue ms, mean sequence length, GPU idle share) while timed;
        with `churn`, its loads run beside every decode step."""
        last = self.start(batch, num_adapters)
        self.churn = churn
        if churn is not None:
            churn.start()
        try:
            return self._timed(last)
        finally:
            self.churn = None
            if churn is not None:
                churn.stop()

    def _timed(self, last: dict[str, int]) -> tuple[float, float, float, float, float]:
        walls, lens = [], []
        first = len(self.clock.events) + self.warmup
        if self.ahead:
            last, walls, lens = self.decode_ahead(last, self.warmup + self.steps + 1)
            walls, lens = walls[self.warmup :], lens[self.warmup :]
        else:
            for i in range(self.warmup + self.steps):
                last, wall = self.decode(last)
                if i >= self.warmup:
                    walls.append(wall)
                    lens.append(statistics.mean(self.lengths.values()))
        idle = self.clock.idle_share(first)
        gpu_ms, enqueue_ms = self.gpu_step()
        return statistics.median(walls) * 1e3, gpu_ms, enqueue_ms, statistics.mean(lens), idle
