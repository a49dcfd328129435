"""Offline decode throughput of the worker: ModelRunner driven directly (no IPC) with
Llama-3-8B shapes, dummy bf16 weights, batch sizes 1..256 and 0 / 1 / 4 / 32 distinct
rank-16 adapters on all seven projections. Beside each step time: the memory-bandwidth
floor (weights + adapters + KV read, over the device copy bandwidth measured here) and
the forward's GPU time alone (queued behind a sleep kernel, timed with events), and the share
of the timed steps in which the GPU sat idle waiting on the host (events around each step's
launch, see scripts/decode_churn.py). `--churn-slots K` also measures every row while K spare slots reload
adapters the whole time (overlapped loading; every other load from the CPU tier, the rest read
from disk), beside the same row without. Prints JSON. `--async-scheduling` drives the
runner as the engine does with that flag: each step's plan is launched before the step ahead
of it is read back, its requests fed the tokens that step samples on the device.
`--e2e` instead runs bench_peft.py's workload end to end (one request per adapter, prefill
`--prompt-len` then `--gen-len` greedy tokens, wall time over it all).
`--tensor-parallel-size N` runs the sweep with the model split over N rank processes
(scripts/bench_decode_tp.py; `--compare-tp1`: TP 1 in the same run), beside each step the
all-reduce time and the bandwidth floor of one rank's shard.

    python scripts/bench_decode.py --out bench.json
    python scripts/bench_decode.py --e2e --batch-sizes 32 --adapters 32 --out ours.json  # 128 + 128 tokens
    python -m scripts.bench_decode --batch-sizes 32 --adapters 4 --churn-slots 2 --async-scheduling
    python -m scripts.bench_decode --tensor-parallel-size 2 --compare-tp1 --batch-sizes 1,32 --adapters 0,4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from ledgerserve.kernels import gemm_tuning, ops
from ledgerserve.shared.adapter_format import BaseShapes
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import AdapterSlotAssigned, CachedReq, NewReq, StepPlan
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.runner import InFlightStep, ModelRunner
from ledgerserve.worker_proc.step_inputs import build_step_inputs
from scripts.bench_fixtures import (
    LLAMA3_8B,
    adapter_bytes,
    copy_bandwidth,
    kv_bytes,
    weight_bytes,
    write_adapter,
    write_model_dir,
)
from scripts.decode_churn import LoadChurn, StepClock

BLOCK = 16
GREEDY = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
TP_UNUSED_FLAGS = [("--churn-slots", "churn_slots"), ("--e2e", "e2e")]
SLEEP_CYCLES = 500_000_000  # ~0.25 s at ~2 GHz: longer than the CPU takes to queue one step


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
        reqs = [runner.reqs[rid] for rid in self.live]
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
            ops.argmax(graphs.run(reqs, BLOCK, staging))
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


def end_to_end(
    runner: ModelRunner, batch: int, num_adapters: int, prompt_len: int, gen_len: int, ahead: bool = False
) -> dict:
    """Prefill `batch` prompts then decode to `gen_len` output tokens each; tokens/s over the wall time.
    Each step returns its sampled tokens to the host, so the clock stops on finished work."""
    bench = Bench(runner, prompt_len, 0, gen_len, ahead)
    bench.start(batch, num_adapters)  # warm-up: prefill of this shape
    t0 = time.perf_counter()
    last = bench.start(batch, num_adapters)  # the first output token
    if ahead:
        bench.decode_ahead(last, gen_len - 1)
    else:
        for _ in range(gen_len - 1):
            last, _ = bench.decode(last)
    wall = time.perf_counter() - t0
    return dict(
        device=torch.cuda.get_device_name(),
        batch=batch,
        adapters=num_adapters,
        prompt_len=prompt_len,
        async_scheduling=ahead,
        gen_len=gen_len,
        output_tokens=batch * gen_len,
        wall_s=round(wall, 3),
        tok_s=round(batch * gen_len / wall, 1),
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--adapters", default="0,1,4,32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--max-loras", type=int, default=0, help="adapter slots (default: the largest of --adapters)")
    ap.add_argument(
        "--churn-slots",
        type=int,
        default=0,
        help="also time every row while this many spare slots keep loading adapters",
    )
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    ap.add_argument(
        "--async-scheduling",
        action="store_true",
        help="launch each decode step before reading back the one ahead of it (the engine's flag)",
    )
    ap.add_argument("--e2e", action="store_true", help="end to end: batch and adapters from the lists' largest")
    ap.add_argument("--gen-len", type=int, default=128, help="--e2e output tokens per request")
    ap.add_argument("--out", default="")
    _add_tp_and_profile_flags(ap)
    args = ap.parse_args(argv)
    refuse_unused_at_tp(ap, args)
    args.gemv_configs = dict(_gemv_config(ap, text) for text in args.gemv_config)
    args.batches = [int(b) for b in args.batch_sizes.split(",")]
    args.adapter_counts = [int(a) for a in args.adapters.split(",")]
    if args.e2e:
        args.batches, args.adapter_counts = [max(args.batches)], [max(args.adapter_counts)]
    args.max_loras = args.max_loras or max(max(args.adapter_counts), 1) + args.churn_slots
    if args.max_loras < max(args.adapter_counts) + args.churn_slots:
        ap.error(f"--max-loras {args.max_loras} is below --adapters {max(args.adapter_counts)} + --churn-slots")
    return args


def _add_tp_and_profile_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tensor-parallel-size", type=int, default=1, help="rank processes the model is split over")
    ap.add_argument("--compare-tp1", action="store_true", help="with --tensor-parallel-size: TP 1 in the same run")
    ap.add_argument(
        "--disable-custom-all-reduce", action="store_true", help="with --tensor-parallel-size: every all-reduce by NCCL"
    )
    ap.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cpu: float32 (with --tensor-parallel-size)"
    )
    ap.add_argument("--model-dir", default="", help="a checkpoint's shapes, dummy weights (default: Llama-3-8B's)")
    ap.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="with --tensor-parallel-size: after each row, this many more steps under torch.profiler on rank 0, "
        "whose per-kernel table (on the CPU, per op) goes into the row; PDL is off for the run",
    )
    ap.add_argument(
        "--timeline",
        action="store_true",
        help="with --profile-steps: PDL stays on, and each row also holds rank 0's kernels of its last profiled "
        "step in order (name, start and duration in µs)",
    )
    ap.add_argument(
        "--gemv-config",
        action="append",
        default=[],
        metavar="NxK=BN,BK,WARPS,STAGES",
        help="the batch-1 GEMV's configuration for weights of shape N x K, timed in the model's own step",
    )


def _gemv_config(ap: argparse.ArgumentParser, text: str) -> tuple[tuple[int, int], tuple[int, ...]]:
    try:
        shape, config = text.split("=")
        n, k = (int(v) for v in shape.split("x"))
        values = tuple(int(v) for v in config.split(","))
    except ValueError:
        ap.error(f"--gemv-config {text!r}: expected NxK=BN,BK,WARPS,STAGES")
    if len(values) != 4:
        ap.error(f"--gemv-config {text!r}: expected four values after '='")
    return (n, k), values


def use_gemv_configs(args: argparse.Namespace) -> None:
    """--gemv-config's configurations, ahead of kernels/gemv.py's own for their shapes."""
    if args.gemv_configs:
        from ledgerserve.kernels import gemv  # needs triton, which a CPU run may lack

        gemv.MEASURED_BEST.update(args.gemv_configs)


def refuse_unused_at_tp(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The rank sweep times its steps one at a time, with no churn and no end-to-end run."""
    unused = [flag for flag, on in TP_UNUSED_FLAGS if getattr(args, on)]
    if args.tensor_parallel_size > 1 and unused:
        ap.error(f"{', '.join(unused)}: not with --tensor-parallel-size (its steps are timed one at a time)")


