"""Mixture-of-experts models through the real process group and the `openai` client, on the CPU:
a tiny Qwen3-MoE (a dense layer among sparse ones) and a tiny Mixtral, each with the demo model's
tokenizer, serve base and attention-adapter requests in one batch, every greedy output equal to
transformers' or PEFT's; the replay of the run's log verifies. On CUDA the launcher refuses a MoE
model before any child starts (no expert kernels there yet)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.adapter_factory import make_peft_adapter
from tests.e2e.conftest import TOKENIZER_FILES
from tests.e2e.server import Server
from tests.model_factory import MOE_ARCHS, make_tiny_checkpoint
from tests.reference import assert_greedy_matches, greedy_reference

pytestmark = pytest.mark.slow

NUM_TOKENS = 16
PROMPTS = ["The river ran past the mill, under the old stone bridge", "A small bakery"]
ADAPTER = dict(r=8, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=31)
GREEDY = {"temperature": 0.0, "max_tokens": NUM_TOKENS, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module", params=MOE_ARCHS)
def model_dir(request, demo_model_dir, tmp_path_factory) -> str:
    vocab_size = len(AutoTokenizer.from_pretrained(demo_model_dir))
    path = Path(
        make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "m", vocab_size=vocab_size)
    )
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(demo_model_dir) / name, path / name)
    return str(path)


@pytest.fixture(scope="module")
def adapter_dir(model_dir, tmp_path_factory) -> str:
    return make_peft_adapter(model_dir, tmp_path_factory.mktemp("moe-adapter") / "attn", **ADAPTER)


@pytest.fixture(scope="module")
def server(model_dir, adapter_dir, tmp_path_factory):
    args = ["--device", "cpu", "--enable-lora", "--max-loras", "1", "--max-lora-rank", "8"]
    args += ["--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-batched-tokens", "16"]
    args += ["--lora-modules", f"attn={adapter_dir}"]
    srv = Server(model_dir, str(tmp_path_factory.mktemp("moe-events")), args).start()
    yield srv
    srv.stop()


def test_base_and_adapter_rows_in_one_batch_match_transformers_and_peft(server, model_dir, adapter_dir):
    base = Path(model_dir).name  # the served name: the model directory's
    jobs = [(m, p) for m in (base, "attn") for p in PROMPTS]

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
            return await asyncio.gather(*[client.completions.create(model=m, prompt=p, **GREEDY) for m, p in jobs])

    responses = asyncio.run(all_at_once())
    results = {f"{m}|{p}": r.choices[0].model_extra["token_ids"] for (m, p), r in zip(jobs, responses)}
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = {f"{base}|{p}": greedy_reference(model, tok(p)["input_ids"], NUM_TOKENS) for p in PROMPTS}
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter_dir)
    refs |= {f"attn|{p}": greedy_reference(peft.eval(), tok(p)["input_ids"], NUM_TOKENS) for p in PROMPTS}
    print("near ties accepted:", assert_greedy_matches(results, refs) or "none")
    assert results[f"attn|{PROMPTS[0]}"] != results[f"{base}|{PROMPTS[0]}"], "the adapter should change the output"


def test_replay_verifies_the_log(server) -> None:
    assert server.stop() == 0
    out = subprocess.run(
        [sys.executable, "-m", "ledgerserve", "replay", "--verify", server.log_dir],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
