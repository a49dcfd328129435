"""Finish reasons: EOS, ignore_eos, min_tokens, stop_token_ids, max_tokens, max_model_len."""

from ledgerserve.shared import events as ev
from tests.scheduler_proc.driver import EOS, Driver


def _run(tokens, max_model_len=256, prompt=3, **sampling):
    d = Driver(max_model_len=max_model_len)
    d.arrive("a", prompt, **sampling)
    d.script("a", tokens)
    d.run()
    return d


def test_eos_stops():
    d = _run([5, EOS, 6], max_tokens=10)
    assert d.outputs["a"] == [5, EOS]
    last = d.emitted[-1]
    assert (last.finish_reason, last.stop_token_id, last.num_prompt_tokens) == ("stop", EOS, 3)
    assert d.of_type(ev.RequestFinished) == [ev.RequestFinished("a", "stop", 2)]


def test_ignore_eos_runs_to_length():
    d = _run([EOS, EOS, EOS], max_tokens=3, ignore_eos=True)
    assert d.outputs["a"] == [EOS, EOS, EOS] and d.finish_reasons["a"] == "length"
    assert d.emitted[-1].stop_token_id is None


def test_min_tokens_defers_eos_and_stop_ids():
    d = _run([EOS, 9, 5, EOS], max_tokens=10, min_tokens=3, stop_token_ids=(9,))
    assert d.outputs["a"] == [EOS, 9, 5, EOS] and d.finish_reasons["a"] == "stop"


def test_stop_token_id():
    d = _run([5, 9, 6], max_tokens=10, stop_token_ids=(9,))
    assert d.outputs["a"] == [5, 9]
    assert (d.emitted[-1].finish_reason, d.emitted[-1].stop_token_id) == ("stop", 9)


def test_stop_beats_length_on_the_same_token():
    d = _run([5, EOS], max_tokens=2)
    assert d.finish_reasons["a"] == "stop"


def test_max_tokens_is_length():
    d = _run([], max_tokens=4)
    assert d.outputs["a"] == [7, 7, 7, 7] and d.finish_reasons["a"] == "length"


def test_max_model_len_is_length():
    d = _run([], max_model_len=8, prompt=5, max_tokens=100)
    assert len(d.outputs["a"]) == 3 and d.finish_reasons["a"] == "length"


def test_one_tokens_emitted_per_step_with_logprobs_passed_through():
    d = Driver()
    d.arrive("a", 3, max_tokens=1, logprobs=1)
    lp = ev.TokenLogprobs(-0.5, [4], [-0.5])
    decisions = d.send(ev.StepCompleted(1, 0, [ev.SampledToken("a", 4, lp)]))
    assert decisions[0] == ev.TokensEmitted("a", [4], "length", [lp], num_prompt_tokens=3)
