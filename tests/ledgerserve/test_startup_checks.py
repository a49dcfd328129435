"""What the launcher refuses before it starts any child: a port another server listens on (before
the demo build too), a start-up adapter the server would refuse, a malformed config.json, a
revision that is not a ref name, unknown --lora-modules keys; and `--version`."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from ledgerserve.cli import build_parser
from ledgerserve.cli import main as cli_main
from ledgerserve.launcher import parse_lora_module
from ledgerserve.model_source import resolve
from ledgerserve.shared.flag_values import revision_name

CHILD_LINES = ("scheduler INFO", "worker-0", "tokenizer INFO", "loaded weights", "engine ready")


def _serve(argv: list[str], home: str, tmp_path: Path, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """`ledgerserve serve ARGV` as a user runs it, with HOME at `home`."""
    env = {**os.environ, "HOME": home}
    argv = [sys.executable, "-m", "ledgerserve", "serve", *argv, "--event-log-dir", str(tmp_path / "events")]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)


def _assert_no_child_started(out: str) -> None:
    for line in CHILD_LINES:
        assert line not in out, out


@pytest.fixture
def listening() -> socket.socket:
    """A server's socket listening on a free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock


def test_a_busy_port_stops_the_start_before_the_demo_build(listening, tmp_path):
    port = listening.getsockname()[1]
    home = tmp_path / "fresh-home"  # no demo model cached: a start that got past the port would build it
    home.mkdir()
    done = _serve(["--port", str(port)], str(home), tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert f"ledgerserve: error: cannot listen on 127.0.0.1:{port}: the address is already in use" in done.stderr
    assert "demo model" not in out and not (home / ".cache").exists()
    _assert_no_child_started(out)


def test_a_busy_port_stops_the_start_before_a_model_is_read(listening, demo_model_dir, tmp_path):
    port = listening.getsockname()[1]
    done = _serve([demo_model_dir, "--port", str(port)], str(tmp_path), tmp_path)
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr
    _assert_no_child_started(done.stdout + done.stderr)


def test_a_start_up_adapter_over_the_rank_bound_stops_the_start_before_any_child(demo_home, tmp_path):
    done = _serve(["--port", "0", "--max-lora-rank", "4"], demo_home, tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    assert "ledgerserve: error: start-up adapter 'pirate' at " in done.stderr
    assert "Adapter rank r = 8 exceeds --max-lora-rank 4" in done.stderr, done.stderr
    _assert_no_child_started(out)


def test_a_broken_start_up_adapter_is_named_before_any_child(demo_model_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{")
    argv = ["serve", demo_model_dir, "--port", "0", "--device", "cpu", "--lora-modules", f"sql={broken}"]
    assert cli_main([*argv, "--event-log-dir", str(tmp_path / "events")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ledgerserve: error: start-up adapter 'sql' at {broken}: ") and "JSON" in err, err


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"architectures": ["Qwen3ForCausalLM"],\n "hidden_size": 128,', "is not valid JSON: "),
        ("[1, 2]", "must hold a JSON object, not a list"),
        ('{"architectures": ["Qwen3ForCausalLM"], "hidden_size": 128}', "has no 'num_attention_heads'"),
        ('{"architectures": ["GPT2LMHeadModel"], "n_embd": 128}', "unsupported architectures ['GPT2LMHeadModel']"),
        ('{"max_position_embeddings": [2048]}', "max_position_embeddings must be a positive integer"),
    ],
)
def test_a_malformed_config_json_is_one_clear_message(demo_model_dir, tmp_path, capsys, text, message):
    model = tmp_path / "model"
    shutil.copytree(demo_model_dir, model)
    (model / "config.json").write_text(text)
    argv = ["serve", str(model), "--port", "0", "--device", "cpu", "--event-log-dir", str(tmp_path / "events")]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("ledgerserve: error: ") and message in err[0], err
    assert "config.json" in err[0] and "Traceback" not in err[0]


@pytest.mark.parametrize("bad", ["../../..", "..", "/etc", "main/../../x", "a//b", ".git", "-x", "a b", "v1\x00"])
def test_a_revision_that_is_not_a_ref_name_is_refused(bad, tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="is not a branch, tag or commit name"):
        revision_name(bad)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="is not a branch, tag or commit name"):
        resolve("acme/tiny-chat", bad, str(tmp_path / "hub"))
    for flag in ("--revision", "--tokenizer-revision"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "acme/tiny-chat", f"{flag}={bad}"])
        assert "is not a branch, tag or commit name" in capsys.readouterr().err


@pytest.mark.parametrize("good", ["main", "v2.0", "refs/pr/1", "release_1+cu121", "a" * 40, "feature/x-y@2"])
def test_branch_tag_and_commit_names_pass(good):
    assert revision_name(good) == good
    assert build_parser().parse_args(["serve", "acme/x", "--revision", good]).revision == good


def test_lora_modules_json_refuses_unknown_keys_and_takes_vllms_base_model_name(tmp_path):
    path = str(tmp_path / "a")
    spec = {"name": "a", "path": path, "base_model_name": "meta-llama/Llama-3.1-8B", "pinned": True}
    assert parse_lora_module(json.dumps(spec)) == ("a", path, True)
    for key in ("pinnned", "base_model", "rank"):
        with pytest.raises(ValueError, match=f"unknown key '{key}'"):
            parse_lora_module(json.dumps({"name": "a", "path": path, key: True}))
    with pytest.raises(ValueError, match="base_model_name must be a string"):
        parse_lora_module(json.dumps({"name": "a", "path": path, "base_model_name": 3}))
    with pytest.raises(ValueError, match="name must be a string"):
        parse_lora_module(json.dumps({"name": ["a"], "path": path}))


@pytest.mark.parametrize("flag", ["--version", "-V", "-v"])
def test_version_prints_the_distributions_version(flag):
    done = subprocess.run([sys.executable, "-m", "ledgerserve", flag], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == metadata.version("ledgerserve") + "\n", done


def test_the_launcher_resolves_and_checks_without_importing_torch(demo_model_dir: str) -> None:
    """The launcher's work before its children start stays light: no torch (seconds of import)
    where no NVIDIA driver is installed, which is every machine this suite runs on."""
    code = (
        "import sys\n"
        "from ledgerserve import cli, launcher, startup_checks\n"
        f"args = cli.build_parser().parse_args(['serve', {demo_model_dir!r}, '--port', '0'])\n"
        "config = launcher.resolve_config(args, '/nonexistent-run-dir')\n"
        "hf = startup_checks.read_hf_config(config.model_dir)\n"
        "startup_checks.check_startup_adapters(config, startup_checks.check_model_config(config.model_dir, hf))\n"
        "print(config.device, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["cpu", "False"], done.stdout + done.stderr
