"""The space of run_workload's seed and limits the hypothesis tests draw from (small enough to
preempt); the workloads themselves are ledgerserve/sim/workload.py."""

from __future__ import annotations

from hypothesis import strategies as st

# run_workload's seed and the pool and batch limits it runs under: small enough to preempt
WORKLOAD_SPACE = dict(
    seed=st.integers(0, 2**32 - 1),
    num_kv_blocks=st.integers(6, 24),
    max_num_seqs=st.integers(1, 6),
    max_num_batched_tokens=st.integers(1, 40),
)
