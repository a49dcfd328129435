"""The demo build's own LoRA (ledgerserve/demo_lora.py) against PEFT: an adapter it trains and
saves loads in PEFT with the logits of the model it trained; the built demo adapters load in PEFT
whole. And what the build tells the user while it runs (demo_progress, on a fake clock)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch

from ledgerserve import demo_lora, demo_model, demo_train
from ledgerserve.demo_model import demo_adapters
from ledgerserve.demo_progress import BuildProgress

RANK, ALPHA = demo_train.LORA_RANK, demo_train.LORA_ALPHA
PROMPT = "The morning train left the small station."


@pytest.fixture(scope="module")
def base(demo_model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt_ids(demo_model_dir: str) -> torch.Tensor:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(demo_model_dir) / "tokenizer.json"))
    return torch.tensor([tokenizer.encode(PROMPT).ids])  # [1, num_tokens]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits  # [1, num_tokens, vocab]


def test_peft_loads_what_the_wrapper_trained_with_its_logits(base, prompt_ids, demo_model_dir, tmp_path) -> None:
    from peft import PeftModel
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(demo_model_dir) / "tokenizer.json"))
    trained = demo_lora.add_lora(copy.deepcopy(base), RANK, ALPHA, demo_train.LORA_TARGETS, seed=5)
    schedule = demo_train.Schedule(num_steps=6, lr=1e-2, batch_size=4, seq_len=32, num_warmup_steps=1, seed=3)
    demo_train.train(trained, demo_model._corpus_lines(tokenizer, "pirate"), schedule)
    demo_lora.save_adapter(trained, tmp_path / "adapter", RANK, ALPHA, demo_train.LORA_TARGETS)
    ours = _logits(trained, prompt_ids)
    plain = _logits(base, prompt_ids)
    assert (ours - plain).abs().max() > 1e-2  # the adapter's update shows in the logits
    theirs = _logits(PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "adapter")), prompt_ids)
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)


def test_the_wrapper_starts_as_peft_does(base) -> None:
    """A kaiming-uniform(a=sqrt(5)), as nn.Linear's default, B zeros: a fresh adapter changes nothing."""
    fresh = demo_lora.add_lora(copy.deepcopy(base), RANK, ALPHA, demo_train.LORA_TARGETS, seed=1)
    layers = [m for m in fresh.modules() if isinstance(m, demo_lora.LoraLinear)]
    assert len(layers) == 7 * base.config.num_hidden_layers
    for layer in layers:
        bound = 1 / layer.base_layer.in_features**0.5  # kaiming_uniform with a=sqrt(5): U(-1/sqrt(in), 1/sqrt(in))
        assert 0.5 * bound < layer.lora_A.weight.abs().max() <= bound
        assert not layer.lora_B.weight.any() and layer.scaling == ALPHA / RANK
    trainable = {name for name, p in fresh.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)


def test_the_built_demo_adapters_load_whole_in_peft(base, prompt_ids, demo_model_dir) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    plain = _logits(base, prompt_ids)
    for name, path in demo_adapters(demo_model_dir):
        saved = load_file(str(Path(path) / "adapter_model.safetensors"))
        assert len(saved) == 2 * 7 * base.config.num_hidden_layers, name
        model = PeftModel.from_pretrained(copy.deepcopy(base), path)
        loaded = {k.replace(".default", ""): p for k, p in model.named_parameters() if ".lora_" in k}
        assert set(loaded) == set(saved), name
        for key, tensor in saved.items():
            assert torch.equal(loaded[key], tensor), key
        assert (_logits(model, prompt_ids) - plain).abs().max() > 1e-2, name


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_progress_logs_stages_and_a_training_step_every_few_seconds(caplog) -> None:
    clock = FakeClock()
    progress = BuildProgress(num_stages=3, every_s=3.0, clock=clock)
    caplog.set_level(logging.INFO, logger="ledgerserve.demo")
    progress.stage("training the base model (10 steps)")
    on_step = progress.training("base model", 10)
    for step in range(1, 11):
        clock.now_s += 1.0  # one second a step
        on_step(step, torch.tensor(10.0 / step))
    progress.done()
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "demo model 1/3: training the base model (10 steps) (0.0 s so far)",
        "demo model: base model step 3/10, loss 3.333 (about 7 s left)",
        "demo model: base model step 6/10, loss 1.667 (about 4 s left)",
        "demo model: base model step 9/10, loss 1.111 (about 1 s left)",
        "demo model: base model trained: 10 steps in 10.0 s, loss 1.000",
        "demo model built in 10.0 s",
    ]
