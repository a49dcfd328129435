"""`ledgerserve serve ORG/NAME` from an offline Hugging Face cache answers a completion through
the real process group, under the id as given and a second --served-model-name."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.server import Server
from tests.ledgerserve.hf_cache import add_snapshot, checkpoint_files

pytestmark = pytest.mark.slow
REPO = "acme/tiny-chat"


def test_serve_a_model_id_from_the_cache(demo_model_dir, tmp_path):
    cache = tmp_path / "hub"
    add_snapshot(cache, REPO, "main", checkpoint_files(demo_model_dir))
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    flags = ["--max-model-len", "256", "--trust-remote-code", "--served-model-name", REPO, "tiny"]
    server = Server(REPO, str(tmp_path / "logs"), flags, env=env).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == [REPO, "tiny"]
        for model in (REPO, "tiny"):
            done = client.completions.create(model=model, prompt="The river", max_tokens=4)
            assert done.model == REPO and done.usage.completion_tokens == 4  # the first name, as vLLM reports it
    finally:
        assert server.stop() == 0
    assert "--trust-remote-code: remote code is never run" in server.output()
