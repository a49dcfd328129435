from __future__ import annotations

import os

import pytest

from tests.worker_proc.lora_setup import LoraSetup, build_setup


@pytest.fixture(scope="session")
def lora_setup(tmp_path_factory: pytest.TempPathFactory) -> LoraSetup:
    """A tiny llama, four PEFT adapters and their greedy references, built once."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return build_setup(str(tmp_path_factory.mktemp("lora")))
