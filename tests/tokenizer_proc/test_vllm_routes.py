"""vLLM's extra endpoints over the in-process app (the real core behind the fake engine), with the real
`openai` client where it has a call: models.retrieve, completions with a list of prompts, /tokenize
and /detokenize (against the transformers tokenizer), /ping."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.peft_util import make_tiny_peft_adapter
from tests.tokenizer_proc.app_client import MODEL, app_client, assert_error

pytestmark = pytest.mark.anyio
ADAPTER = "org/sql"  # an id holding `/`
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def lora_root(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("loras")
    make_tiny_peft_adapter(demo_model_dir, root / "sql", seed=1)
    return root


@pytest.fixture
async def client(engine, tokenizer, demo_model_dir: str, lora_root: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(
        engine, tokenizer, demo_model_dir, enable_lora=True, lora_allowed_dirs=(str(lora_root),), max_n=4
    ) as c:
        load = {"lora_name": ADAPTER, "lora_path": str(lora_root / "sql")}
        assert (await c.post("/v1/load_lora_adapter", json=load)).status_code == 200
        yield c


@pytest.fixture
async def oai(client: httpx.AsyncClient) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=client, max_retries=0) as c:
        yield c


async def test_models_retrieve_gives_the_listed_card(oai: openai.AsyncOpenAI, lora_root: Path) -> None:
    listed = {card.id: card for card in (await oai.models.list()).data}
    base, adapter = await oai.models.retrieve(MODEL), await oai.models.retrieve(ADAPTER)
    assert base.model_dump() == listed[MODEL].model_dump() and base.parent is None  # type: ignore[attr-defined]
    assert adapter.model_dump() == listed[ADAPTER].model_dump()
    assert adapter.parent == MODEL and adapter.root == ADAPTER  # type: ignore[attr-defined]
    with pytest.raises(openai.NotFoundError, match="The model `nope/adapter` does not exist"):
        await oai.models.retrieve("nope/adapter")


async def test_completions_list_of_prompts(oai: openai.AsyncOpenAI, engine, tokenizer) -> None:
    prompts = ["hello there", "a b c d"]
    out = await oai.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=3, seed=7)
    ids = [tokenizer.encode(p) for p in prompts]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [tokenizer.decode((ids[i // 2] * 3)[:3]) for i in range(4)]
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids[0]) + len(ids[1]), 4 * 3)
    arrivals = sorted(engine.arrivals, key=lambda a: a.req_id)
    assert [a.req_id.rsplit("-", 1)[1] for a in arrivals] == ["0", "1", "2", "3"]
    assert [a.prompt_token_ids for a in arrivals] == [ids[0], ids[0], ids[1], ids[1]]
    assert [a.sampling.seed for a in arrivals] == [7, 8, 7, 8]  # prompt i's choice j: seed + j


async def test_completions_list_of_prompts_streams(oai: openai.AsyncOpenAI, tokenizer) -> None:
    prompts = [[5, 6, 7], [8, 9]]  # token-id lists
    stream = await oai.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    usage = None
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
        usage = chunk.usage or usage
    assert texts == {i: tokenizer.decode((prompts[i // 2] * 4)[:4]) for i in range(4)}
    assert finishes == dict.fromkeys(range(4), "length")
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (3 + 2, 4 * 4)


async def test_each_choice_carries_its_prompts_ids_and_prompt_logprobs(client: httpx.AsyncClient) -> None:
    prompts = [[5, 6, 7], [8, 9]]
    payload = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 2, "prompt_logprobs": 1}
    body = (await client.post("/v1/completions", json={**payload, "return_token_ids": True})).json()
    for choice in body["choices"]:
        prompt = prompts[choice["index"] // 2]
        assert choice["prompt_token_ids"] == prompt and choice["token_ids"] == prompt[:2]
        assert len(choice["prompt_logprobs"]) == len(prompt) and choice["prompt_logprobs"][0] is None
        assert [int(next(iter(e))) for e in choice["prompt_logprobs"][1:]] == prompt[1:]  # the prompt token first
    assert "prompt_token_ids" not in body  # several prompts: on the choices only
    r = await client.post("/v1/completions", json={**payload, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
    firsts: dict[int, dict] = {}
    for event in events:
        (choice,) = event["choices"]
        firsts.setdefault(choice["index"], choice)
    assert {i: len(c["prompt_logprobs"]) for i, c in firsts.items()} == {0: 3, 1: 3, 2: 2, 3: 2}


async def test_too_many_choices_over_all_prompts_is_refused(oai: openai.AsyncOpenAI, engine) -> None:
    with pytest.raises(openai.BadRequestError, match=r"n times the number of prompts \(2 x 3\) must be at most 4"):
        await oai.completions.create(model=MODEL, prompt=["a", "b", "c"], n=2, max_tokens=1)
    assert engine.arrivals == []


async def test_tokenize_round_trips_with_detokenize(client: httpx.AsyncClient, tokenizer) -> None:
    prompt = "hello there, <|im_end|> tokens"
    r = await client.post("/tokenize", json={"model": MODEL, "prompt": prompt, "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tokenizer.encode(prompt) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 64 and body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    back = await client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.json() == {"prompt": prompt}  # special tokens kept
    bare = (await client.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False})).json()
    assert bare["tokens"] == tokenizer.encode(prompt, add_special_tokens=False) and bare["token_strs"] is None


async def test_tokenize_chat_messages(client: httpx.AsyncClient, tokenizer) -> None:
    for add_generation_prompt in (True, False):
        payload = {"model": ADAPTER, "messages": MESSAGES, "add_generation_prompt": add_generation_prompt}
        body = (await client.post("/tokenize", json=payload)).json()
        text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
        assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
        back = await client.post("/detokenize", json={"tokens": body["tokens"]})
        assert back.json() == {"prompt": text}


async def test_tokenize_refusals(client: httpx.AsyncClient) -> None:
    assert_error(await client.post("/detokenize", json={"tokens": [1, 1 << 20]}), 400, "tokens")
    assert_error(await client.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    assert_error(await client.post("/tokenize", json={"model": "unknown", "prompt": "x"}), 404, "model")
    assert_error(await client.post("/tokenize", json={"prompt": "x", "echo": True}), 400, "echo")
    assert_error(await client.post("/tokenize", json={"model": MODEL}), 400, "prompt")
    chat = {"messages": MESSAGES, "continue_final_message": True}
    assert_error(await client.post("/tokenize", json=chat), 400, "continue_final_message")
    assert_error(
        await client.post("/tokenize", json={"messages": MESSAGES, "chat_template": "{{x}}"}), 400, "chat_template"
    )


async def test_ping_follows_health(client: httpx.AsyncClient, engine) -> None:
    for method in ("GET", "POST"):
        assert (await client.request(method, "/ping")).status_code == 200
    engine.fail("rank 0 fell over")
    for path, method in (("/health", "GET"), ("/ping", "GET"), ("/ping", "POST")):
        assert_error(await client.request(method, path), 503, None)
