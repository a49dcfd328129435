"""Group commit through the real process group: a simulated power cut in the scheduler, between a
step's records and their fsync (the records written since the last fsync are cut from the log and
the process is killed), leaves no client holding a token that the log does not hold."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from ledgerserve.shared import env, events
from ledgerserve.shared.eventlog import EventLogReader, newest_log
from ledgerserve.shared.eventlog.group_commit import DURABLE_BYTES_SUFFIX
from tests.e2e.server import Server

pytestmark = pytest.mark.slow
NUM_TOKENS = 96
LOSS_SEQ = 60  # about step 12: records are a few per step (the step's input, its tokens, plan, digests)


def stream_token_ids(base_url: str) -> list[int]:
    """The token ids one streaming completion delivered before its stream ended, however it ended."""
    body = {"model": "demo", "prompt": [5, 6, 7, 8, 9], "max_tokens": NUM_TOKENS, "min_tokens": NUM_TOKENS}
    body |= {"ignore_eos": True, "temperature": 0.0, "stream": True, "return_token_ids": True}
    received: list[int] = []
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: ") :])
                    for choice in chunk.get("choices", []):
                        received += choice.get("token_ids") or []
    except httpx.HTTPError:
        pass  # the engine went away mid-stream
    return received


@pytest.mark.parametrize("scheduling", [[], ["--async-scheduling"]], ids=["one-step", "async"])
def test_a_power_cut_before_the_fsync_takes_back_no_token_a_client_has(demo_model_dir, tmp_path, scheduling):
    log_dir = str(tmp_path / "events")
    args = ["--device", "cpu", "--max-model-len", "256", "--num-kv-blocks", "64", "--served-model-name", "demo"]
    server = Server(demo_model_dir, log_dir, args + scheduling, env={env.FAULT_LOG_LOSS_SEQ: str(LOSS_SEQ)})
    server.start()
    try:
        received = stream_token_ids(server.base_url)
        assert server.proc.wait(timeout=60) != 0  # the scheduler died: the group stopped
    finally:
        server.stop()
    path = newest_log(log_dir)
    with open(path + DURABLE_BYTES_SUFFIX, encoding="ascii") as f:
        os.truncate(path, int(f.read()))  # the power cut: what the last fsync did not cover is gone
    logged = [
        token
        for _, event in EventLogReader(path)
        if isinstance(event, events.TokensEmitted)
        for token in event.new_token_ids
    ]
    assert 0 < len(received) < NUM_TOKENS  # the cut came mid-stream: the check means something
    assert len(logged) >= len(received)
    assert logged[: len(received)] == received  # every token the client got survived the cut
