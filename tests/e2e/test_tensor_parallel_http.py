"""Tensor parallelism through the real process group: `--tensor-parallel-size 2` serves the base
model and three PEFT adapters (ranks 4 to 32, every projection and lm_head among them) at once,
prompts longer than the chunked-prefill budget, a KV pool small enough that requests are preempted,
and every greedy output equals transformers' or PEFT's for 32 new tokens; a rank of the same engine
at TP 1, carrying out the server's logged commands, samples the same tokens; each rank's logged
WorkerReady reports its share of the checkpoint's weight bytes. The module runs once per model, one
server each: the demo model (Qwen3: per-head q/k norm, tied embeddings) and a tiny random Llama
(GQA with 2 KV heads, llama3 rope scaling, untied lm_head)."""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import json
import math
import os
import time
from collections import defaultdict

import openai
import pytest
import torch
from peft import PeftModel
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from ledgerserve.scheduler_proc.ledger import TO_WORKER_TYPES
from ledgerserve.shared import events
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import EventLogReader, newest_log
from ledgerserve.shared.progress import ready_line
from ledgerserve.worker_proc.runner import ModelRunner
from tests.adapter_factory import make_peft_adapter
from tests.e2e.server import Server
from tests.prompt_logprobs_ref import check_entries, entries_from_json, prompt_logprobs_reference
from tests.reference import NEAR_TIE, Reference, assert_greedy_matches, greedy_reference

pytestmark = pytest.mark.slow

NUM_TOKENS = 32
BUDGET_TOKENS = 16  # --max-num-batched-tokens: the longer prompts take several steps
PROMPTS = [
    "The river ran past the mill, under the old stone bridge, and out into the fields where",
    "A small bakery on the corner",
]
ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name: make_peft_adapter kwargs
    "all-head-r4": dict(r=4, alpha=8, targets=[*ALL_SEVEN, "lm_head"], seed=21),
    "attn-r16-rs": dict(r=16, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True, seed=22),
    "mlp-r32": dict(r=32, alpha=48, targets=["gate_proj", "up_proj", "down_proj"], seed=23),
}
# 8 requests of up to ~52 tokens (3-4 blocks of 16 each): three or four running at once fill the pool, so
# some are preempted and recomputed however staggered their arrival on a loaded machine
KV_BLOCKS = 10
GREEDY = {"temperature": 0.0, "max_tokens": NUM_TOKENS, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
MODELS = {"demo": "demo_model_dir", "llama": "tiny_llama_dir"}  # name: the session fixture of its directory


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request) -> str:
    return request.getfixturevalue(MODELS[request.param])


@pytest.fixture(scope="module")
def adapter_root(model_dir, tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("tp-adapters")
    for name, kwargs in ADAPTERS.items():
        make_peft_adapter(model_dir, str(root / name), **kwargs)
    return str(root)


@pytest.fixture(scope="module")
def server(model_dir, adapter_root, tmp_path_factory):
    args = [
        "--tensor-parallel-size",
        "2",
        "--enable-lora",
        "--max-loras",
        "3",
        "--max-lora-rank",
        "32",
        "--lora-allowed-dir",
        adapter_root,
        "--max-model-len",
        "256",
        "--num-kv-blocks",
        str(KV_BLOCKS),
        "--max-num-batched-tokens",
        str(BUDGET_TOKENS),
        "--async-scheduling",
        "--lora-modules",
        *[f"{name}={os.path.join(adapter_root, name)}" for name in ADAPTERS],
    ]
    srv = Server(model_dir, str(tmp_path_factory.mktemp("tp-events")), args).start()
    yield srv
    srv.stop()


def _refs(model_dir: str, adapter_root: str, base: str) -> dict[str, Reference]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert max(len(i) for i in ids) > BUDGET_TOKENS, "a prompt should need several prefill chunks"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = {f"{base}|{p}": greedy_reference(model, i, NUM_TOKENS) for p, i in zip(PROMPTS, ids)}
    for name in ADAPTERS:
        base_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        peft = PeftModel.from_pretrained(base_model, os.path.join(adapter_root, name)).eval()
        refs.update({f"{name}|{p}": greedy_reference(peft, i, NUM_TOKENS) for p, i in zip(PROMPTS, ids)})
    return refs


@pytest.fixture(scope="module")
def refs(server, model_dir, adapter_root) -> dict[str, Reference]:
    """transformers' and PEFT's greedy tokens (and top-2 gaps) of every "model|prompt"."""
    return _refs(model_dir, adapter_root, _base_name(server))


def _base_name(server) -> str:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    return next(m.id for m in client.models.list().data if m.model_extra.get("parent") is None)


@pytest.fixture(scope="module")
def results(server) -> dict[str, list[int]]:
    """The greedy tokens of every "model|prompt", sent all at once: base and every adapter in the same steps."""
    jobs = [(m, p) for m in [_base_name(server), *ADAPTERS] for p in PROMPTS]

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*[aclient.completions.create(model=m, prompt=p, **GREEDY) for m, p in jobs])

    responses = asyncio.run(all_at_once())
    return {f"{m}|{p}": r.choices[0].model_extra["token_ids"] for (m, p), r in zip(jobs, responses)}


