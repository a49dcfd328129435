from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ledgerserve.demo_model import ensure_demo_model


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_is_deterministic(demo_model_dir: str, tmp_path: Path) -> None:
    again = Path(ensure_demo_model(str(tmp_path / "again")))
    first = Path(demo_model_dir)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in again.iterdir())
    for name in ("tokenizer.json", "model.safetensors", "config.json", "tokenizer_config.json"):
        assert _sha(first / name) == _sha(again / name), name


def test_second_call_reuses_cache(demo_model_dir: str) -> None:
    before = (Path(demo_model_dir) / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(demo_model_dir) == demo_model_dir
    assert (Path(demo_model_dir) / "model.safetensors").stat().st_mtime_ns == before


def test_files_say_weights_are_random(demo_model_dir: str) -> None:
    assert "RANDOM" in (Path(demo_model_dir) / "README.md").read_text()
    config = json.loads((Path(demo_model_dir) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert "random" in config["ledgerserve_note"]


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


def test_auto_tokenizer_round_trip(tokenizer) -> None:
    text = "The morning train left the station. café 🙂 你好"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert 1024 <= len(tokenizer) <= 2048
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") == 1


def test_generation_config_lists_eos_ids(demo_model_dir: str, tokenizer) -> None:
    gen = json.loads((Path(demo_model_dir) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id]


def test_chat_template_is_chatml(tokenizer) -> None:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
