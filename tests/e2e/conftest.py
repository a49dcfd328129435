"""Fixtures shared by the HTTP suites."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.model_factory import make_tiny_checkpoint

SCHEDULING_ARGS = {"one-step": [], "async": ["--async-scheduling"]}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module", params=sorted(SCHEDULING_ARGS, reverse=True))
def scheduling(request) -> str:
    """A module's server runs once per scheduling loop: the one-step loop, then async scheduling."""
    return request.param


@pytest.fixture(scope="session")
def tiny_llama_dir(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama (GQA with 2 KV heads, llama3 rope scaling, untied lm_head) that the real
    server can serve: the demo model's tokenizer files, and a vocabulary of the tokenizer's size."""
    from transformers import AutoTokenizer

    vocab_size = len(AutoTokenizer.from_pretrained(demo_model_dir))
    path = Path(
        make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama") / "tiny-llama", vocab_size=vocab_size)
    )
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(demo_model_dir) / name, path / name)
    return str(path)
