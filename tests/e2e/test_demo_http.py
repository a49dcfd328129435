"""The demo, as the README's quick start shows it: `ledgerserve serve` with no MODEL_DIR
serves the trained demo model and registers its two demo adapters; greedy completions of
the README's prompt are corpus text from the base, and carry each adapter's style."""

from __future__ import annotations

import json
import re
from pathlib import Path

import openai
import pytest

from ledgerserve.demo_model import CORPUS_PATH, DEMO_MODEL_NAME
from ledgerserve.demo_styles import PIRATE_CLOSING, PIRATE_OPENING, POET_REFRAIN
from tests.e2e.server import Server

pytestmark = pytest.mark.slow

PROMPT = "The morning"  # the README's quick-start prompt
GREEDY = {"temperature": 0.0, "max_tokens": 32}


@pytest.fixture(scope="module")
def client(demo_home, tmp_path_factory):
    log_dir = str(tmp_path_factory.mktemp("demo-events"))
    server = Server(None, log_dir, ["--max-model-len", "256"], env={"HOME": demo_home}).start()
    try:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    finally:
        server.stop()


def _complete(client: openai.OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, **GREEDY).choices[0].text


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def test_models_lists_the_base_and_both_demo_adapters(client) -> None:
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(cards) == {DEMO_MODEL_NAME, "pirate", "poet"}
    assert cards["pirate"]["parent"] == cards["poet"]["parent"] == DEMO_MODEL_NAME


def _check_base(text: str) -> None:
    words = _words(text)
    corpus_words = set(_words(CORPUS_PATH.read_text(encoding="utf-8")))
    assert len(words) >= 10, text
    assert sum(w in corpus_words for w in words) >= 0.9 * len(words), text
    assert PIRATE_CLOSING not in text and POET_REFRAIN not in text, text


def _check_pirate(text: str) -> None:
    assert PIRATE_CLOSING in text and f"\n{PIRATE_OPENING}" in text, text
    assert POET_REFRAIN not in text, text


def _check_poet(text: str) -> None:
    assert f"\n{POET_REFRAIN}\n" in text, text
    assert PIRATE_CLOSING not in text, text


CHECKS = {DEMO_MODEL_NAME: _check_base, "pirate": _check_pirate, "poet": _check_poet}


def test_base_continues_with_corpus_words(client) -> None:
    _check_base(_complete(client, DEMO_MODEL_NAME))


@pytest.mark.parametrize("adapter", ["pirate", "poet"])
def test_each_adapter_answers_in_its_style(client, adapter) -> None:
    text = _complete(client, adapter)
    assert text != _complete(client, DEMO_MODEL_NAME)
    CHECKS[adapter](text)


def test_readme_shows_these_requests_and_answers_in_these_styles() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    for model, check in CHECKS.items():
        request = f'"model": "{model}", "prompt": "{PROMPT}", "max_tokens": {GREEDY["max_tokens"]}, "temperature": 0'
        assert request in readme, model
        shown = re.search(rf"^{re.escape(model)}: +(\".*\")$", readme, re.MULTILINE)
        assert shown, model
        check(json.loads(shown.group(1)))
