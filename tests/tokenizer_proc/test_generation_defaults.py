"""`--generation-config`: the sampling defaults of a generation_config.json reach the engine's
RequestArrived (the fake engine records arrivals) for completions and chat alike; request fields
override them; `vllm` ignores the file; a DIR reads its own; a bad file refuses the start-up."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.app import build_app
from ledgerserve.tokenizer_proc.generation_defaults import GenerationConfigError, GenerationDefaults, parse_defaults
from tests.tokenizer_proc.app_client import MODEL, app_client

pytestmark = pytest.mark.anyio
MAX_MODEL_LEN = 64
FILE = {
    "do_sample": True,
    "eos_token_id": [2, 3],
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "max_new_tokens": 5,
}
ENGINE_OWN = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
FIELDS = tuple(ENGINE_OWN)
FROM_FILE = {name: FILE[name] for name in FIELDS}


@pytest.fixture(scope="module")
def model_dir(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo model with a generation_config.json that sets every default the engine takes."""
    target = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(demo_model_dir, target)
    (target / "generation_config.json").write_text(json.dumps(FILE))
    return str(target)


async def _sampling(engine, tokenizer, model_dir: str, requests: list[tuple[str, dict]], **config) -> list:
    """The SamplingParams each request reached the engine with."""
    async with app_client(engine, tokenizer, model_dir, **config) as client:
        for path, body in requests:
            r = await client.post(path, json={"model": MODEL, **body})
            assert r.status_code == 200, r.text
    return [arrived.sampling for arrived in engine.arrivals]


def _fields(sampling) -> dict:
    return {name: getattr(sampling, name) for name in FIELDS}


COMPLETION = ("/v1/completions", {"prompt": "hi"})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})


async def test_the_model_file_gives_the_defaults_of_both_endpoints(engine, tokenizer, model_dir, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="ledgerserve.tokenizer_proc.generation_defaults"):
        sampled = await _sampling(engine, tokenizer, model_dir, [COMPLETION, CHAT])
    for sampling in sampled:
        assert _fields(sampling) == FROM_FILE
        assert sampling.max_tokens == FILE["max_new_tokens"]
    logged = [r.getMessage() for r in caplog.records if "default sampling params" in r.getMessage()]
    assert len(logged) == 1 and "'temperature': 0.6" in logged[0] and "'max_tokens': 5" in logged[0]


async def test_request_fields_override_the_defaults(engine, tokenizer, model_dir) -> None:
    override = {"temperature": 0, "top_k": -1, "min_p": 0.5, "max_tokens": 3}
    (sampling,) = await _sampling(engine, tokenizer, model_dir, [(COMPLETION[0], {**COMPLETION[1], **override})])
    assert _fields(sampling) == {**FROM_FILE, "temperature": 0.0, "top_k": 0, "min_p": 0.5}
    assert sampling.max_tokens == 3
    chat_override = {**CHAT[1], "max_completion_tokens": 7, "top_p": 0.3}
    (_, chat) = await _sampling(engine, tokenizer, model_dir, [(CHAT[0], chat_override)])
    assert chat.max_tokens == 7 and chat.top_p == 0.3 and chat.temperature == FILE["temperature"]


async def test_vllm_ignores_the_file(engine, tokenizer, model_dir, tmp_path: Path) -> None:
    sampled = await _sampling(engine, tokenizer, model_dir, [COMPLETION, CHAT], generation_config="vllm")
    prompt_len = len(engine.arrivals[0].prompt_token_ids)
    assert _fields(sampled[0]) == _fields(sampled[1]) == ENGINE_OWN
    assert sampled[0].max_tokens == MAX_MODEL_LEN - prompt_len  # the room left, as without a file


async def test_a_dir_reads_its_own_file(engine, tokenizer, model_dir, tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "max_new_tokens": 1000}))
    (sampling,) = await _sampling(engine, tokenizer, model_dir, [COMPLETION], generation_config=str(tmp_path))
    assert _fields(sampling) == {**ENGINE_OWN, "temperature": 0.3}  # the model dir's file is not read
    assert sampling.max_tokens == MAX_MODEL_LEN - len(engine.arrivals[0].prompt_token_ids)  # capped by the room


def test_transformers_defaults_are_left_out_as_vllm_does() -> None:
    data = json.dumps({"temperature": 1.0, "top_p": 1.0, "top_k": 50, "repetition_penalty": 1.0, "min_p": None})
    assert parse_defaults(data.encode(), "g.json", 1000) == GenerationDefaults()
    assert parse_defaults(b'{"top_k": 40, "top_p": 0.95}', "g.json", 1000).applied() == {"top_k": 40, "top_p": 0.95}


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ('{"temperature": -0.5}', "temperature"),
        ('{"temperature": "hot"}', "temperature"),
        ('{"top_p": 0}', "top_p"),
        ('{"top_k": 2.5}', "top_k"),
        ('{"top_k": 5000}', "top_k"),  # past the vocabulary (1000)
        ('{"min_p": 1.5}', "min_p"),
        ('{"repetition_penalty": 0}', "repetition_penalty"),
        ('{"max_new_tokens": 0}', "max_new_tokens"),
        ('{"temperature": NaN}', "temperature"),
        ('{"temperature": 0.5', "Invalid JSON"),
        ("[1]", "object"),
    ],
)
def test_invalid_values_name_the_file_and_field(body: str, named: str) -> None:
    with pytest.raises(GenerationConfigError, match=named) as refused:
        parse_defaults(body.encode(), "/models/m/generation_config.json", 1000)
    assert str(refused.value).startswith("/models/m/generation_config.json: ")


def test_a_bad_file_or_missing_dir_refuses_the_start_up(engine, tokenizer, model_dir: str, tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"top_p": 2}')
    settings = {"model_dir": model_dir, "served_model_name": MODEL, "max_model_len": MAX_MODEL_LEN}
    config = EngineConfig(**settings, generation_config=str(tmp_path))
    with pytest.raises(GenerationConfigError, match="top_p"):
        build_app(engine, tokenizer, config)
    missing = EngineConfig(**settings, generation_config=str(tmp_path / "none"))
    with pytest.raises(GenerationConfigError, match="there is no generation_config.json in that directory"):
        build_app(engine, tokenizer, missing)
