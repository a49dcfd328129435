"""The demo build's Qwen3 (ledgerserve/demo_qwen3.py) against transformers' Qwen3ForCausalLM: the
same parameters by name and shape, the same logits and gradients on the same weights, and a
config.json that transformers and the worker read as the same model."""

from __future__ import annotations

import json

import pytest
import torch

from ledgerserve.demo_model import SHAPE
from ledgerserve.demo_qwen3 import Qwen3ForCausalLM, Qwen3Shape, hf_config
from ledgerserve.worker_proc.models.config import parse_model_config

VOCAB = 300


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Ours with random weights, and transformers' loaded from its config.json and those weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = Qwen3Shape(vocab_size=VOCAB, pad_token_id=0, **SHAPE)
    torch.manual_seed(0)
    ours = Qwen3ForCausalLM(shape)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape) * (0.3 if p.ndim == 1 else 0.05) + (1.0 if p.ndim == 1 else 0.0))
    path = tmp_path_factory.mktemp("qwen3")
    (path / "config.json").write_text(json.dumps(hf_config(shape, bos_token_id=0, eos_token_id=2)))
    theirs = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert unexpected == [] and missing == ["lm_head.weight"]  # tied: the embedding
    theirs.tie_weights()
    return ours.eval(), theirs.eval(), path


def test_same_parameters_by_name_and_shape(pair) -> None:
    ours, theirs, _ = pair
    assert {n: p.shape for n, p in ours.named_parameters()} == {n: p.shape for n, p in theirs.named_parameters()}


def test_same_logits_and_gradients(pair) -> None:
    ours, theirs, _ = pair
    ids = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))  # [batch, seq]
    ids[:, ::7] = 0  # the pad id: its embedding row gets no gradient from the lookup
    mine, reference = ours(input_ids=ids).logits, theirs(input_ids=ids).logits  # [batch, seq, vocab]
    assert mine.std() > 0.1
    torch.testing.assert_close(mine, reference, rtol=1e-5, atol=1e-5)
    mine.square().mean().backward()
    reference.square().mean().backward()
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_config_json_reads_as_the_same_model(pair) -> None:
    from transformers import AutoConfig

    _, _, path = pair
    config = AutoConfig.from_pretrained(path)
    assert (config.model_type, config.num_hidden_layers, config.head_dim, config.tie_word_embeddings) == (
        "qwen3",
        2,
        32,
        True,
    )
    assert config.rope_parameters["rope_theta"] == 10000.0
    parsed = parse_model_config(json.loads((path / "config.json").read_text()))
    assert (parsed.architecture, parsed.num_kv_heads, parsed.rope.theta, parsed.qk_norm) == (
        "Qwen3ForCausalLM",
        2,
        10000.0,
        True,
    )