def test_two_ranks_match_transformers_and_peft(server, results, refs) -> None:
    base = _base_name(server)
    assert all(len(tokens) == NUM_TOKENS for tokens in results.values())
    print("near ties accepted:", assert_greedy_matches(results, refs) or "none")
    assert all(results[f"{n}|{PROMPTS[0]}"] != results[f"{base}|{PROMPTS[0]}"] for n in ADAPTERS)
    logged = [event for _, event in EventLogReader(newest_log(server.log_dir), repair=False)]
    assert any(isinstance(event, events.RequestPreempted) for event in logged), "the run should preempt"


def test_prompt_logprobs_of_two_ranks_match(server, model_dir, adapter_root) -> None:
    """Prompt logprobs (lm_head over prompt rows, which every rank runs for its vocabulary gather)
    of a prompt prefilled in chunks, for the base model and an adapter on lm_head, against
    transformers and PEFT."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    base = _base_name(server)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tok(PROMPTS[0])["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), os.path.join(adapter_root, "all-head-r4")
    ).eval()
    for name, ref_model in ((base, model), ("all-head-r4", peft)):
        scored = client.completions.create(
            model=name, prompt=PROMPTS[0], max_tokens=1, temperature=0.0, extra_body={"prompt_logprobs": 3}
        )
        body = scored.choices[0].model_extra["prompt_logprobs"]
        ref = prompt_logprobs_reference(ref_model, prompt_ids)
        check_entries(ref, prompt_ids, entries_from_json(body, prompt_ids, 3), 3)


@pytest.fixture(scope="module")
def tp1_runner(server):
    """A worker rank of the server's engine at TP 1, in this process: the server's logged config, one rank."""
    config = EngineConfig.from_json(EventLogReader(newest_log(server.log_dir), repair=False).config_json)
    runner = ModelRunner(dataclasses.replace(config, tensor_parallel_size=1, tp_layout=""))
    yield runner
    runner.close()


def test_each_rank_reports_its_share_of_the_weights(server, model_dir, tp1_runner) -> None:
    """Each rank's WorkerReady in the log reports 1/2 of the sharded weights (the vocabulary padded to
    an even row count) plus the whole replicated norms, figured from the checkpoint's tensor shapes;
    a rank of the same engine at TP 1 reports the checkpoint's bytes in the model dtype."""
    logged = EventLogReader(newest_log(server.log_dir), repair=False)
    ready = {event.rank: event for _, event in logged if isinstance(event, events.WorkerReady)}
    assert sorted(ready) == [0, 1]
    itemsize = torch.finfo(getattr(torch, ready[0].dtype)).bits // 8
    for rank in (0, 1):
        assert ready[rank].num_weight_bytes == _checkpoint_rank_bytes(model_dir, 2, itemsize), f"rank {rank}"
    tp1 = tp1_runner.ready()
    assert tp1.dtype == ready[0].dtype
    assert (
        tp1.num_weight_bytes == _checkpoint_rank_bytes(model_dir, 1, itemsize) == _checkpoint_bytes(model_dir, itemsize)
    )
    out = server.output()  # the scheduler's start-up line shows every rank's figure
    assert all(f"rank {rank}: {ready_line(ready[rank])}" in out for rank in ready), out[-3000:]


def _checkpoint_bytes(model_dir: str, itemsize: int) -> int:
    """Every tensor of the checkpoint, in a dtype of `itemsize` bytes."""
    return sum(math.prod(shape) * itemsize for _, shape in _checkpoint_shapes(model_dir))


