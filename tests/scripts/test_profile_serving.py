"""profile_serving's flags: a run without spans has no timeline to draw, and says so."""

from __future__ import annotations

import pytest

from scripts.serving.profile_serving import parse_args


def test_no_spans_runs_a_plain_server_and_refuses_a_plot(capsys) -> None:
    args = parse_args(["--no-spans", "--quick"])
    assert args.no_spans and (args.input_len, args.output_len) == (64, 16)
    assert not parse_args([]).no_spans  # the profile is the default
    with pytest.raises(SystemExit):
        parse_args(["--no-spans", "--plot", "t.png"])
    assert "--plot draws the spans" in capsys.readouterr().err
