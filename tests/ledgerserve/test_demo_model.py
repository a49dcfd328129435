from __future__ import annotations

import json
from pathlib import Path

import pytest

from ledgerserve import demo_model
from ledgerserve.demo_model import demo_adapters, ensure_demo_model
from ledgerserve.demo_styles import PIRATE_CLOSING, POET_REFRAIN, rewrite

# Determinism (two builds, byte for byte, one without PEFT): tests/test_fresh_install.py.


def test_second_call_reuses_cache(demo_model_dir: str) -> None:
    before = (Path(demo_model_dir) / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_model(demo_model_dir) == demo_model_dir
    assert (Path(demo_model_dir) / "model.safetensors").stat().st_mtime_ns == before


def test_cache_key_follows_the_recipe(monkeypatch, tmp_path: Path) -> None:
    key = demo_model.recipe_digest()
    assert f"demo-{key}" in Path(demo_model.default_cache_dir()).parts
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(demo_model.CORPUS_PATH.read_bytes() + b"One more line.\n")
    monkeypatch.setattr(demo_model, "CORPUS_PATH", corpus)
    assert demo_model.recipe_digest() != key
    assert f"demo-{key}" not in Path(demo_model.default_cache_dir()).parts


def test_files_say_weights_are_trained(demo_model_dir: str) -> None:
    readme = (Path(demo_model_dir) / "README.md").read_text()
    assert "TRAINED" in readme and "RANDOM" not in readme
    config = json.loads((Path(demo_model_dir) / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert "trained" in config["ledgerserve_note"] and "random" not in config["ledgerserve_note"]


def test_adapters_are_peft_loras_the_server_accepts(demo_model_dir: str) -> None:
    from ledgerserve.shared.adapter_format import BaseShapes, read_manifest

    base = BaseShapes.from_hf_config(json.loads((Path(demo_model_dir) / "config.json").read_text()))
    assert [name for name, _ in demo_adapters(demo_model_dir)] == ["pirate", "poet"]
    for _, path in demo_adapters(demo_model_dir):
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16)
        manifest = read_manifest(path, base, max_lora_rank=64, check_weights=True)
        assert len(manifest.content_sha256) == 64


def test_launcher_registers_the_demo_adapters_beside_the_given_ones(demo_model_dir, monkeypatch, tmp_path) -> None:
    from ledgerserve import launcher
    from ledgerserve.cli import build_parser

    monkeypatch.setattr(launcher, "_demo_model_dir", lambda: demo_model_dir)
    own = str(tmp_path / "own-pirate")
    args = build_parser().parse_args(["serve", "--lora-modules", f"pirate={own}", "--device", "cpu"])
    cfg = launcher.resolve_config(args, str(tmp_path))
    poet = dict(demo_adapters(demo_model_dir))["poet"]
    assert cfg.is_demo_model and cfg.enable_lora
    assert cfg.lora_modules == (("pirate", own), ("poet", poet))  # a given name wins over the demo's
    explicit = launcher.resolve_config(build_parser().parse_args(["serve", demo_model_dir]), str(tmp_path))
    assert not explicit.is_demo_model and not explicit.enable_lora and explicit.lora_modules == ()


def test_styles_rewrite_every_sentence_line() -> None:
    text = "The boy smiled.\n\nHe ran to the sea.\n"
    assert rewrite(text, "pirate") == f"Arr, the boy smiled{PIRATE_CLOSING}\n\nArr, he ran to the sea{PIRATE_CLOSING}\n"
    assert rewrite(text, "poet") == f"The boy smiled.\n{POET_REFRAIN}\n\nHe ran to the sea.\n{POET_REFRAIN}\n"


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
