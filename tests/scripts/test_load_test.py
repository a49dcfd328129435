"""scripts/serving/load_test.py without a server: argument bounds, loopback only, leak checks."""

from __future__ import annotations

import pytest

from scripts.serving.load_test import leaks, main

IDLE = {
    "ledgerserve_num_requests_running": 0,
    "ledgerserve_num_requests_waiting": 0,
    "ledgerserve_kv_blocks_free": 90,
    "ledgerserve_kv_blocks_cached": 10,
    "ledgerserve_kv_blocks_total": 100,
    "ledgerserve_lora_pinned_slots": 0,
    "ledgerserve_lora_deferred_evictions": 0,
}


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "http://example.com", "http://0.0.0.0:8000"])
def test_refuses_non_loopback_hosts(url):
    with pytest.raises(ValueError, match="non-loopback"):
        main(["--base-url", url, "--duration-s", "1"])


@pytest.mark.parametrize(
    "argv", [["--duration-s", "0"], ["--concurrency", "0"], ["--abort-fraction", "0.9"], ["--adapters", "no-path"]]
)
def test_refuses_unbounded_or_bad_arguments(argv):
    with pytest.raises(ValueError):
        main(["--base-url", "http://127.0.0.1:1", *argv])


def test_leaks_names_what_an_idle_engine_still_holds():
    assert leaks(IDLE) == []
    found = leaks(
        {
            **IDLE,
            "ledgerserve_kv_blocks_free": 80,
            "ledgerserve_lora_pinned_slots": 1,
            "ledgerserve_lora_deferred_evictions": 2,
        }
    )
    assert len(found) == 3 and "KV blocks leaked" in found[0]
    assert leaks({}) != []  # no metrics at all is not idle
