"""Adapter movement micro-benchmark (one device, no server).

Measures the pinned host -> device bandwidth (one large copy), the page-cache read bandwidth
(a large file read twice, the second timed), then for random Llama-3-8B-shaped adapters of
each `--ranks` (seven projections, bf16, written to a temp dir; `--model-dir` takes the shapes
from its config.json) the time of disk -> CPU file image (page cache warm, the content digest
checked as for a registered version) and CPU image -> GPU slot (timed with events on the copy
stream: the host -> device copies alone, and with the casting copies into the slot), and
prints them as JSON with their ratios to the measured bandwidths.

    python -m scripts.adapters.bench_adapter_load --ranks 8,16,64 --out adapter_load.json
    python -m scripts.adapters.bench_adapter_load --device cpu --small     # shapes for a quick CPU run
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from ledgerserve.shared.adapter_format import BaseShapes
from ledgerserve.worker_proc.lora.file_image import ImageBytes, SlotLayout
from ledgerserve.worker_proc.lora.pinned_pool import PinnedPool, page_bytes_for
from ledgerserve.worker_proc.lora.reader import ReadSpec, read_image
from ledgerserve.worker_proc.lora.slot_copy import SlotCopier, flat_tables, staging_bytes
from ledgerserve.worker_proc.lora.weights import LoraWeights
from scripts.common.bench_fixtures import LLAMA3_8B, adapter_digest, write_adapter
from scripts.common.report_files import read_json, write_json

SMALL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
}


def main(argv: list[str] | None = None) -> dict:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    base = _base(args)
    max_rank = max(args.ranks)
    weights = _slot_buffers(base, max_rank, device)
    ranks, scalings = flat_tables(weights)
    layout = SlotLayout(weights)
    max_image = layout.max_image_bytes(max_rank)
    copier = SlotCopier(weights, layout, ranks, scalings, staging_bytes(layout, max_rank), device)
    pool = PinnedPool(2 * max_image + (64 << 20), page_bytes_for(max_image), pin=device.type == "cuda")
    spec = ReadSpec(base, max_rank, (), layout, torch.bfloat16)
    report = {
        "device": str(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"),
        "pinned_h2d_GBps": _h2d_bandwidth(device, args.copy_mib << 20, args.repeats) / 1e9,
        "file_read_GBps": _file_bandwidth(args.read_mib << 20, args.repeats) / 1e9,
        "adapters": [],
    }
    with tempfile.TemporaryDirectory() as root:
        for i, rank in enumerate(args.ranks):
            path = write_adapter(root, i, base, rank, "cpu")
            report["adapters"].append(_adapter(report, spec, pool, copier, path, rank, args.repeats))
    print(json.dumps(report, indent=2))
    if args.out:
        write_json(args.out, report)
    return report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model-dir", help="take the shapes from this config.json (default: Llama-3-8B)")
    p.add_argument("--small", action="store_true", help="small shapes, for a quick run on the CPU")
    p.add_argument("--ranks", type=lambda s: [int(r) for r in s.split(",")], default=[8, 16, 64])
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the pinned bandwidth copy")
    p.add_argument("--read-mib", type=int, default=1024, help="size of the file read twice")
    p.add_argument("--repeats", type=int, default=5, help="each time is the best of this many")
    p.add_argument("--out", help="also write the JSON report here")
    return p


def _base(args: argparse.Namespace) -> BaseShapes:
    if args.model_dir:
        return BaseShapes.from_hf_config(read_json(os.path.join(args.model_dir, "config.json"), "the model's config"))
    return BaseShapes.from_hf_config({**LLAMA3_8B, **(SMALL if args.small else {})})


def _slot_buffers(base: BaseShapes, max_rank: int, device: torch.device) -> dict[str, LoraWeights]:
    """One slot's buffers for every projection of every layer, as the worker stacks them."""
    h, i = base.hidden_size, base.intermediate_size
    fused = {
        "self_attn.qkv_proj": (h, [base.q_size, base.kv_size, base.kv_size]),
        "self_attn.o_proj": (base.q_size, [h]),
        "mlp.gate_up_proj": (h, [i, i]),
        "mlp.down_proj": (i, [h]),
    }
    return {
        f"model.layers.{layer}.{name}": LoraWeights(1, max_rank, n_in, outs, torch.bfloat16, device)
        for layer in range(base.num_layers)
        for name, (n_in, outs) in fused.items()
    }


