"""cuBLASLt through ctypes: `y = x W^T` with a chosen algorithm, for the decode GEMMs.

torch's `F.linear` lets cuBLAS's heuristic pick one kernel per shape. At the decode shapes
(a few dozen rows, weights of 4096-28800 rows) that pick is often not the fastest, and the
stacked LoRA weights (A under the base weight) get a different, slower pick than the base
weight beside them. This module asks cuBLASLt's heuristic for its candidate algorithms for a
shape, so the caller can time them and keep the fastest (kernels/gemm_tuning.py).

Only the TN bf16 / fp16 GEMM with float32 accumulation and no bias is covered: D [N, M]
column-major = W [N, K] (row-major, so transposed) x X^T, that is y [M, N] row-major.
Calls enqueue on torch's current stream, so they are captured by CUDA graphs like torch's own.
They share one workspace per device, so they must run on one stream at a time (the worker's).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

_OP_N, _OP_T = 0, 1
_COMPUTE_32F = 68  # cublasComputeType_t CUBLAS_COMPUTE_32F
_R_32F = 0  # cudaDataType_t
_DTYPES = {torch.float16: 2, torch.bfloat16: 14}
_DESC_TRANSA, _DESC_TRANSB = 3, 4  # cublasLtMatmulDescAttributes_t
_PREF_MAX_WORKSPACE_BYTES = 1  # cublasLtMatmulPreferenceAttributes_t
WORKSPACE_BYTES = 32 * 1024 * 1024


class Algo(ctypes.Structure):  # cublasLtMatmulAlgo_t
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [
        ("algo", Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


class CublasLtError(RuntimeError):
    pass


def _loaded_path() -> str | None:
    """The libcublasLt this process has loaded, from its memory map (the one torch uses)."""
    with open("/proc/self/maps", encoding="utf-8") as f:
        for line in f:
            path = line.split()[-1]
            if "libcublasLt.so" in path:
                return path
    return None


@functools.lru_cache
def _lib() -> ctypes.CDLL:
    path = _loaded_path()
    if path is None:  # torch loads cuBLAS on its first half-precision GEMM
        probe = torch.ones(16, 16, dtype=torch.float16, device=torch.cuda.current_device())
        torch.mm(probe, probe)
        path = _loaded_path()
    if path is None:
        raise CublasLtError("libcublasLt is not loaded in this process")
    lib = ctypes.CDLL(path)
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
    lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
    lib.cublasLtMatrixLayoutCreate.argtypes = [
        ctypes.POINTER(vp),
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.c_uint64,
        ctypes.c_int64,
    ]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [
        vp,
        vp,
        vp,
        vp,
        vp,
        vp,
        vp,
        ctypes.c_int,
        ctypes.POINTER(_HeuristicResult),
        ctypes.POINTER(ctypes.c_int),
    ]
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, ctypes.POINTER(Algo), vp, sz, vp]
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise CublasLtError(f"{what} failed with cublasStatus {status}")


@functools.lru_cache
def _handle(device_index: int) -> ctypes.c_void_p:
    handle = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_lib().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


@functools.lru_cache
def _workspace(device_index: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


@dataclass(frozen=True)
class GemmShape:
    """y [m, n] (row stride ldy) = x [m, k] @ W [n, k]^T."""

    m: int
    n: int
    k: int
    ldy: int
    dtype: torch.dtype


class _Plan:
    """The descriptors of one GemmShape (kept alive: cuBLASLt holds pointers to them)."""

    def __init__(self, shape: GemmShape) -> None:
        lib, vp = _lib(), ctypes.c_void_p
        dt = _DTYPES[shape.dtype]
        self.desc, self.a, self.b, self.d = vp(), vp(), vp(), vp()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate")
        for attr, op in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            value = ctypes.c_int32(op)
            _check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4), "DescSetAttribute")
        # column-major views: W is [k, n] (ld k), x is [k, m] (ld k), y is [n, m] (ld ldy)
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.a), dt, shape.k, shape.n, shape.k), "LayoutCreate")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.b), dt, shape.k, shape.m, shape.k), "LayoutCreate")
        _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(self.d), dt, shape.n, shape.m, shape.ldy), "LayoutCreate")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)


@functools.cache
def _plan(shape: GemmShape) -> _Plan:
    return _Plan(shape)


@functools.lru_cache
def _preference() -> ctypes.c_void_p:
    """The heuristic's search preference, made once: candidates may use up to WORKSPACE_BYTES."""
    lib, pref = _lib(), ctypes.c_void_p()
    _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
    limit = ctypes.c_uint64(WORKSPACE_BYTES)
    _check(
        lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(limit), 8),
        "PreferenceSetAttribute",
    )
    return pref


def candidates(shape: GemmShape, device_index: int, max_count: int = 32) -> list[Algo]:
    """cuBLASLt's heuristic candidates for `shape`, best-estimated first (the first is what the
    heuristic alone would run)."""
    lib, plan = _lib(), _plan(shape)
    results = (_HeuristicResult * max_count)()
    count = ctypes.c_int(0)
    _check(
        lib.cublasLtMatmulAlgoGetHeuristic(
            _handle(device_index),
            plan.desc,
            plan.a,
            plan.b,
            plan.d,
            plan.d,
            _preference(),
            max_count,
            results,
            ctypes.byref(count),
        ),
        "AlgoGetHeuristic",
    )
    return [_copy_algo(results[i].algo) for i in range(count.value) if results[i].state == 0]


def _copy_algo(algo: Algo) -> Algo:
    out = Algo()
    ctypes.memmove(ctypes.byref(out), ctypes.byref(algo), ctypes.sizeof(Algo))
    return out


def matmul_into(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, algo: Algo) -> None:
    """y [m, n] (rows may be strided) = x [m, k] @ weight [n, k]^T with `algo`, on the current stream."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.is_contiguous() and weight.is_contiguous() and y.stride(1) == 1 and x.dtype == weight.dtype == y.dtype
    shape = GemmShape(m, n, k, y.stride(0), x.dtype)
    plan, device_index = _plan(shape), x.device.index
    stream = torch.cuda.current_stream(x.device).cuda_stream
    _check(
        _lib().cublasLtMatmul(
            _handle(device_index),
            plan.desc,
            ctypes.byref(plan.alpha),
            weight.data_ptr(),
            plan.a,
            x.data_ptr(),
            plan.b,
            ctypes.byref(plan.beta),
            y.data_ptr(),
            plan.d,
            y.data_ptr(),
            plan.d,
            ctypes.byref(algo),
            _workspace(device_index).data_ptr(),
            WORKSPACE_BYTES,
            stream,
        ),
        "cublasLtMatmul",
    )
