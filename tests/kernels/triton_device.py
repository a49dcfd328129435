"""Where the Triton kernel tests run: CUDA, or the CPU under TRITON_INTERPRET=1 (slow, for debugging)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_triton_device = pytest.mark.skipif(DEVICE != "cuda" and not INTERPRET, reason="needs CUDA")

# bf16 keeps 8 mantissa bits, fp16 11: tolerances against float32 references
TOL = {torch.bfloat16: 3e-2, torch.float16: 5e-3}
DTYPES = [torch.bfloat16, torch.float16]
