"""What the event log's bytes hold of request content, through the in-process engine (the
scheduler's ledger and log writer, a fake runner): with `--event-log-content tokens` the prompt, the
sampled ids and their logprobs are there; with `hashed` none of them is, the client still gets
them all, and `ledgerserve replay --verify` passes."""

from __future__ import annotations

import stat
from pathlib import Path

import msgspec
import pytest

from ledgerserve.engine import Engine
from ledgerserve.scheduler_proc.replay import main as replay_main
from ledgerserve.scheduler_proc.replay.diff import diff_logs
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import run_segments
from ledgerserve.shared.sampling import SamplingParams
from tests.tokenizer_proc.fake_engine import EchoRunner

PROMPT = [50021 + 37 * i for i in range(22)]  # distinctive ids, none below 50000
SHARED = PROMPT[:12] + [60013, 60029, 60041, 60053, 60077]  # a second prompt sharing three blocks
SAMPLED = [61001, 61003, 61007, 61009, 61013, 61019]  # what the runner samples, in turn
LOGPROB = -0.6180339887  # the sampled tokens' logprob (and -2.7182818284 the second top one's)
ENCODE = msgspec.msgpack.encode


def _run(
    tmp_path: Path, content: str, second: list[int] = SHARED
) -> tuple[bytes, str, dict[str, list[ev.TokensEmitted]]]:
    """Two requests (one asking for logprobs and prompt logprobs), a preemption-free run to the end.
    Returns the log's bytes, its path and what the client was sent per request."""
    config = EngineConfig(
        model_dir="", served_model_name="fake", max_model_len=256, block_size=4, event_log_content=content
    )
    runner = EchoRunner(num_kv_blocks=64)
    runner.script, runner.logprob_values = SAMPLED, (LOGPROB, -2.7182818284)
    engine = Engine(config, runner, str(tmp_path / content), run_id=content)
    first = SamplingParams(max_tokens=len(SAMPLED), logprobs=1, prompt_logprobs=2)
    decisions = engine.apply(ev.RequestArrived("first", PROMPT, first))
    decisions += engine.run_until_idle()
    decisions += engine.apply(ev.RequestArrived("second", second, SamplingParams(max_tokens=3)))
    decisions += engine.run_until_idle()
    engine.close()
    sent: dict[str, list[ev.TokensEmitted]] = {}
    for d in decisions:
        if isinstance(d, ev.TokensEmitted):
            sent.setdefault(d.req_id, []).append(d)
    path = engine.log.path
    return b"".join(Path(p).read_bytes() for p in run_segments(path)), path, sent


def _content_patterns() -> dict[str, bytes]:
    """The content as msgpack writes it: the prompts as lists, every run of 2+ of their ids (or of the
    sampled ones: a plan's token list, a delta), each sampled id after its request's id (a
    SampledToken) and as a one-id list (a delta, an emission), the logprob."""
    patterns = {"prompt list": ENCODE(PROMPT), "second prompt list": ENCODE(SHARED), "logprob": ENCODE(LOGPROB)}
    for name, ids in (("prompt", PROMPT), ("second prompt", SHARED), ("sampled", SAMPLED)):
        for start in range(len(ids) - 1):
            for end in range(start + 2, len(ids) + 1):
                patterns[f"{name} run {start}:{end}"] = b"".join(ENCODE(i) for i in ids[start:end])
    for token_id in SAMPLED:
        patterns[f"sampled {token_id}"] = ENCODE("first") + ENCODE(token_id)  # a SampledToken's head
        patterns[f"emitted {token_id}"] = ENCODE([token_id])
    return patterns


def _found(data: bytes) -> list[str]:
    return [name for name, pattern in _content_patterns().items() if pattern in data]


def _outputs(sent: dict[str, list[ev.TokensEmitted]]) -> dict[str, list[int]]:
    return {req_id: [t for out in outs for t in out.new_token_ids] for req_id, outs in sent.items()}


def test_the_tokens_log_holds_the_content(tmp_path):
    data, path, sent = _run(tmp_path, "tokens")
    found = _found(data)
    assert {"prompt list", "second prompt list", "logprob", f"sampled {SAMPLED[0]}", "prompt run 3:9"} <= set(found)
    assert _outputs(sent) == {"first": SAMPLED, "second": SAMPLED[:3]}
    assert replay_main(["--verify", path]) == 0


def test_the_hashed_log_holds_none_of_it_and_verifies(tmp_path, capsys):
    data, path, sent = _run(tmp_path, "hashed")
    assert _found(data) == []
    plain_data, _, plain_sent = _run(tmp_path, "tokens")
    assert sent == plain_sent  # every id, logprob and prompt logprob reached the client, as logged in tokens mode
    assert any(out.prompt_logprobs for out in sent["first"]) and all(out.logprobs for out in sent["first"][-6:])
    assert [out.num_cached_tokens for out in sent["second"]][-1] == 12  # the shared blocks, matched on digests
    assert b'"event_log_content":"hashed"' in data  # the mode is in the header's config
    assert replay_main(["--verify", path]) == 0
    assert "OK" in capsys.readouterr().out


@pytest.mark.parametrize("content", ["tokens", "hashed"])
def test_log_files_are_private(tmp_path, content):
    _, path, _ = _run(tmp_path / "a" / "b", content)  # parents the engine creates
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o600
    for directory in (Path(path).parent, tmp_path / "a" / "b"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_hashed_runs_of_the_same_traffic_diff_clean(tmp_path):
    """Each run has its own key: digests, block hashes and state digests differ, and `--diff`
    compares them by which equals which."""
    _, first, _ = _run(tmp_path / "1", "hashed")
    _, again, _ = _run(tmp_path / "2", "hashed")
    assert Path(first).read_bytes() != Path(again).read_bytes()
    assert diff_logs(first, again).same
    _, other, _ = _run(tmp_path / "3", "hashed", second=[70001 + i for i in range(len(SHARED))])
    found = diff_logs(first, other)
    assert not found.same and isinstance(found.decision[0].event, (ev.StepPlan, ev.PrefixCached))
    assert replay_main(["--diff", again, first]) == 0