def _checkpoint_rank_bytes(model_dir: str, num_ranks: int, itemsize: int) -> int:
    """One rank's share of the checkpoint (Megatron-style, KV heads split): norms whole; the
    embedding and lm_head 1/N of the vocabulary rows padded to a multiple of N; every other
    tensor (q/k/v/o, gate/up/down) 1/N."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["num_key_value_heads"] % num_ranks == 0, "KV heads replicated: not figured here"
    num_elements = 0
    for name, shape in _checkpoint_shapes(model_dir):
        if name.endswith("norm.weight"):
            num_elements += math.prod(shape)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            num_elements += -(-shape[0] // num_ranks) * shape[1]
        else:
            assert math.prod(shape) % num_ranks == 0, name
            num_elements += math.prod(shape) // num_ranks
    return num_elements * itemsize


def _checkpoint_shapes(model_dir: str) -> list[tuple[str, list[int]]]:
    shapes = []
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            shapes += [(name, f.get_slice(name).get_shape()) for name in f.keys()]
    return shapes


def test_one_rank_samples_the_tokens_of_two(server, model_dir, results, refs, tp1_runner) -> None:
    """The worker commands the server logged (every plan and adapter command, as both ranks received
    them) carried out in order by a rank of the same engine at TP 1: every token of the requests'
    outputs is the one the two ranks sampled in that step, but for a near tie of the reference."""
    logged = [event for _, event in EventLogReader(newest_log(server.log_dir), repair=False)]
    tp1 = _tp1_samples(tp1_runner, logged)
    outputs = _logged_outputs(logged)
    assert len(outputs) >= len(results) * NUM_TOKENS
    keys = _reference_keys(logged, model_dir, _base_name(server))
    notes, failures, judged = [], [], set()
    for (step, req_id), (token_id, position) in sorted(outputs.items()):
        if req_id in judged or tp1.get((step, req_id)) == token_id:
            continue
        judged.add(req_id)  # the request's later tokens are not comparable
        ref, before = refs[keys[req_id]], [t for (_, r), (t, _) in sorted(outputs.items()) if r == req_id][:position]
        tie = before == ref.token_ids[:position] and ref.top2_gaps[position] < NEAR_TIE
        what = f"{keys[req_id]} token {position}: one rank {tp1.get((step, req_id))}, two ranks {token_id}"
        (notes if tie else failures).append(f"{what}, reference top-2 gap {ref.top2_gaps[position]:.3g}")
    assert not failures, "\n".join(failures + notes)
    print("near ties accepted:", notes or "none")


def _tp1_samples(runner: ModelRunner, logged: list[events.Event]) -> dict[tuple[int, str], int]:
    """Carry out the logged worker commands in order: (step, req_id) -> the token the runner samples."""
    samples = {}
    for event in logged:
        if isinstance(event, events.StepPlan):
            completed, _ = runner.execute(event)
            assert not completed.failed, completed.failed
            samples.update({(event.step, s.req_id): s.token_id for s in completed.sampled})
        elif isinstance(event, TO_WORKER_TYPES):
            runner.adapters.command(event, time.monotonic())
    return samples


def _logged_outputs(logged: list[events.Event]) -> dict[tuple[int, str], tuple[int, int]]:
    """(step, req_id) -> (token id, its position in the request's output) of every token rank 0 sampled
    that the core emitted (not a sample it dropped, past a request's end)."""
    outputs: dict[tuple[int, str], tuple[int, int]] = {}
    num_emitted: dict[str, int] = defaultdict(int)
    sampled: dict[str, tuple[int, int]] = {}  # of the last input: req_id -> (step, token id)
    for event in logged:
        if isinstance(event, events.INPUT_TYPES):
            is_step = isinstance(event, events.StepCompleted) and event.rank == 0
            sampled = {s.req_id: (event.step, s.token_id) for s in event.sampled} if is_step else {}
        elif isinstance(event, events.TokensEmitted) and event.new_token_ids and event.req_id in sampled:
            step, token_id = sampled[event.req_id]
            assert event.new_token_ids == [token_id], event
            outputs[(step, event.req_id)] = (token_id, num_emitted[event.req_id])
            num_emitted[event.req_id] += 1
    return outputs


def _reference_keys(logged: list[events.Event], model_dir: str, base: str) -> dict[str, str]:
    """req_id -> the "model|prompt" of its reference."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = {tuple(tok(p)["input_ids"]): p for p in PROMPTS}
    arrived = [e for e in logged if isinstance(e, events.RequestArrived)]
    return {e.req_id: f"{e.lora_name or base}|{prompts[tuple(e.prompt_token_ids)]}" for e in arrived}
