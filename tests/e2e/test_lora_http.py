"""Multi-LoRA through the real process group: base and four PEFT adapters served at once
with `--max-loras 2`, every output equal to PEFT's; the vLLM adapter API; a stress run. Under the
one-step loop and under `--async-scheduling`."""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.adapter_factory import make_peft_adapter
from tests.e2e.conftest import SCHEDULING_ARGS
from tests.e2e.server import Server
from tests.reference import assert_greedy_matches, greedy_reference

pytestmark = pytest.mark.slow

NUM_TOKENS = 24
PROMPTS = [
    "The river ran",
    "A small bakery on the corner",
    "Once upon a time, the",
    "Rain fell over the hills and",
    "She opened the old letter",
    "In the morning the market",
]
ADAPTERS = {  # name: make_peft_adapter kwargs
    "qv-r4": dict(r=4, alpha=8, targets=["q_proj", "v_proj"], seed=1),
    "mlp-r8": dict(r=8, alpha=16, targets=["gate_proj", "up_proj", "down_proj"], seed=2),
    "all-r16-rs": dict(
        r=16,
        alpha=32,
        targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        use_rslora=True,
        seed=3,
    ),
    "attn-head-r32": dict(r=32, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"], seed=4),
}
SPARE = {
    "spare-x": dict(r=8, alpha=8, targets=["q_proj", "o_proj"], seed=5),
    "spare-y": dict(r=12, alpha=24, targets=["up_proj", "down_proj"], seed=6),
}
GREEDY = {"temperature": 0.0, "max_tokens": NUM_TOKENS, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def adapter_root(demo_model_dir, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("adapters")
    for name, kwargs in {**ADAPTERS, **SPARE}.items():
        make_peft_adapter(demo_model_dir, str(root / name), **kwargs)
    return str(root)


@pytest.fixture(scope="module")
def log_dir(scheduling, tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp(f"lora-events-{scheduling}"))


@pytest.fixture(scope="module")
def server(demo_model_dir, adapter_root, log_dir, scheduling):
    modules = [f"{name}={os.path.join(adapter_root, name)}" for name in ADAPTERS]
    args = [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "32",
        "--lora-allowed-dir",
        adapter_root,
        "--max-model-len",
        "512",
        "--num-kv-blocks",
        "160",
        "--max-num-batched-tokens",
        "96",
        "--max-num-seqs",
        "32",
        "--lora-modules",
        *modules,
    ]
    args += SCHEDULING_ARGS[scheduling]
    srv = Server(demo_model_dir, log_dir, args).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(demo_model_dir):
    return AutoModelForCausalLM.from_pretrained(
        demo_model_dir, dtype=torch.float32
    ).eval(), AutoTokenizer.from_pretrained(demo_model_dir)


def _peft_refs(demo_model_dir, adapter_dir, prompts, tok, num_tokens=NUM_TOKENS):
    base = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    return [greedy_reference(model, tok(p)["input_ids"], num_tokens) for p in prompts]


def _base_name(client) -> str:
    return next(m.id for m in client.models.list().data if m.model_extra.get("parent") is None)


def test_models_lists_base_and_adapters(client, adapter_root, demo_model_dir):
    cards = {m.id: m.model_extra for m in client.models.list().data}
    base = os.path.basename(demo_model_dir)
    assert set(cards) == {base, *ADAPTERS}
    for name in ADAPTERS:
        assert cards[name]["parent"] == base and cards[name]["root"] == name  # a server path only to the admin key


def test_start_up_logs_the_weights_and_each_adapter_loaded(server) -> None:
    """The worker logs its checkpoint load before it is ready, and each start-up adapter's read
    into the CPU tier once it ends (staged at registration, beside serving)."""
    assert "loaded weights: " in server.output()
    deadline = time.monotonic() + 10.0
    while not all(f"loaded adapter {name} (" in server.output() for name in ADAPTERS):
        assert time.monotonic() < deadline, server.output()
        time.sleep(0.1)


def test_mixed_batch_matches_peft_with_two_slots(server, client, hf, demo_model_dir, adapter_root):
    model, tok = hf
    base = _base_name(client)
    jobs = [(m, p) for m in [base, *ADAPTERS] for p in PROMPTS]  # 30 requests in flight at once
    assert len(jobs) >= 24

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*[aclient.completions.create(model=m, prompt=p, **GREEDY) for m, p in jobs])

    responses = asyncio.run(all_at_once())
    results = {f"{m}|{p}": r.choices[0].model_extra["token_ids"] for (m, p), r in zip(jobs, responses)}
    refs = {f"{base}|{p}": greedy_reference(model, tok(p)["input_ids"], NUM_TOKENS) for p in PROMPTS}
    for name in ADAPTERS:
        for p, ref in zip(PROMPTS, _peft_refs(demo_model_dir, os.path.join(adapter_root, name), PROMPTS, tok)):
            refs[f"{name}|{p}"] = ref
    print("near ties accepted:", assert_greedy_matches(results, refs) or "none")
    differs = [results[f"{n}|{PROMPTS[0]}"] != results[f"{base}|{PROMPTS[0]}"] for n in ADAPTERS]
    assert all(differs), "each adapter should change the base model's output"


def test_lora_path_picks_the_adapter(client):
    by_name = client.completions.create(model="qv-r4", prompt=PROMPTS[0], **GREEDY)
    by_path = client.completions.create(
        model=_base_name(client),
        prompt=PROMPTS[0],
        temperature=0.0,
        max_tokens=NUM_TOKENS,
        extra_body={**GREEDY["extra_body"], "lora_path": "qv-r4"},
    )
    assert by_path.choices[0].text == by_name.choices[0].text


def _post(server, route, body):
    return httpx.post(server.base_url + route, json=body, timeout=60)


def test_load_errors(server, adapter_root, tmp_path):
    dup = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "qv-r4", "lora_path": os.path.join(adapter_root, "spare-x")}
    )
    assert dup.status_code == 400 and dup.json()["error"]["message"]
    missing = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "nope", "lora_path": os.path.join(adapter_root, "absent")}
    )
    assert missing.status_code == 404
    outside = tmp_path / "outside"
    shutil.copytree(os.path.join(adapter_root, "spare-x"), outside)
    escaped = _post(server, "/v1/load_lora_adapter", {"lora_name": "evil", "lora_path": str(outside)})
    assert escaped.status_code == 400
    traversal = _post(
        server,
        "/v1/load_lora_adapter",
        {"lora_name": "evil", "lora_path": os.path.join(adapter_root, "..", os.path.basename(tmp_path), "outside")},
    )
    assert traversal.status_code == 400
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}).status_code == 404


