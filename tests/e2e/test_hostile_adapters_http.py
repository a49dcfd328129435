"""Hostile adapters through the real process group: each load gets a 400 in the OpenAI error
shape while the HTTP process keeps answering (a completion within a 1 s client timeout, during
and after the load) and the registry stays as it was. A ReDoS pattern that matches nothing is
a valid adapter and loads at once; so does one with finite weights huge enough to overflow, and
base requests batched with it keep their answers. A trusted start-up adapter whose files link
out of every allowed directory (a Hugging Face cache layout) is served by the worker."""

from __future__ import annotations

import asyncio
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from ledgerserve.shared.adapter_types import CONFIG_FILE, WEIGHTS_FILE
from tests.adapter_factory import make_peft_adapter
from tests.e2e.server import Server
from tests.model_factory import load_reference
from tests.reference import assert_greedy_matches, greedy_reference
from tests.shared.hostile_adapters import HOSTILE, edit_config, huge_weights

pytestmark = pytest.mark.slow

ADAPTER = dict(r=4, alpha=8, targets=["q_proj", "v_proj"])
HUGE_TOKENS = 16


@pytest.fixture(scope="module")
def dirs(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    top = tmp_path_factory.mktemp("hostile")
    paths = {name: top / name for name in ("root", "outside", "good", "cache")}
    for path in paths.values():
        path.mkdir()
    make_peft_adapter(demo_model_dir, str(paths["good"] / "a"), **ADAPTER)
    snapshot, blobs = paths["cache"] / "snapshots" / "rev", paths["cache"] / "blobs"  # outside the root
    snapshot.mkdir(parents=True)
    shutil.copytree(paths["good"] / "a", blobs)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / name)
    return paths


@pytest.fixture(scope="module")
def server(demo_model_dir: str, dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    args = [
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-allowed-dir",
        str(dirs["root"]),
        "--max-model-len",
        "256",
        "--num-kv-blocks",
        "64",
        "--max-num-seqs",
        "8",
        "--lora-modules",
        f"trusted={dirs['cache'] / 'snapshots' / 'rev'}",
    ]
    srv = Server(demo_model_dir, str(tmp_path_factory.mktemp("hostile-events")), args).start()
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=1.0)
    client.completions.create(model=_base(client), prompt="warm up", max_tokens=2, timeout=60)
    return client


def _base(client: openai.OpenAI) -> str:
    return next(m.id for m in client.models.list().data if m.model_extra.get("parent") is None)


def _ids(client: openai.OpenAI) -> list[str]:
    return sorted(m.id for m in client.models.list().data)


def _load(server: Server, name: str, path: Path) -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}, timeout=30
    )


def _responsive(client: openai.OpenAI) -> None:
    """A base completion answers within the client's 1 s timeout."""
    assert client.completions.create(model=_base(client), prompt="The river", max_tokens=2).choices[0].text is not None


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_adapter_gets_a_400_and_the_server_stays_responsive(
    name: str, server: Server, client: openai.OpenAI, dirs: dict[str, Path]
) -> None:
    build, fragment = HOSTILE[name]
    path = Path(shutil.copytree(dirs["good"] / "a", dirs["root"] / name))
    build(path, dirs["outside"])
    before = _ids(client)
    with ThreadPoolExecutor(1) as pool:
        load = pool.submit(_load, server, name, path)
        _responsive(client)  # while the adapter is being read
        r = load.result()
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    assert error["param"] == "lora_path" and fragment in error["message"], error
    assert str(dirs["outside"]) not in r.text and "Traceback" not in r.text
    _responsive(client)
    assert _ids(client) == before


@pytest.mark.timeout(60)
def test_a_redos_key_that_matches_nothing_loads_at_once(
    server: Server, client: openai.OpenAI, dirs: dict[str, Path]
) -> None:
    path = Path(shutil.copytree(dirs["good"] / "a", dirs["root"] / "redos-key"))
    edit_config(path, rank_pattern={"(.|.)*Z": 4}, alpha_pattern={"model.(.|.)*Z": 4})
    assert _load(server, "redos-key", path).status_code == 200
    _responsive(client)
    out = client.completions.create(model="redos-key", prompt="The river", max_tokens=2, timeout=30)
    assert out.model == "redos-key"
    assert httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": "redos-key"}).status_code == 200


def test_a_huge_weight_adapter_changes_no_base_answer(
    server: Server, client: openai.OpenAI, dirs: dict[str, Path], demo_model_dir: str
) -> None:
    """Finite weights big enough to overflow load (200), and base requests batched with that
    adapter's still get the base model's greedy answers (transformers); its own requests end with
    a 200 and token ids of the vocabulary."""
    from transformers import AutoTokenizer

    path = Path(shutil.copytree(dirs["good"] / "a", dirs["root"] / "huge"))
    huge_weights(1e38)(path, dirs["outside"])
    assert _load(server, "huge", path).status_code == 200
    prompts = ["The river", "A small bakery on the corner", "Rain fell over the hills and", "Once upon"]
    jobs = [(model, p) for p in prompts for model in ("huge", _base(client), "huge")]  # rows interleaved
    outputs = asyncio.run(_complete_all(server, jobs))
    tokenizer, reference = AutoTokenizer.from_pretrained(demo_model_dir), load_reference(demo_model_dir)
    got = {p: ids for (model, p), ids in zip(jobs, outputs) if model != "huge"}
    want = {p: greedy_reference(reference, tokenizer(p)["input_ids"], HUGE_TOKENS) for p in prompts}
    assert_greedy_matches(got, want)
    vocab = len(tokenizer)
    assert all(0 <= t < vocab for (model, _), ids in zip(jobs, outputs) if model == "huge" for t in ids)
    assert httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": "huge"}).status_code == 200


async def _complete_all(server: Server, jobs: list[tuple[str, str]]) -> list[list[int]]:
    """Every (model, prompt) at once, so that the steps batch them: each one's token ids."""
    extra = {"ignore_eos": True, "return_token_ids": True}
    async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as c:
        outs = await asyncio.gather(
            *(
                c.completions.create(model=m, prompt=p, max_tokens=HUGE_TOKENS, temperature=0.0, extra_body=extra)
                for m, p in jobs
            )
        )
    return [out.choices[0].model_extra["token_ids"] for out in outs]


def test_a_trusted_startup_adapter_may_link_anywhere(client: openai.OpenAI, dirs: dict[str, Path]) -> None:
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert cards["trusted"]["root"] == "trusted"  # its server path is shown only to the admin key
    out = client.completions.create(model="trusted", prompt="The river", max_tokens=2, timeout=30)
    assert out.model == "trusted" and out.choices[0].finish_reason == "length"
