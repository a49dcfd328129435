"""Start-up waits for the core to stage the --lora-modules adapters into the CPU tier before the
server says ready (tokenizer_proc/staging.py:wait_staged), and never hangs on it."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

from ledgerserve.shared.events import AdapterRow
from ledgerserve.tokenizer_proc import staging


def test_waits_until_the_adapters_it_can_hold_are_staged():
    engine = SimpleNamespace(adapter_rows={"a": AdapterRow("a", 1, "disk"), "b": AdapterRow("b", 2, "disk")})

    async def stage_later():
        await asyncio.sleep(0.2)
        engine.adapter_rows["a"] = AdapterRow("a", 1, "cpu")
        await asyncio.sleep(0.2)
        engine.adapter_rows["b"] = AdapterRow("b", 2, "gpu")

    async def main():
        later = asyncio.create_task(stage_later())
        started = time.monotonic()
        await staging.wait_staged(engine.adapter_rows, ["a", "b"], max_cpu_loras=8)
        waited = time.monotonic() - started
        await later
        return waited

    assert asyncio.run(main()) >= 0.35  # it returned only once both were staged


def test_a_tier_too_small_for_all_needs_only_what_it_holds(monkeypatch):
    engine = SimpleNamespace(adapter_rows={"a": AdapterRow("a", 1, "cpu"), "b": AdapterRow("b", 2, "disk")})
    monkeypatch.setattr(staging, "STAGE_WAIT_S", 30.0)
    asyncio.run(asyncio.wait_for(staging.wait_staged(engine.adapter_rows, ["a", "b"], max_cpu_loras=1), 5))


def test_staging_that_never_ends_does_not_hold_the_start(monkeypatch, caplog):
    engine = SimpleNamespace(adapter_rows={})
    monkeypatch.setattr(staging, "STAGE_WAIT_S", 0.3)
    asyncio.run(asyncio.wait_for(staging.wait_staged(engine.adapter_rows, ["a"], max_cpu_loras=8), 5))
    assert "serving all the same" in caplog.text
