"""bench_decode.py's command line, and the engine settings a run builds its runner from: shared by
the single-rank sweep and the tensor-parallel ranks (bench_decode_tp.py), which parse the same flags."""

from __future__ import annotations

import argparse

from ledgerserve.shared.config import EngineConfig
from scripts.common.bench_fixtures import MODEL_SHAPES
from scripts.decode.decode_bench import BLOCK

DESCRIPTION = "Offline decode throughput of the worker: ModelRunner driven directly (no IPC)."
TP_UNUSED_FLAGS = [("--churn-slots", "churn_slots"), ("--e2e", "e2e")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
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
    ap.add_argument("--model", default="llama3-8b", choices=sorted(MODEL_SHAPES), help="the shapes of the dummy model")
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
