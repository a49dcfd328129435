"""Start-up waits for the core to stage the `--lora-modules` adapters into the workers' CPU tier
before the server says ready: staging reads and checks every file, which a first pass would
otherwise pay for beside its steps. What is staged comes from the adapter rows of the scheduler's
gauges (EngineStats), which the ZeroMQ client receives (engine_socket.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from ledgerserve.shared.events import AdapterRow

logger = logging.getLogger(__name__)

STAGE_WAIT_S = 120.0  # the most start-up waits for the CPU tier; past it the server starts all the same
STAGE_POLL_S = 0.05


async def wait_staged(rows: Mapping[str, AdapterRow], names: list[str], max_cpu_loras: int) -> None:
    """Until as many of `names` as the CPU tier holds are staged (their row's tier is not disk) in
    `rows`, which the caller keeps up to date, or STAGE_WAIT_S passed."""
    want = min(len(names), max_cpu_loras)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STAGE_WAIT_S
    while want and loop.time() < deadline:
        staged = sum(1 for name in names if (row := rows.get(name)) is not None and row.tier != "disk")
        if staged >= want:
            logger.info("%d start-up adapters staged in the CPU tier", staged)
            return
        await asyncio.sleep(STAGE_POLL_S)
    if want:
        logger.warning("start-up adapters not all in the CPU tier after %.0f s: serving all the same", STAGE_WAIT_S)
