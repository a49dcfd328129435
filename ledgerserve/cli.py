"""`ledgerserve serve` and `ledgerserve replay`."""

from __future__ import annotations

import argparse
import sys

from ledgerserve.shared.config import EngineConfig


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("model_dir", nargs="?", default=None, help="local HF checkpoint directory (default: the demo model)")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--served-model-name", default=None, help="model id in the API (default: the directory's name)")
    add(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto: float32 on CPU, bfloat16 on CUDA",
    )
    add("--device", choices=["auto", "cpu", "cuda"], default="auto")
    add("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    add("--max-num-seqs", type=int, default=None, help="requests per step (default 256 on CUDA, 64 on CPU)")
    add("--max-num-batched-tokens", type=int, default=2048, help="tokens per step (chunked-prefill budget)")
    add("--block-size", type=int, default=16, help="tokens per KV block")
    add("--num-kv-blocks", type=int, default=None, help="KV pool size; overrides --gpu-memory-utilization")
    add("--gpu-memory-utilization", type=float, default=0.9)
    add("--load-format", choices=["auto", "safetensors", "dummy"], default="auto")
    add("--seed", type=int, default=0)
    add("--event-log-dir", default=None, help="default: ~/.cache/ledgerserve/events")
    add("--shutdown-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM")
    add("--tensor-parallel-size", type=int, default=1)
    add("--enforce-eager", action="store_true", help="no CUDA graphs: run every decode step eagerly")
    add(
        "--async-scheduling",
        action="store_true",
        help="plan step s + 1 while step s runs, so the GPU does not wait on the scheduler between steps",
    )
    add("--api-key", default=None, help="require this Bearer key on every /v1 route (or set LEDGERSERVE_API_KEY)")
    add("--max-request-bytes", type=int, default=8 * 1024 * 1024, help="largest HTTP request body")
    add("--max-n", type=int, default=16, help="most choices (n) per request")
    add("--max-waiting-requests", type=int, default=1024, help="queue bound; past it, 503 with Retry-After")
    add(
        "--event-log-fsync",
        choices=["never", "step", "always"],
        default="step",
        help="step: at most one fsync per step, after its records",
    )
    add("--event-log-max-bytes", type=int, default=256 * 1024 * 1024, help="rotate log segments past this size")
    add(
        "--event-log-max-total-bytes",
        type=int,
        default=EngineConfig.event_log_max_total_bytes,
        help="bound of the event-log directory: past it the oldest runs, then the oldest segments of this run, "
        "are removed (0: unlimited)",
    )
    add("--enable-lora", action="store_true", help="serve LoRA adapters")
    add(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME=PATH",
        help='adapters loaded at start-up (trusted): NAME=PATH or JSON {"name": ..., "path": ..., "pinned": false}',
    )
    add("--max-loras", type=int, default=8, help="GPU adapter slots = distinct adapters per step")
    add("--max-lora-rank", type=int, default=64)
    add(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapter versions kept in CPU memory (default: max(32, --max-loras))",
    )
    add(
        "--lora-allowed-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="root that adapters loaded at run time must resolve inside (repeatable); none: runtime loading is refused",
    )
    add(
        "--lora-overlap-loading",
        action=argparse.BooleanOptionalAction,
        default=EngineConfig.lora_overlap_loading,
        help="load adapters (disk -> CPU -> GPU slot) beside the running steps, prefetching from the waiting queue; "
        "--no-lora-overlap-loading loads each in command order, before the step that needs it",
    )
    add(
        "--lora-resolve-dir",
        default="",
        metavar="DIR",
        help="a request whose model is an unknown name N loads the adapter DIR/N on demand "
        "(DIR inside a --lora-allowed-dir)",
    )
    add(
        "--max-on-demand-loras",
        type=int,
        default=EngineConfig.max_on_demand_loras,
        metavar="N",
        help="adapters registered on demand at once; a new one unregisters the least recently used idle one past it",
    )
    add(
        "--lora-max-wait-steps",
        type=int,
        default=EngineConfig.lora_max_wait_steps,
        help="steps an adapter request may be overtaken by requests of resident adapters before nothing may pass it",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ledgerserve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_args(sub.add_parser("serve", help="start the server (launcher, tokenizer, scheduler, workers)"))
    sub.add_parser("replay", help="replay and verify an event log", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "replay":
        from ledgerserve.scheduler_proc.replay import main as replay_main

        return replay_main(argv[1:])
    args = build_parser().parse_args(argv)
    from ledgerserve.launcher import serve

    return serve(args)


if __name__ == "__main__":
    sys.exit(main())
