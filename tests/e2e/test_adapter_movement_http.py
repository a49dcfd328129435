"""Adapter movement through the real process group, with overlapped loading on and off: more
adapters than GPU slots (5 through `--max-loras 2`) and than CPU-tier entries
(`--max-cpu-loras 3`), base and adapter requests in the same batches, adapters loading while
others decode. Every output equals PEFT's, and the two modes give the same tokens. An
adapter whose files change, vanish, are cut short or become unreadable between its
registration and a reload from disk fails alone; 100 concurrent loads leave the registry
exact. After each test the engine is idle and holds no slot pin, KV block or deferral, and
both runs' logs replay."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from ledgerserve.scheduler_proc.replay import replay
from ledgerserve.shared.adapter_types import WEIGHTS_FILE
from ledgerserve.shared.eventlog import newest_log
from tests.adapter_factory import load_peft_reference, make_peft_adapter
from tests.e2e.server import Server
from tests.model_factory import load_reference
from tests.reference import Reference, assert_greedy_matches, greedy_reference

pytestmark = pytest.mark.slow

MODES = ("off", "on")
NUM_TOKENS = 16
LONG_TOKENS = 48
PROMPTS = ["The river ran", "A small bakery on the corner", "Rain fell over the hills and"]
SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # served from start-up; make_peft_adapter kwargs
    "a0": dict(r=4, alpha=8, targets=["q_proj", "v_proj"], seed=11),
    "a1": dict(r=8, alpha=16, targets=["gate_proj", "up_proj", "down_proj"], seed=12),
    "a2": dict(r=16, alpha=16, targets=SEVEN, use_rslora=True, seed=13),
    "a3": dict(r=8, alpha=32, targets=["k_proj", "o_proj", "lm_head"], seed=14),
    "a4": dict(r=12, alpha=24, targets=["v_proj", "down_proj"], seed=15),
}
SPARES = {
    "x": dict(r=8, alpha=8, targets=["q_proj", "o_proj"], seed=16),
    "y": dict(r=8, alpha=8, targets=["q_proj", "o_proj"], seed=17),
}  # y: x's shapes, other weights
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def root(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    top = tmp_path_factory.mktemp("movement")
    for name, kwargs in {**ADAPTERS, **SPARES}.items():
        make_peft_adapter(demo_model_dir, str(top / name), **kwargs)
    return top


@pytest.fixture(scope="module")
def servers(demo_model_dir: str, root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    modules = [f"{name}={root / name}" for name in ADAPTERS]
    args = [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-cpu-loras",
        "3",
        "--max-lora-rank",
        "16",
        "--lora-allowed-dir",
        str(root),
        "--max-model-len",
        "512",
        "--num-kv-blocks",
        "160",
        "--max-num-batched-tokens",
        "96",
        "--max-num-seqs",
        "32",
        "--async-scheduling",
        "--lora-modules",
        *modules,
    ]
    flags = {"on": "--lora-overlap-loading", "off": "--no-lora-overlap-loading"}
    started: dict[str, Server] = {}
    try:
        for mode in MODES:
            log_dir = str(tmp_path_factory.mktemp(f"movement-events-{mode}"))
            started[mode] = Server(demo_model_dir, log_dir, [*args, flags[mode]]).start()
        yield started
    finally:
        for server in started.values():
            server.stop()


class References:
    """PEFT's (or the base model's) greedy tokens per (adapter directory, prompt), computed once."""

    def __init__(self, base_dir: str) -> None:
        from transformers import AutoTokenizer

        self.base_dir = base_dir
        self.tokenizer = AutoTokenizer.from_pretrained(base_dir)
        self.cache: dict[tuple[str | None, str, int], Reference] = {}

    def get(self, adapter_dir: str | Path | None, prompt: str, num_tokens: int = NUM_TOKENS) -> Reference:
        key = (None if adapter_dir is None else str(adapter_dir), prompt, num_tokens)
        if key not in self.cache:
            model = (
                load_reference(self.base_dir)
                if adapter_dir is None
                else load_peft_reference(self.base_dir, adapter_dir)
            )
            self.cache[key] = greedy_reference(model, self.tokenizer(prompt)["input_ids"], num_tokens)
        return self.cache[key]


@pytest.fixture(scope="module")
def refs(demo_model_dir: str) -> References:
    return References(demo_model_dir)


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _base(server: Server) -> str:
    return next(m.id for m in _client(server).models.list().data if m.model_extra.get("parent") is None)


def _tokens(server: Server, model: str, prompt: str) -> list[int]:
    out = _client(server).completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS, **GREEDY)
    return out.choices[0].model_extra["token_ids"]


def _post(server: Server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + route, json=body, timeout=120)


async def _churn(server: Server, base: str) -> tuple[list[int], list[list[int]], list[tuple[str, str]]]:
    """A long a0 stream first; once it decodes, every adapter and the base model at once."""
    jobs = [(m, p) for m in [base, *ADAPTERS] for p in PROMPTS]
    async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
        stream = await client.completions.create(
            model="a0", prompt=PROMPTS[0], max_tokens=LONG_TOKENS, stream=True, **GREEDY
        )
        chunks = [await stream.__anext__()]  # a0 holds a slot and decodes
        rest = asyncio.gather(
            *(client.completions.create(model=m, prompt=p, max_tokens=NUM_TOKENS, **GREEDY) for m, p in jobs)
        )
        chunks += [chunk async for chunk in stream]
        responses = await rest
    long_ids = [t for c in chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
    return long_ids, [r.choices[0].model_extra["token_ids"] for r in responses], jobs


def test_churn_matches_peft_and_both_modes_agree(servers: dict[str, Server], root: Path, refs: References) -> None:
    outputs = {}
    for mode, server in servers.items():
        base = _base(server)
        long_ids, ids, jobs = asyncio.run(_churn(server, base))
        results = {f"{mode}|a0|long": long_ids}
        expected = {f"{mode}|a0|long": refs.get(root / "a0", PROMPTS[0], LONG_TOKENS)}
        for (model, prompt), got in zip(jobs, ids):
            results[f"{mode}|{model}|{prompt}"] = got
            expected[f"{mode}|{model}|{prompt}"] = refs.get(None if model == base else root / model, prompt)
        print(mode, "near ties accepted:", assert_greedy_matches(results, expected) or "none")
        outputs[mode] = [long_ids, *ids]
        server.wait_idle()
    assert outputs["on"] == outputs["off"]  # overlapped loading changes when, never what


def _evict_from_cpu_tier(server: Server) -> None:
    """One request to each of four other adapters in turn: with 2 slots and 3 CPU-tier
    entries, an adapter used before them is in neither any more."""
    for name in ("a1", "a2", "a3", "a4"):
        _tokens(server, name, PROMPTS[1])


def _rewrite(path: Path, root: Path) -> None:
    for name in os.listdir(root / "y"):
        shutil.copyfile(root / "y" / name, path / name)  # valid, the same shapes, other weights


def _vanish(path: Path, root: Path) -> None:
    shutil.rmtree(path)


def _truncate(path: Path, root: Path) -> None:
    os.truncate(path / WEIGHTS_FILE, os.path.getsize(path / WEIGHTS_FILE) // 2)


def _unreadable(path: Path, root: Path) -> None:
    os.remove(path / WEIGHTS_FILE)
    os.mkfifo(path / WEIGHTS_FILE)  # reading it would block: the reader must refuse it


BREAKAGES = {"rewritten": _rewrite, "vanished": _vanish, "truncated": _truncate, "unreadable": _unreadable}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_files_changed_before_a_reload_fail_only_that_adapter(
    mode: str, breakage: str, servers: dict[str, Server], root: Path, refs: References
) -> None:
    server = servers[mode]
    name = f"frail-{breakage}-{mode}"
    path = Path(shutil.copytree(root / "x", root / name))
    assert _post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}).status_code == 200
    assert_greedy_matches({"x": _tokens(server, name, PROMPTS[0])}, {"x": refs.get(root / "x", PROMPTS[0])})
    _evict_from_cpu_tier(server)
    BREAKAGES[breakage](path, root)

    body = {"model": name, "prompt": PROMPTS[2], "max_tokens": NUM_TOKENS, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        failing = [pool.submit(_post, server, "/v1/completions", body) for _ in range(2)]
        fine = {m: pool.submit(_tokens, server, m, PROMPTS[2]) for m in (_base(server), "a0")}
        statuses = [f.result() for f in failing]
        got = {m: f.result() for m, f in fine.items()}
    assert {r.status_code for r in statuses} <= {500, 404}, [r.text for r in statuses]  # 404: it was dropped
    failed = [r.json()["error"] for r in statuses if r.status_code == 500]
    assert failed, [r.text for r in statuses]
    for error in failed:
        assert error["type"] == "InternalServerError" and name in error["message"], error
        if breakage == "rewritten":
            assert re.search(r"digest|content", error["message"], re.IGNORECASE), error["message"]
    expected = {m: refs.get(None if m != "a0" else root / "a0", PROMPTS[2]) for m in got}
    assert_greedy_matches(got, expected)
    assert _post(server, "/v1/completions", body).status_code in (404, 500)  # never another version's weights
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": name}).status_code in (200, 404)
    server.wait_idle()


def _load_all(server: Server, bodies: list[dict]) -> list[int]:
    with ThreadPoolExecutor(len(bodies)) as pool:
        return [r.status_code for r in pool.map(lambda b: _post(server, "/v1/load_lora_adapter", b), bodies)]


@pytest.mark.parametrize("mode", MODES)
def test_100_concurrent_loads_leave_the_registry_exact(
    mode: str, servers: dict[str, Server], root: Path, refs: References
) -> None:
    server = servers[mode]
    before = sorted(m.id for m in _client(server).models.list().data)
    names = [f"many-{mode}-{i}" for i in range(50)]
    sources = {n: root / ("x", "y", "a0", "a1", "a4")[i % 5] for i, n in enumerate(names)}
    bodies = [{"lora_name": n, "lora_path": str(sources[n])} for n in names for _ in range(2)]  # each name twice
    statuses = _load_all(server, bodies)
    assert len(statuses) == 100
    for i, name in enumerate(names):
        assert sorted(statuses[2 * i : 2 * i + 2]) == [200, 400], (name, statuses[2 * i : 2 * i + 2])
    assert sorted(m.id for m in _client(server).models.list().data) == sorted(before + names)
    for name in names[:3]:
        assert_greedy_matches({name: _tokens(server, name, PROMPTS[1])}, {name: refs.get(sources[name], PROMPTS[1])})
    with ThreadPoolExecutor(50) as pool:
        unloads = list(pool.map(lambda n: _post(server, "/v1/unload_lora_adapter", {"lora_name": n}), names))
    assert [r.status_code for r in unloads] == [200] * 50
    assert sorted(m.id for m in _client(server).models.list().data) == before
    server.wait_idle()


def test_both_logs_replay(servers: dict[str, Server]) -> None:
    for mode, server in servers.items():
        assert server.stop() == 0, mode
        result = replay(newest_log(server.log_dir))
        assert result.ok, (mode, result)
