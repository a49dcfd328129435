"""One hostile adapter never changes another request's answer (tests/worker_proc/hostile_runs.py):
with finite but huge weights in slot 0, every base request and every request on another adapter,
batched with slot 0's, gets the same tokens and logits, bit for bit, as beside a clean adapter
there; and an adapter whose values overflow only once cast to the model's dtype fails its load
even when the SHA-256 it was registered with matches its files. On the CPU (the torch references,
float32), and on CUDA in bfloat16 with the Triton kernels eagerly and through the decode graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ledgerserve.shared.events import AdapterLoadFailed
from ledgerserve.worker_proc.runner import ModelRunner
from tests.worker_proc import hostile_runs
from tests.worker_proc.lora_setup import LoraSetup, lora_config


def _control(runner: ModelRunner, setup: LoraSetup, tmp_path: Path) -> tuple[hostile_runs.Run, dict[str, str]]:
    """The run beside a clean adapter in slot 0; then the hostile adapters are loaded (one fails)."""
    dirs = hostile_runs.hostile_dirs(setup, tmp_path, runner.dtype)
    hostile_runs.load_control(runner, setup)
    control = hostile_runs.run(runner, setup)
    failed = hostile_runs.load_hostile(runner, dirs)
    assert isinstance(failed, AdapterLoadFailed) and failed.slot == hostile_runs.CAST_SLOT, failed
    assert "overflows-once-cast" in failed.message and "NaN or infinite values once cast" in failed.message
    assert hostile_runs.CAST_SLOT not in runner.lora.slots  # nothing is served from it
    return control, dirs


def _hostile(runner: ModelRunner, setup: LoraSetup, control: hostile_runs.Run) -> hostile_runs.Run:
    hostile = hostile_runs.run(runner, setup)
    hostile_runs.assert_contained(control, hostile)
    return hostile


def test_a_hostile_adapter_changes_no_other_row_on_the_cpu(lora_setup: LoraSetup, tmp_path: Path) -> None:
    runner = ModelRunner(lora_config(lora_setup.base_dir))
    control, _ = _control(runner, lora_setup, tmp_path)
    hostile = _hostile(runner, lora_setup, control)
    assert {"Segments", "Tokens"} <= hostile.layouts  # prefill chunks and decode rows beside slot 0's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_a_hostile_adapter_changes_no_other_row_on_cuda(
    lora_setup: LoraSetup, tmp_path: Path, graphs: bool, dtype: str
) -> None:
    """Eager: the Triton segment and per-token kernels. Graphs: decode steps replay the LoRA graphs
    (the stacked GEMM, the norms and SiLU-mul adding the pending delta, the grouped lm_head)."""
    runner = ModelRunner(lora_config(lora_setup.base_dir, device="cuda", dtype=dtype, enforce_eager=not graphs))
    assert (runner.graphs is not None) == graphs
    control, _ = _control(runner, lora_setup, tmp_path)
    replays = 0 if runner.graphs is None else runner.graphs.replays
    hostile = _hostile(runner, lora_setup, control)
    assert "Segments" in hostile.layouts  # the prefill chunks beside slot 0's ran eagerly
    if graphs:
        assert runner.graphs is not None and runner.graphs.replays > replays
    else:
        assert "Tokens" in hostile.layouts