def engine_config(args: argparse.Namespace, model_dir: str) -> EngineConfig:
    gen = args.gen_len if args.e2e else args.warmup + args.steps + 2 * args.profile_steps  # host-timed, then profiled
    blocks_per_req = -(-(args.prompt_len + gen + 2) // BLOCK)
    return EngineConfig(
        model_dir=model_dir,
        served_model_name="bench",
        max_model_len=args.prompt_len + max(64, gen + 16),
        dtype="bfloat16" if args.device == "cuda" else "float32",
        device=args.device,
        max_num_seqs=max(args.batches),
        block_size=BLOCK,
        load_format="dummy",
        num_kv_blocks=max(args.batches) * blocks_per_req,
        enable_lora=True,
        max_loras=args.max_loras,
        max_lora_rank=args.rank,
        max_cpu_loras=args.max_loras + 2 * args.churn_slots,
        enforce_eager=args.eager,
        lora_overlap_loading=True,
        disable_custom_all_reduce=args.disable_custom_all_reduce,
    )


def sweep(
    bench: Bench, base: BaseShapes, args: argparse.Namespace, bw: float, churn: LoadChurn | None = None
) -> list[dict]:
    """One row per (adapter count, batch size): step time beside its bandwidth floor; with `churn`,
    each row once more with the churning loads beside the steps."""
    results = []
    for num_adapters in args.adapter_counts:
        for batch in args.batches:
            for row_churn in [None, churn] if churn is not None else [None]:
                row = _row(bench, base, args, bw, batch, num_adapters, row_churn)
                results.append(row)
                print(json.dumps(row), flush=True)
    return results


def _row(
    bench: Bench,
    base: BaseShapes,
    args: argparse.Namespace,
    bw: float,
    batch: int,
    num_adapters: int,
    churn: LoadChurn | None = None,
) -> dict:
    step_ms, gpu_ms, enqueue_ms, mean_len, idle = bench.run(batch, num_adapters, churn)
    distinct = min(num_adapters, batch)
    read = (
        weight_bytes(bench.runner.model, batch)
        + distinct * adapter_bytes(base, args.rank)
        + kv_bytes(base, base.num_layers, [round(mean_len)] * batch)
    )
    floor_ms = read / bw * 1e3
    row = dict(
        batch=batch,
        adapters=distinct,
        step_ms=round(step_ms, 3),
        tok_s=round(batch / step_ms * 1e3, 1),
        floor_ms=round(floor_ms, 3),
        x_floor=round(step_ms / floor_ms, 2),
        gpu_ms=round(gpu_ms, 3),
        gpu_idle=round(idle, 3),
        enqueue_ms=round(enqueue_ms, 2),
    )
    if churn is not None:
        row.update(churn_slots=len(churn.slots), churn_loads=churn.num_loads, churn_sources=churn.sources)
    return row


def main() -> None:
    args = parse_args()
    if args.tensor_parallel_size > 1:
        from scripts.bench_decode_tp import compare

        _report(compare(args, sys.argv[1:]), args.out)
        return
    use_gemv_configs(args)
    root = tempfile.mkdtemp(prefix="bench_decode_")
    base = BaseShapes.from_hf_config(LLAMA3_8B)
    t0 = time.perf_counter()
    runner = ModelRunner(engine_config(args, write_model_dir(root)))  # captures the decode graphs unless --eager
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(max(args.adapter_counts)):
        path = write_adapter(root, i, base, args.rank, "cuda")
        runner.load_adapter(AdapterSlotAssigned(i, i, path))
    adapters_s = time.perf_counter() - t0
    if args.e2e:
        _report(
            end_to_end(
                runner, args.batches[0], args.adapter_counts[0], args.prompt_len, args.gen_len, args.async_scheduling
            ),
            args.out,
        )
        return
    bw = copy_bandwidth(runner.device)
    churn = None
    if args.churn_slots:
        paths = [write_adapter(root, 1000 + i, base, args.rank, "cuda") for i in range(4)]
        churn = LoadChurn(runner, max(args.adapter_counts), args.churn_slots, paths)
    bench = Bench(runner, args.prompt_len, args.warmup, args.steps, args.async_scheduling)
    results = sweep(bench, base, args, bw, churn)
    report = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        copy_bw_GBps=round(bw / 1e9, 1),
        model_load_s=round(load_s, 1),
        adapters_load_s=round(adapters_s, 1),
        graphs=not args.eager,
        max_loras=args.max_loras,
        prompt_len=args.prompt_len,
        rank=args.rank,
        async_scheduling=args.async_scheduling,
        churn_slots=args.churn_slots,
        results=results,
        gemm_tuning=gemm_tuning.report(),
    )
    _report(report, args.out)


def _report(report: dict, out: str) -> None:
    text = json.dumps(report, indent=1)
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
