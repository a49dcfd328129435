"""Adapters loaded on first request and a pinned adapter, through the real process group and
the real `openai` client: a first request by `lora_path` and by a name of `--lora-resolve-dir`
gives PEFT's tokens; 20 concurrent first requests load the adapter once; a path outside the
allowed dirs or a broken directory is refused and nothing loads; past `--max-on-demand-loras`
the least recently used idle adapter goes while one in flight keeps its adapter to the end,
and with every one in use the next gets 503. The log replays under two hash seeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import EventLogReader, newest_log, run_segments
from tests.adapter_factory import load_peft_reference, make_peft_adapter
from tests.e2e.server import Server
from tests.reference import Reference, assert_greedy_matches, greedy_reference

pytestmark = pytest.mark.slow

NUM_TOKENS = 12
LONG_TOKENS = 192  # a stream that stays in flight while three other adapters load
PROMPT = "The river ran"
NAMED = {"yname": 21, "zname": 22, "a-name": 23, "b-name": 24, "c-name": 25, "d-name": 26}  # in --lora-resolve-dir
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture(scope="module")
def root(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    top = tmp_path_factory.mktemp("on-demand")
    make_peft_adapter(demo_model_dir, top / "direct-x", r=8, alpha=16, targets=["q_proj", "v_proj"], seed=20)
    make_peft_adapter(demo_model_dir, top / "pin", r=4, alpha=8, targets=["o_proj", "down_proj"], seed=19)
    for name, seed in NAMED.items():
        make_peft_adapter(
            demo_model_dir, top / "by-name" / name, r=4, alpha=8, targets=["q_proj", "up_proj"], seed=seed
        )
    (top / "by-name" / "broken").mkdir()
    (top / "by-name" / "broken" / "adapter_config.json").write_text('{"r": 4, "lora_alpha": NaN}')
    make_peft_adapter(demo_model_dir, top.parent / "outside-evil", r=4, alpha=8, targets=["q_proj"], seed=27)
    return top


@pytest.fixture(scope="module")
def server(demo_model_dir: str, root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pinned = json.dumps({"name": "pin", "path": str(root / "pin"), "pinned": True})
    args = [
        "--enable-lora",
        "--max-loras",
        "3",
        "--max-cpu-loras",
        "4",
        "--max-lora-rank",
        "16",
        "--lora-allowed-dir",
        str(root),
        "--lora-resolve-dir",
        str(root / "by-name"),
        "--max-on-demand-loras",
        "2",
        "--max-model-len",
        "512",
        "--num-kv-blocks",
        "192",
        "--max-num-batched-tokens",
        "96",
        "--max-num-seqs",
        "32",
        "--lora-modules",
        pinned,
    ]
    srv = Server(demo_model_dir, str(tmp_path_factory.mktemp("on-demand-events")), args).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


class References:
    def __init__(self, base_dir: str) -> None:
        from transformers import AutoTokenizer

        self.base_dir = base_dir
        self.prompt_ids = AutoTokenizer.from_pretrained(base_dir)(PROMPT)["input_ids"]

    def get(self, adapter_dir: Path, num_tokens: int = NUM_TOKENS) -> Reference:
        return greedy_reference(load_peft_reference(self.base_dir, adapter_dir), self.prompt_ids, num_tokens)


@pytest.fixture(scope="module")
def refs(demo_model_dir: str) -> References:
    return References(demo_model_dir)


def _tokens(client: openai.OpenAI, model: str, **extra: object) -> list[int]:
    body = {**GREEDY["extra_body"], **extra}
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=NUM_TOKENS, temperature=0.0, extra_body=body)
    return out.choices[0].model_extra["token_ids"]


def _cards(client: openai.OpenAI) -> dict[str, dict]:
    return {m.id: m.model_extra for m in client.models.list().data if m.model_extra.get("parent") is not None}


def _base(client: openai.OpenAI) -> str:
    return next(m.id for m in client.models.list().data if m.model_extra.get("parent") is None)


def test_the_pinned_startup_adapter(server, client, root, refs):
    assert {name: card["pinned"] for name, card in _cards(client).items()} == {"pin": True}
    assert_greedy_matches({"pin": _tokens(client, "pin")}, {"pin": refs.get(root / "pin")})
    # it keeps its slot: /v1/models and /metrics say so once the scheduler's rows arrive
    deadline = time.monotonic() + 30
    while _cards(client)["pin"].get("location") != "gpu" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _cards(client)["pin"]["location"] == "gpu"
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(httpx.get(server.base_url + "/metrics").text)
        for s in family.samples
    }
    assert samples[("ledgerserve_lora_pinned", (("adapter", "pin"),))] == 1.0


def test_first_requests_by_lora_path_and_by_name_match_peft(client, root, refs):
    direct = os.path.realpath(root / "direct-x")
    got = {
        "direct": _tokens(client, _base(client), lora_path=str(root / "by-name" / ".." / "direct-x")),
        "yname": _tokens(client, "yname"),
    }
    assert_greedy_matches(got, {"direct": refs.get(root / "direct-x"), "yname": refs.get(root / "by-name" / "yname")})
    cards = _cards(client)
    assert cards[direct]["root"] == direct and cards["yname"]["root"] == "yname"  # no server path but the name
    assert not cards[direct]["pinned"] and not cards["yname"]["pinned"]


def test_twenty_concurrent_first_requests_load_once(server, client, root, refs):
    import asyncio

    async def twenty() -> list[list[int]]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as aclient:
            outs = await asyncio.gather(
                *(
                    aclient.completions.create(model="zname", prompt=PROMPT, max_tokens=NUM_TOKENS, **GREEDY)
                    for _ in range(20)
                )
            )
        return [o.choices[0].model_extra["token_ids"] for o in outs]

    results = asyncio.run(twenty())
    assert all(ids == results[0] for ids in results)
    assert_greedy_matches({"zname": results[0]}, {"zname": refs.get(root / "by-name" / "zname")})
    # the log (test_log_replays) holds exactly one load and one registration of zname


def test_refused_first_requests_load_nothing(client, root):
    before = _cards(client)
    with pytest.raises(openai.BadRequestError, match="not inside any --lora-allowed-dir"):
        _tokens(client, _base(client), lora_path=str(root.parent / "outside-evil"))
    with pytest.raises(openai.BadRequestError) as broken:
        _tokens(client, "broken")
    assert broken.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _tokens(client, "no-such-name")
    assert _cards(client) == before
    assert len(_tokens(client, _base(client))) == NUM_TOKENS  # still serving


def _stream(client: openai.OpenAI, model: str):
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=LONG_TOKENS, stream=True, **GREEDY)
    return stream, [next(iter(stream))]


def test_the_least_recently_used_idle_adapter_goes_and_one_in_flight_stays(server, client, root, refs):
    a_stream, a_chunks = _stream(client, "a-name")  # a-name decodes while the others load
    _tokens(client, "b-name")
    assert set(_cards(client)) == {"pin", "a-name", "b-name"}  # the bound is 2: yname and zname went
    _tokens(client, "c-name")
    assert set(_cards(client)) == {"pin", "a-name", "c-name"}  # b-name was idle, a-name is in flight
    c_stream, _ = _stream(client, "c-name")
    with pytest.raises(openai.APIStatusError) as full:
        _tokens(client, "d-name")
    assert full.value.status_code == 503 and "--max-on-demand-loras" in full.value.message
    c_stream.close()
    a_chunks += list(a_stream)
    ids = [t for c in a_chunks for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert a_chunks[-1].choices[0].finish_reason == "length"
    assert_greedy_matches({"a": ids}, {"a": refs.get(root / "by-name" / "a-name", LONG_TOKENS)})
    got = {"d": _tokens(client, "d-name"), "b": _tokens(client, "b-name")}  # b-name loads again, on demand
    assert_greedy_matches(got, {"d": refs.get(root / "by-name" / "d-name"), "b": refs.get(root / "by-name" / "b-name")})
    server.wait_idle()


def test_log_replays_with_one_load_per_first_use(server, root):
    assert server.stop() == 0
    log = newest_log(server.log_dir)
    records = [event for segment in run_segments(log) for _, event in EventLogReader(segment, repair=False)]
    loads = [e for e in records if isinstance(e, ev.AdapterLoadRequested)]
    assert [e.name for e in loads if e.name == "zname"] == ["zname"]
    assert len([e for e in records if isinstance(e, ev.AdapterRegistered) and e.name == "zname"]) == 1
    assert all("outside" not in e.path and e.name != "broken" for e in loads)
    assert [(e.name, e.pinned, e.on_demand) for e in loads if e.pinned] == [("pin", True, False)]
    assert {e.name for e in records if isinstance(e, ev.AdapterUnloaded) and e.reason == "lru"} >= {
        "yname",
        "zname",
        "b-name",
    }
    for seed in ("0", "999"):
        done = subprocess.run(
            [sys.executable, "-m", "ledgerserve", "replay", "--verify", server.log_dir],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
    shown = subprocess.run(
        [sys.executable, "-m", "ledgerserve", "replay", server.log_dir, "--show", "adapters", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    versions = json.loads(shown.stdout)["state"]["adapters"]
    assert any(v.get("pinned") and v["name"] == "pin" for v in versions)
    assert any(v.get("on_demand") and v["name"] == "b-name" for v in versions)
