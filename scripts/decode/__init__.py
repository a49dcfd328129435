"""Decode-step benchmarks and probes: one model runner, kernels, tensor-parallel steps."""
