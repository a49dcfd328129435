"""Which part of each checkpoint tensor a tensor-parallel rank holds: the sizes that must divide,
the KV heads replicated when the ranks outnumber them, the padded vocabulary, and the loader
putting exactly those parts of the safetensors into the rank's model. No collective runs here
(building and loading a shard are rank-local); tests/worker_proc/test_tensor_parallel.py runs them."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ledgerserve.worker_proc.kv_cache import KVCache, bytes_per_block
from ledgerserve.worker_proc.models.config import load_model_config
from ledgerserve.worker_proc.models.loader import build_model
from ledgerserve.worker_proc.models.shard import down_shard, o_shard, qkv_shard, vocab_shard
from ledgerserve.worker_proc.parallel import TpGroup
from tests.model_factory import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("shard-llama"))  # 4 heads, 2 KV heads


def test_sizes_that_do_not_divide_are_named(llama_dir: str) -> None:
    cfg = load_model_config(llama_dir)
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible by tensor_parallel_size 3"):
        cfg.shard(0, 3)
    with pytest.raises(ValueError, match="intermediate_size 130 is not divisible by tensor_parallel_size 4"):
        dataclasses.replace(cfg, intermediate_size=130).shard(0, 4)
    with pytest.raises(ValueError, match="num_key_value_heads 6 and tensor_parallel_size 4: neither divides"):
        dataclasses.replace(cfg, num_heads=24, num_kv_heads=6).shard(0, 4)


def test_kv_heads_replicate_when_the_ranks_outnumber_them(llama_dir: str) -> None:
    cfg = load_model_config(llama_dir)  # head_dim 16
    views = [cfg.shard(rank, 4) for rank in range(4)]
    assert [(v.num_local_heads, v.num_local_kv_heads, v.first_kv_head) for v in views] == [
        (1, 1, 0),
        (1, 1, 0),
        (1, 1, 1),
        (1, 1, 1),
    ]  # q heads 0, 1 use KV head 0; q heads 2, 3 use KV head 1
    assert qkv_shard(views[3]).rows == ((48, 64), (16, 32), (16, 32))
    assert o_shard(views[3]).cols == (48, 64) and o_shard(views[3]).rows == ((0, 64),)
    assert down_shard(views[1]).cols == (32, 64)


def test_the_vocabulary_pads_to_a_multiple_of_the_ranks(llama_dir: str) -> None:
    cfg = dataclasses.replace(load_model_config(llama_dir), vocab_size=250)
    views = [cfg.shard(rank, 4) for rank in range(4)]
    assert {v.local_vocab_size for v in views} == {63}
    assert [vocab_shard(v).rows for v in views] == [((0, 63),), ((63, 126),), ((126, 189),), ((189, 250),)]


@pytest.mark.parametrize("rank", [0, 3])
def test_a_rank_loads_exactly_its_parts(llama_dir: str, rank: int) -> None:
    cfg = load_model_config(llama_dir)
    model = build_model(cfg, llama_dir, "auto", torch.float32, torch.device("cpu"), 0, rank, TpGroup(rank, 4))
    want = load_file(f"{llama_dir}/model.safetensors")
    layer = model.model.layers[1]
    kv = rank // 2  # the KV head this rank's q head uses
    q, k, v = layer.self_attn.qkv_proj.weight.split([16, 16, 16])
    assert torch.equal(q, want["model.layers.1.self_attn.q_proj.weight"][16 * rank : 16 * (rank + 1)])
    assert torch.equal(k, want["model.layers.1.self_attn.k_proj.weight"][16 * kv : 16 * (kv + 1)])
    assert torch.equal(v, want["model.layers.1.self_attn.v_proj.weight"][16 * kv : 16 * (kv + 1)])
    o = want["model.layers.1.self_attn.o_proj.weight"]
    assert torch.equal(layer.self_attn.o_proj.weight, o[:, 16 * rank : 16 * (rank + 1)])
    gate, up = layer.mlp.gate_up_proj.weight.split([32, 32])
    assert torch.equal(up, want["model.layers.1.mlp.up_proj.weight"][32 * rank : 32 * (rank + 1)])
    down = want["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(layer.mlp.down_proj.weight, down[:, 32 * rank : 32 * (rank + 1)])
    embed = want["model.embed_tokens.weight"]
    assert torch.equal(model.model.embed_tokens.weight, embed[64 * rank : 64 * (rank + 1)])
    assert torch.equal(model.lm_head.weight, want["lm_head.weight"][64 * rank : 64 * (rank + 1)])
    assert torch.equal(layer.input_layernorm.weight, want["model.layers.1.input_layernorm.weight"])


def test_dummy_weights_have_the_shard_shapes(llama_dir: str) -> None:
    cfg = load_model_config(llama_dir)
    dummy = build_model(cfg, llama_dir, "dummy", torch.float32, torch.device("cpu"), 5, 1, TpGroup(1, 2))
    real = build_model(cfg, llama_dir, "auto", torch.float32, torch.device("cpu"), 5, 1, TpGroup(1, 2))
    for (name, a), (_, b) in zip(dummy.named_parameters(), real.named_parameters()):
        assert a.shape == b.shape, name
    assert real.model.layers[0].self_attn.qkv_proj.weight.shape == (32 + 16 + 16, 64)  # 2 q heads, 1 KV head


def test_a_checkpoint_tensor_of_another_shape_is_refused(llama_dir: str, tmp_path) -> None:
    """A tensor whose rows hold a rank's slice and more (here an up_proj twice as tall) is refused,
    not quietly cut to the slice."""
    shutil.copy(f"{llama_dir}/config.json", tmp_path / "config.json")
    tensors = load_file(f"{llama_dir}/model.safetensors")
    up = tensors["model.layers.0.mlp.up_proj.weight"]  # [128, 64]
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.cat([up, up])
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = load_model_config(str(tmp_path))
    with pytest.raises(ValueError, match=r"up_proj.weight' \(256, 64\) does not fit the model's \(128, 64\)"):
        build_model(cfg, str(tmp_path), "auto", torch.float32, torch.device("cpu"), 0, 0, TpGroup(0, 2))


def test_a_rank_caches_only_its_kv_heads(llama_dir: str) -> None:
    """A KV block of a rank's cache holds its KV heads: half of them with 2 ranks, and still one
    (the replicated head its q heads use) with 4 ranks over 2 KV heads; so a memory budget holds
    more blocks per rank."""
    cfg = load_model_config(llama_dir)
    whole = bytes_per_block(cfg, 16, torch.float32)
    assert bytes_per_block(cfg.shard(1, 2), 16, torch.float32) * 2 == whole
    assert bytes_per_block(cfg.shard(3, 4), 16, torch.float32) * 2 == whole
    cache = KVCache(cfg.shard(1, 2), 3, 16, torch.float32, torch.device("cpu"))
    assert cache.layers[0][0].shape == (3, 16, 1, cfg.head_dim)
