"""Programmatic dependent launch (PDL, sm_90+) for the decode path's Triton kernels.

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is
still running. Each program loads what no kernel of the step writes (weights, LoRA B, norm
weights, the step's input row), waits for the previous kernel to finish (`gdc_wait`), and only
then lets the next kernel launch (`gdc_launch_dependents`) and reads activations or writes
anything (`wait_for_previous`). So at most one kernel runs ahead, and since every program
waits before it exits, a kernel finishing implies every kernel before it finished. On an H200
a 32-layer chain of batch-1 GEMVs went 3456 -> 3311 us, and a cuBLAS o_proj GEMM followed by
the delta-adding RMSNorm 608 -> 512 us for 32 layers.

LEDGERSERVE_PDL=0 turns it off (the kernels then skip both instructions and launch as usual).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.lru_cache
def _capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (read per call: tests flip the variable)."""
    return os.environ.get("LEDGERSERVE_PDL", "1") != "0" and _capable(device)


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel has finished (its writes visible), then let the
    next kernel launch; only now, so at most one kernel runs ahead, never a chain of waiting ones."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
