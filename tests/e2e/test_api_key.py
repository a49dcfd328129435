"""--api-key and --admin-api-key through the real process group: /v1 routes need the Bearer
key, the adapter routes the admin key, the open routes stay open, and neither key is in
another process, the config file or the log."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from ledgerserve.shared.eventlog import newest_log
from tests.e2e.server import Server

pytestmark = pytest.mark.slow
KEY = "test-key-1f2e3d"
ADMIN = "admin-key-4b5a69"


def test_api_key_guards_v1_and_stays_in_the_http_process(demo_model_dir, tmp_path):
    args = ["--api-key", KEY, "--admin-api-key", ADMIN, "--max-model-len", "256"]
    server = Server(demo_model_dir, str(tmp_path), args).start()
    try:
        model = os.path.basename(demo_model_dir)
        body = {"model": model, "prompt": "hi", "max_tokens": 2}
        denied = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
        assert denied.status_code == 401 and denied.json()["error"]["message"]
        wrong = httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=30)
        assert wrong.status_code == 401
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
        assert client.completions.create(model=model, prompt="hi", max_tokens=2).choices[0].text is not None
        unload = server.base_url + "/v1/unload_lora_adapter"
        assert httpx.post(unload, json={"lora_name": "a"}, headers=_bearer(KEY), timeout=30).status_code == 403
        as_admin = httpx.post(unload, json={"lora_name": "a"}, headers=_bearer(ADMIN), timeout=30)
        assert as_admin.status_code == 400 and "--enable-lora" in as_admin.text  # past the key, to the route
        for key in (KEY, ADMIN):
            holders = [c.cmdline()[2] for c in server.children() if key in "".join(c.environ().values())]
            assert holders == ["ledgerserve.tokenizer_proc.main"]
        run_dir = server.run_dirs()[0]
        with open(os.path.join(run_dir, "config.json"), "rb") as f:
            assert KEY.encode() not in f.read() and ADMIN.encode() not in f.read()
    finally:
        assert server.stop() == 0
    with open(newest_log(str(tmp_path)), "rb") as f:
        log = f.read()
    assert KEY.encode() not in log and ADMIN.encode() not in log


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
