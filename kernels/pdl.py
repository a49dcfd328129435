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

import ctypes
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ledgerserve.shared import env


@functools.lru_cache
def _capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL (read per call: tests flip the variable)."""
    return env.pdl_wanted() and _capable(device)


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Under PDL: wait until the previous kernel has finished (its writes visible), then let the
    next kernel launch; only now, so at most one kernel runs ahead, never a chain of waiting ones."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


# A captured graph's edges into a PDL kernel from a kernel that never triggers its dependents
# (cuBLAS's GEMMs and split-K reduces) activate when that kernel's blocks have all exited. Moved to
# the "launch completion" port, they activate once its blocks have all begun: the dependent's
# programs then load what no kernel writes (LoRA B, the step's inputs) while the GEMM runs, and
# wait in gdc_wait, which still waits for the GEMM to finish and flush its writes. Every program
# of the GEMM is already resident by then, so the dependent's programs take no SM from it. On an
# H200, A/B on two machines, the batch-32 step's GPU time went 4.97 -> 4.86 and 4.91 -> 4.88 ms
# (base), 5.76 -> 5.61 and 5.89 -> 5.77 ms (32 adapters); 4 adapters and batch 1 did not move.
_PORT_PROGRAMMATIC, _PORT_LAUNCH_COMPLETION = 1, 2  # CU_GRAPH_KERNEL_NODE_PORT_*
_TYPE_PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC


class _EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [
        ("from_port", ctypes.c_ubyte),
        ("to_port", ctypes.c_ubyte),
        ("type", ctypes.c_ubyte),
        ("reserved", ctypes.c_ubyte * 5),
    ]


@functools.lru_cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _call(fn, *args) -> None:
    status = fn(*args)
    if status != 0:
        raise RuntimeError(f"{fn.__name__} failed with CUresult {status}")


Edge = tuple[int, int, int, int]  # source node, destination node, dependency type, source port


def _edges(graph: ctypes.c_void_p) -> list[tuple[Edge, _EdgeData]]:
    drv = _driver()
    count = ctypes.c_size_t(0)
    _call(drv.cuGraphGetEdges_v2, graph, None, None, None, ctypes.byref(count))
    n = count.value
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (_EdgeData * n)()
    _call(drv.cuGraphGetEdges_v2, graph, src, dst, data, ctypes.byref(count))
    return [((s or 0, d or 0, e.type, e.from_port), e) for s, d, e in zip(src, dst, data)]


def edges_to_move(edges: list[Edge]) -> list[int]:
    """Indices of the programmatic edges, still on the programmatic port, whose source was not
    itself launched with PDL (no programmatic edge into it): a kernel that never triggers."""
    pdl_launched = {dst for _, dst, kind, _ in edges if kind == _TYPE_PROGRAMMATIC}
    return [
        i
        for i, (src, _, kind, port) in enumerate(edges)
        if kind == _TYPE_PROGRAMMATIC and port == _PORT_PROGRAMMATIC and src not in pdl_launched
    ]


def _move_edge(graph: ctypes.c_void_p, src: int, dst: int, data: _EdgeData) -> bool:
    """Re-add the edge on the launch-completion port; if the driver refuses, put it back as it was."""
    one_src, one_dst = (ctypes.c_void_p * 1)(src), (ctypes.c_void_p * 1)(dst)
    drv = _driver()
    _call(drv.cuGraphRemoveDependencies_v2, graph, one_src, one_dst, (_EdgeData * 1)(data), ctypes.c_size_t(1))
    early = _EdgeData(_PORT_LAUNCH_COMPLETION, data.to_port, data.type)
    if drv.cuGraphAddDependencies_v2(graph, one_src, one_dst, (_EdgeData * 1)(early), ctypes.c_size_t(1)) == 0:
        return True
    _call(drv.cuGraphAddDependencies_v2, graph, one_src, one_dst, (_EdgeData * 1)(data), ctypes.c_size_t(1))
    return False


def launch_after_block_start(raw_graph: int) -> int:
    """Move edges_to_move's edges to the launch-completion port (see above); returns how many
    moved (0 with a driver older than CUDA 12.3's edge API). raw_graph: torch's raw_cuda_graph()
    of a graph captured with keep_graph=True."""
    if not hasattr(_driver(), "cuGraphGetEdges_v2"):
        return 0
    graph = ctypes.c_void_p(raw_graph)
    edges = _edges(graph)
    moved = 0
    for i in edges_to_move([edge for edge, _ in edges]):
        (src, dst, _, _), data = edges[i]
        moved += _move_edge(graph, src, dst, data)
    return moved
