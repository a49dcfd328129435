"""A server bound to a loopback address answers only requests naming a loopback host (or one of
--allowed-hosts): a page that rebinds its own name to 127.0.0.1 gets a 400 before any route runs.
The requests here reach the app as uvicorn hands them over a loopback socket: the scope's
`server` is 127.0.0.1:8000."""

from __future__ import annotations

import pytest

from tests.tokenizer_proc.app_client import GOOD_COMPLETION, app_client, assert_error

pytestmark = pytest.mark.anyio
LOOPBACK_URL = "http://127.0.0.1:8000"
LOOPBACK_HOSTS = ["127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000", "127.0.0.2", "localhost."]
FOREIGN_HOSTS = ["evil.example:8000", "evil.example", "127.0.0.1.evil.example", "[::2]:8000", "0.0.0.0:8000", ""]


@pytest.mark.parametrize("host", FOREIGN_HOSTS)
async def test_a_foreign_host_is_refused(engine, tokenizer, demo_model_dir: str, host: str) -> None:
    async with app_client(engine, tokenizer, demo_model_dir) as client:
        client.base_url = LOOPBACK_URL
        for method, path, body in (("GET", "/health", None), ("POST", "/v1/completions", GOOD_COMPLETION)):
            r = await client.request(method, path, json=body, headers={"Host": host})
            assert "is not allowed" in assert_error(r, 400, None)
        assert engine.arrivals == []
        assert (await client.post("/v1/completions", json=GOOD_COMPLETION)).status_code == 200


@pytest.mark.parametrize("host", LOOPBACK_HOSTS)
async def test_loopback_hosts_are_answered(engine, tokenizer, demo_model_dir: str, host: str) -> None:
    async with app_client(engine, tokenizer, demo_model_dir) as client:
        client.base_url = LOOPBACK_URL
        r = await client.post("/v1/completions", json=GOOD_COMPLETION, headers={"Host": host})
        assert r.status_code == 200, r.text


async def test_allowed_hosts_add_names(engine, tokenizer, demo_model_dir: str) -> None:
    async with app_client(engine, tokenizer, demo_model_dir, allowed_hosts=("llm.internal",)) as client:
        client.base_url = LOOPBACK_URL
        assert (await client.get("/version", headers={"Host": "llm.internal:443"})).status_code == 200
        assert_error(await client.get("/version", headers={"Host": "other.internal"}), 400, None)
    async with app_client(engine, tokenizer, demo_model_dir, allowed_hosts=("*",)) as client:
        client.base_url = LOOPBACK_URL
        assert (await client.get("/version", headers={"Host": "anything.example"})).status_code == 200


async def test_a_server_on_other_addresses_does_not_check(engine, tokenizer, demo_model_dir: str) -> None:
    async with app_client(engine, tokenizer, demo_model_dir, host="0.0.0.0") as client:
        client.base_url = LOOPBACK_URL
        assert (await client.get("/version", headers={"Host": "llm.example.com"})).status_code == 200
