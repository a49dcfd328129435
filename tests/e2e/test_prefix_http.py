"""Prefix cache through the real server: a 200+-token shared prefix sent to the base
model, adapter A, adapter B, A again, then A reloaded in place. Cached tokens appear only
for a repeat within one namespace version, and every output equals its reference."""

from __future__ import annotations

import os

import httpx
import openai
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.adapter_factory import make_peft_adapter
from tests.e2e.server import Server
from tests.reference import assert_greedy_matches, greedy_reference

pytestmark = pytest.mark.slow

PREFIX = " ".join(
    f"Chapter {i}: the river keeps its slow promise to the valley, and the baker counts loaves by lamplight."
    for i in range(12)
)
NUM_TOKENS = 16
GREEDY = {"temperature": 0.0, "max_tokens": NUM_TOKENS, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def adapters(demo_model_dir, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prefix-adapters")
    specs = {
        "A": dict(r=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"], seed=11),
        "B": dict(r=4, alpha=8, targets=["k_proj", "o_proj"], seed=12),
        "A2": dict(r=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"], seed=13),
    }
    return {name: make_peft_adapter(demo_model_dir, str(root / name), **kw) for name, kw in specs.items()}


@pytest.fixture(scope="module")
def server(demo_model_dir, adapters, tmp_path_factory):
    args = [
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-allowed-dir",
        os.path.dirname(adapters["A"]),
        "--lora-modules",
        f"A={adapters['A']}",
        f"B={adapters['B']}",
        "--max-model-len",
        "512",
        "--num-kv-blocks",
        "128",
        "--block-size",
        "16",
    ]
    srv = Server(demo_model_dir, str(tmp_path_factory.mktemp("prefix-events")), args).start()
    yield srv
    srv.stop()


def _reference(demo_model_dir, adapter_dir, prompt_ids):
    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    return greedy_reference(model.eval(), prompt_ids, NUM_TOKENS)


def test_cached_tokens_only_within_one_namespace_version(server, demo_model_dir, adapters):
    tok = AutoTokenizer.from_pretrained(demo_model_dir)
    assert len(tok(PREFIX)["input_ids"]) >= 200
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    base = os.path.basename(demo_model_dir)
    plan = [
        ("base", base, None, " one"),
        ("A", "A", adapters["A"], " two"),
        ("B", "B", adapters["B"], " three"),
        ("A again", "A", adapters["A"], " four"),
        ("reload A", "A", adapters["A2"], " five"),
        ("base again", base, None, " six"),
    ]
    cached, results, refs = {}, {}, {}
    for label, model, adapter_dir, suffix in plan:
        if label == "reload A":
            body = {"lora_name": "A", "lora_path": adapters["A2"], "load_inplace": True}
            assert httpx.post(server.base_url + "/v1/load_lora_adapter", json=body, timeout=60).status_code == 200
        resp = client.completions.create(model=model, prompt=PREFIX + suffix, **GREEDY)
        cached[label] = resp.usage.prompt_tokens_details.cached_tokens
        results[label] = resp.choices[0].model_extra["token_ids"]
        refs[label] = _reference(demo_model_dir, adapter_dir, resp.model_extra["prompt_token_ids"])
    print("cached tokens:", cached)
    assert cached["base"] == cached["A"] == cached["B"] == cached["reload A"] == 0
    assert cached["A again"] >= 192 and cached["base again"] >= 192
    print("near ties accepted:", assert_greedy_matches(results, refs) or "none")
    hits = server.metrics()
    assert hits['ledgerserve_prefix_cache_hit_tokens_total{namespace="A"}'] == cached["A again"]
    assert hits['ledgerserve_prefix_cache_hit_tokens_total{namespace="B"}'] == 0
    assert hits['ledgerserve_prefix_cache_hit_tokens_total{namespace="base"}'] == cached["base again"]
