"""The in-process engine (ledgerserve.engine) on a fake runner with no model (the HTTP tests' echo
runner): the runner gets the core's commands in the order decided, the results go back into the
core, its log verifies with replay, and finish reasons and adapter ops are the core's."""

from __future__ import annotations

from pathlib import Path

from ledgerserve.engine import Engine
from ledgerserve.scheduler_proc.ledger import TO_WORKER_TYPES
from ledgerserve.scheduler_proc.replay import main as replay_main
from ledgerserve.scheduler_proc.replay import replay
from ledgerserve.scheduler_proc.views.engine_stats import engine_stats
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.sampling import SamplingParams
from tests.tokenizer_proc.fake_engine import EchoRunner

PROMPT = [5, 6, 7, 8, 9]


class RecordingRunner(EchoRunner):
    """The echo runner, recording every command it carries out."""

    def __init__(self) -> None:
        super().__init__(num_kv_blocks=64)
        self.commands: list[ev.Event] = []

    def execute(self, plan: ev.StepPlan) -> tuple[ev.StepCompleted, ev.RankDigest]:
        self.commands.append(plan)
        return super().execute(plan)

    def command(self, cmd: ev.Event, arrival_s: float) -> list[ev.Event]:
        self.commands.append(cmd)
        return super().command(cmd, arrival_s)


def _engine(log_dir: str = "") -> tuple[Engine, RecordingRunner]:
    config = EngineConfig(model_dir="", served_model_name="fake", max_model_len=256, block_size=4, enable_lora=True)
    runner = RecordingRunner()
    return Engine(config, runner, log_dir), runner


def _load(engine: Engine, name: str, op_id: str, inplace: bool = False) -> ev.AdapterOpReplied:
    decisions = engine.apply(ev.AdapterLoadRequested(op_id, name, f"/adapters/{name}", 8, 1000, inplace))
    return next(d for d in decisions if isinstance(d, ev.AdapterOpReplied))


def _unload(engine: Engine, name: str, op_id: str) -> ev.AdapterOpReplied:
    decisions = engine.apply(ev.AdapterUnloadRequested(op_id, name))
    return next(d for d in decisions if isinstance(d, ev.AdapterOpReplied))


def _arrive(engine: Engine, req_id: str, lora: str | None = None, **sampling: object) -> list[ev.Event]:
    return engine.apply(ev.RequestArrived(req_id, PROMPT, SamplingParams(**sampling), lora_name=lora))  # type: ignore[arg-type]


def test_a_step_carries_out_the_commands_in_order_then_feeds_its_results_back() -> None:
    engine, runner = _engine()
    assert _load(engine, "a", "op-1").code == 200
    _arrive(engine, "r1", "a", max_tokens=2)
    _arrive(engine, "r2", max_tokens=3)
    assert runner.commands == []  # decided, not carried out before a step
    before = list(engine.commands)
    assert [type(c) for c in before] == [ev.AdapterPrefetched, ev.AdapterSlotAssigned, ev.StepPlan]
    assert [r.req_id for r in before[-1].new_reqs] == ["r2"]  # r2 runs while r1's adapter loads
    first = engine.step()
    assert runner.commands == before
    # the load replies and step 1's tokens went back into the core, which planned step 2 with r1
    assert [d.req_id for d in first if isinstance(d, ev.TokensEmitted)] == ["r2"]
    plan = next(d for d in first if isinstance(d, ev.StepPlan))
    assert plan.step == 2 and [r.req_id for r in plan.new_reqs] == ["r1"] and list(engine.commands) == [plan]
    rest = engine.run_until_idle()
    assert runner.commands[len(before) :] == [d for d in first + rest if isinstance(d, TO_WORKER_TYPES)]
    assert not engine.has_work() and not engine.core.has_unfinished()


def test_requests_finish_with_the_cores_reason() -> None:
    engine, _ = _engine()
    _arrive(engine, "long", max_tokens=3)
    _arrive(engine, "stops", max_tokens=8, stop_token_ids=(PROMPT[2],))  # the runner echoes 5, 6, 7, ...
    decisions = engine.run_until_idle()
    outputs: dict[str, list[int]] = {}
    for d in decisions:
        if isinstance(d, ev.TokensEmitted):
            outputs.setdefault(d.req_id, []).extend(d.new_token_ids)
    assert outputs == {"long": PROMPT[:3], "stops": PROMPT[:3]}
    finished = sorted((d.req_id, d.finish_reason) for d in decisions if isinstance(d, ev.RequestFinished))
    assert finished == [("long", "length"), ("stops", "stop")]
    last = [d for d in decisions if isinstance(d, ev.TokensEmitted) and d.req_id == "stops"][-1]
    assert last.finish_reason == "stop" and last.stop_token_id == PROMPT[2]
    engine.core.check_integrity()
    stats = engine_stats(engine.core)
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_total_blocks


def test_adapter_ops_are_the_cores() -> None:
    engine, runner = _engine()
    assert _load(engine, "a", "op-1").code == 200
    assert _load(engine, "a", "op-2").code == 400  # already loaded, not in place
    assert _load(engine, "a", "op-3", inplace=True).version_id == 2
    _arrive(engine, "on-a", "a", max_tokens=2)
    decisions = engine.run_until_idle()
    assert [d.finish_reason for d in decisions if isinstance(d, ev.TokensEmitted)][-1] == "length"
    assert _unload(engine, "a", "op-4").code == 200
    assert _unload(engine, "a", "op-5").code == 404
    rejected = [d for d in _arrive(engine, "late", "a", max_tokens=2) if isinstance(d, ev.RequestRejected)]
    assert [(r.code, r.param) for r in rejected] == [(404, "model")]
    engine.run_until_idle()  # the eviction the unload decided reaches the runner
    assert engine.core.adapters.infos() == [] and ev.AdapterEvicted(0, 2) in runner.commands


def test_its_log_verifies_with_replay(tmp_path: Path) -> None:
    engine, _ = _engine(str(tmp_path))
    _load(engine, "a", "op-1")
    _arrive(engine, "r1", "a", max_tokens=4)
    _arrive(engine, "r2", max_tokens=6, logprobs=1)
    engine.run_until_idle()
    engine.apply(ev.RequestAborted("never-seen"))
    _unload(engine, "a", "op-2")
    assert engine.log is not None
    path = engine.log.path
    engine.close()
    result = replay(path)
    assert result.ok and not result.truncated_tail, result.divergence and result.divergence.describe()
    assert result.num_decisions > 10 and result.core.step == engine.core.step
    assert result.closed is not None and result.closed.reason == "stopped"
    assert replay_main([path, "--verify"]) == 0
