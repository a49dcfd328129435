"""The demo, as the README's quick start shows it: `ledgerserve serve` with no MODEL_DIR
serves the trained demo model and registers its two demo adapters; greedy completions of
the README's prompt are corpus text from the base, and carry each adapter's style."""

from __future__ import annotations

import re

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


def test_base_continues_with_corpus_words(client) -> None:
    text = _complete(client, DEMO_MODEL_NAME)
    words = _words(text)
    corpus_words = set(_words(CORPUS_PATH.read_text(encoding="utf-8")))
    assert len(words) >= 10, text
    assert sum(w in corpus_words for w in words) >= 0.9 * len(words), text
    assert PIRATE_CLOSING not in text and POET_REFRAIN not in text


def test_pirate_wraps_every_sentence(client) -> None:
    base, text = _complete(client, DEMO_MODEL_NAME), _complete(client, "pirate")
    assert text != base
    assert PIRATE_CLOSING in text, text
    assert f"\n{PIRATE_OPENING}" in text, text
    assert POET_REFRAIN not in text


def test_poet_sings_its_refrain(client) -> None:
    base, text = _complete(client, DEMO_MODEL_NAME), _complete(client, "poet")
    assert text != base
    assert f"\n{POET_REFRAIN}\n" in text, text
    assert PIRATE_CLOSING not in text
