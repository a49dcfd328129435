"""Our decoder vs transformers' on tiny checkpoints: logits through the paged cache."""

from __future__ import annotations

import json
import os

import pytest
import torch

from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.worker_proc.models.config import load_eos_token_ids, load_model_config, parse_model_config
from ledgerserve.worker_proc.models.loader import build_model
from ledgerserve.worker_proc.requests import ReqState
from ledgerserve.worker_proc.step_inputs import StepInputs, build_step_inputs
from tests.model_factory import load_reference

BLOCK_SIZE = 4


def _caches(cfg, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]


def _chunk_inputs(ids: list[int], table: list[int], start: int, end: int) -> StepInputs:
    """Tokens [start, end) of one request whose first `start` tokens are in its blocks already."""
    req = ReqState("r", ids, len(ids), SamplingParams(max_tokens=1), table, start, end - start, -1)
    return build_step_inputs([req], BLOCK_SIZE, torch.device("cpu"))


def test_logits_match_transformers_in_chunks(tiny_checkpoint: str) -> None:
    cfg = load_model_config(tiny_checkpoint)
    model = build_model(cfg, tiny_checkpoint, "auto", torch.float32, torch.device("cpu"), seed=0)
    ref = load_reference(tiny_checkpoint)
    ids = torch.randint(0, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]  # [45, vocab]
    caches = _caches(cfg, 16)
    table = [9, 2, 14, 0, 7, 3, 11, 5, 1, 12, 4, 6]
    got = []
    for start, end in [(0, 7), (7, 30), (30, 31), (31, 45)]:
        hidden = model(_chunk_inputs(ids.tolist(), table, start, end), caches)
        got.append(model.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)


def test_dummy_weights_have_checkpoint_shapes(tiny_checkpoint: str) -> None:
    cfg = load_model_config(tiny_checkpoint)
    a = build_model(cfg, tiny_checkpoint, "dummy", torch.float32, torch.device("cpu"), seed=5)
    b = build_model(cfg, tiny_checkpoint, "dummy", torch.float32, torch.device("cpu"), seed=5)
    real = build_model(cfg, tiny_checkpoint, "auto", torch.float32, torch.device("cpu"), seed=5)
    for (name, pa), (_, pb), (_, pr) in zip(a.named_parameters(), b.named_parameters(), real.named_parameters()):
        assert pa.shape == pr.shape, name
        assert torch.equal(pa, pb), name
    hidden = a(_chunk_inputs([1, 2, 3], [1], 0, 3), _caches(cfg, 2))
    assert torch.isfinite(a.compute_logits(hidden)).all()


def test_eos_ids_and_config_variants(tiny_checkpoint: str) -> None:
    assert load_eos_token_ids(tiny_checkpoint) == [2]
    with open(os.path.join(tiny_checkpoint, "config.json")) as f:
        raw = json.load(f)
    raw.pop("rope_parameters", None)
    raw["rope_theta"] = 5000.0
    raw["rope_scaling"] = {"type": "llama3", "factor": 2.0, "original_max_position_embeddings": 64}
    raw["eos_token_id"] = [2, 7]
    cfg = parse_model_config(raw)
    assert cfg.rope.theta == 5000.0 and cfg.rope.rope_type == "llama3" and cfg.rope.factor == 2.0


def test_unsupported_architecture_raises() -> None:
    with pytest.raises(ValueError, match="unsupported architectures"):
        parse_model_config({"architectures": ["GPT2LMHeadModel"]})


def test_missing_weight_raises(tiny_checkpoint: str, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(tiny_checkpoint, "model.safetensors"))
    tensors.pop("model.layers.1.self_attn.v_proj.weight")
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with open(os.path.join(tiny_checkpoint, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    cfg = load_model_config(str(tmp_path))
    with pytest.raises(ValueError, match="lacks weights"):
        build_model(cfg, str(tmp_path), "safetensors", torch.float32, torch.device("cpu"), seed=0)


def test_half_precision_keeps_fp32_rope(tiny_checkpoint: str) -> None:
    cfg = load_model_config(tiny_checkpoint)
    model = build_model(cfg, tiny_checkpoint, "auto", torch.bfloat16, torch.device("cpu"), seed=0)
    assert model.model.rotary.inv_freq.dtype == torch.float32
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    shape = (2, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))] * cfg.num_layers
    hidden = model(_chunk_inputs([1, 2, 3], [1], 0, 3), caches)
    assert torch.isfinite(model.compute_logits(hidden)).all()