def test_load_inplace_serves_the_new_weights(server, client, hf, demo_model_dir, adapter_root):
    _, tok = hf
    x, y = os.path.join(adapter_root, "spare-x"), os.path.join(adapter_root, "spare-y")
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": x}).status_code == 200
    first = client.completions.create(model="swap", prompt=PROMPTS[1], **GREEDY).choices[0].model_extra["token_ids"]
    assert_greedy_matches({"x": first}, {"x": _peft_refs(demo_model_dir, x, PROMPTS[1:2], tok)[0]})
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": y}).status_code == 400
    reload = _post(server, "/v1/load_lora_adapter", {"lora_name": "swap", "lora_path": y, "load_inplace": True})
    assert reload.status_code == 200
    second = client.completions.create(model="swap", prompt=PROMPTS[1], **GREEDY).choices[0].model_extra["token_ids"]
    assert_greedy_matches({"y": second}, {"y": _peft_refs(demo_model_dir, y, PROMPTS[1:2], tok)[0]})
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "swap"}).status_code == 200


def test_unload_while_streaming_finishes_then_404(server, client, hf, demo_model_dir, adapter_root):
    _, tok = hf
    path = os.path.join(adapter_root, "spare-x")
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": "doomed", "lora_path": path}).status_code == 200
    stream = client.completions.create(
        model="doomed",
        prompt=PROMPTS[2],
        stream=True,
        temperature=0.0,
        max_tokens=64,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    chunks = [next(iter(stream))]
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "doomed"}).status_code == 200
    chunks += list(stream)
    ids = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert_greedy_matches({"doomed": ids}, {"doomed": _peft_refs(demo_model_dir, path, PROMPTS[2:3], tok, 64)[0]})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="doomed", prompt=PROMPTS[2], max_tokens=4)
    assert "doomed" not in {m.id for m in client.models.list().data}
    server.wait_idle(timeout_s=10)
    assert server.metrics().get("ledgerserve_lora_deferred_evictions", 0) == 0


def test_stress_has_no_unexpected_status(server, adapter_root):
    from scripts.adapters.lora_stress import parse_args, run_stress

    spares = [f"s{i}={os.path.join(adapter_root, n)}" for i, n in enumerate(SPARE)]
    summary = run_stress(
        parse_args(
            [
                "--base-url",
                server.base_url,
                "--concurrency",
                "8",
                "--rounds",
                "5",
                "--requests",
                "24",
                "--max-tokens",
                "8",
                "--adapters",
                *spares,
            ]
        )
    )
    print(summary)
    assert summary["num_requests"] >= 100 and not summary["unexpected"], summary
    server.wait_idle(timeout_s=20)


def test_replay_verifies_the_lora_log(server, log_dir):
    assert server.stop() == 0
    for seed in ("0", "999"):
        done = subprocess.run(
            [sys.executable, "-m", "ledgerserve", "replay", "--verify", log_dir],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    assert glob.glob(os.path.join(log_dir, "*.log"))