def _adapter(
    report: dict, spec: ReadSpec, pool: PinnedPool, copier: SlotCopier, path: str, rank: int, repeats: int
) -> dict:
    read_s, image = float("inf"), None
    digest = adapter_digest(path)  # as registered: the read is checked against it
    for _ in range(repeats + 1):  # the first read fills the page cache
        if image is not None:
            pool.free(list(image.extents))
        start = time.perf_counter()
        image = read_image(spec, pool, 0, path, digest)
        read_s = min(read_s, time.perf_counter() - start)
    h2d_s, slot_s = _slot_times(copier, pool, image, repeats)
    pool.free(list(image.extents))
    file_bytes, image_bytes = image.num_file_bytes, image.layout.num_bytes
    read_bw, h2d_bw, slot_bw = file_bytes / read_s, image_bytes / h2d_s, image_bytes / slot_s
    return {
        "rank": rank,
        "file_bytes": file_bytes,
        "image_bytes": image_bytes,
        "num_extents": len(image.extents),
        "disk_to_cpu_ms": read_s * 1e3,
        "disk_to_cpu_GBps": read_bw / 1e9,
        "disk_ratio": read_bw / (report["file_read_GBps"] * 1e9),
        "h2d_ms": h2d_s * 1e3,
        "h2d_GBps": h2d_bw / 1e9,
        "h2d_ratio": h2d_bw / (report["pinned_h2d_GBps"] * 1e9),
        "cpu_to_slot_ms": slot_s * 1e3,
        "cpu_to_slot_GBps": slot_bw / 1e9,
        "slot_ratio": slot_bw / (report["pinned_h2d_GBps"] * 1e9),
    }


def _slot_times(copier: SlotCopier, pool: PinnedPool, image, repeats: int) -> tuple[float, float]:
    """Best seconds of the image's host -> device copies alone, and of the whole slot copy."""
    scatter = copier.scatter(0, image.layout)
    h2d, whole = float("inf"), float("inf")
    for _ in range(repeats + 1):
        whole = min(whole, _timed(copier, lambda: copier.copy(image, pool, scatter, None)))
        h2d = min(h2d, _timed(copier, lambda: _h2d_only(copier, pool, image)))
    return h2d, whole


def _h2d_only(copier: SlotCopier, pool: PinnedPool, image) -> None:
    """The image's bytes into the staging buffer, in turns of at most its size."""
    staging = copier.staging
    for view in ImageBytes([pool.view(e) for e in image.extents]).ranges(0, image.layout.num_bytes):
        for part in view.split(staging.numel()):
            staging[: part.numel()].copy_(part, non_blocking=True)


def _timed(copier: SlotCopier, fn) -> float:
    if copier.stream is None:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(copier.stream):
        begin.record()
        fn()
        end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def _h2d_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Bytes/s of one large copy from pinned host memory to the device (host memory on a CPU)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda").fill_(1)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            best = min(best, begin.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - start)
    return num_bytes / best


def _file_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes/s of reading a file from the page cache into memory, as the loader reads."""
    buffer = torch.empty(num_bytes, dtype=torch.uint8)
    view = memoryview(buffer.numpy())
    with tempfile.NamedTemporaryFile() as f:
        f.write(os.urandom(1 << 20) * (num_bytes >> 20))
        f.flush()
        best = float("inf")
        for _ in range(repeats + 1):  # the first read (right after the write) may not be cached
            start = time.perf_counter()
            done = 0
            while done < num_bytes:
                done += os.preadv(f.fileno(), [view[done : done + (16 << 20)]], done)
            best = min(best, time.perf_counter() - start)
    return num_bytes / best


if __name__ == "__main__":
    main()
