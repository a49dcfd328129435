"""Every command the README and docs/ quote in a ```bash block runs here, read out of them, unless
NOT_ON_CPU lists it with the reason: each `ledgerserve serve` starts the real server (the demo
model, with HOME holding the session's demo build and the default event-log directory) and the
curl commands after it run against it; the `ledgerserve replay` forms run on the logs those
servers wrote. Every script they name answers --help, and the command line its --help and
--version. A quoted command that stops working, or a new one nobody classified, fails here."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ledgerserve.cli import build_parser
from ledgerserve.demo_model import default_cache_dir, demo_adapters
from ledgerserve.demo_styles import PIRATE_CLOSING, POET_REFRAIN
from scripts.common.server_process import free_port
from tests.readme import README, manual_text, readme_commands

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180.0

NOT_ON_CPU = {
    "pip install torch==2.13.0 -e . && ledgerserve serve": (
        "installs into the running environment; tests/test_fresh_install.py runs it in a fresh venv, and its "
        "serve command runs here"
    ),
    "pip install torch==2.13.0 -e '.[test]' && ruff check && ruff format --check && python -m pytest -q": (
        "the CI command itself (.ci/run), which runs this test"
    ),
    "ledgerserve serve /models/base --enable-lora --lora-allowed-dir /tmp/bench-adapters &": (
        "needs a real checkpoint in /models/base (flags parsed here)"
    ),
    "python -m scripts.serving.bench_serving --base-url http://127.0.0.1:8000 --model-dir /models/base "
    "--adapter-dir /tmp/bench-adapters --num-adapters 16 --ranks 8,16,32 "
    "--popularity zipf --zipf-s 1.1 --base-share 0.2 --arrival poisson --rate 8 "
    "--num-requests 500 --input-len 512 --output-len 128 --out report.json --plot report.png": (
        "needs that server (--help here; tests/e2e/test_bench_serving_http.py runs it on the demo model)"
    ),
    "ledgerserve serve Qwen/Qwen3-0.6B --dtype bfloat16 --device cuda --port 8000": (
        "needs CUDA and the Hugging Face Hub (flags parsed here)"
    ),
    "ledgerserve serve /models/Qwen3-0.6B": "needs a real checkpoint in /models/Qwen3-0.6B (flags parsed here)",
    "ledgerserve serve meta-llama/Llama-3.1-8B-Instruct --enable-lora --lora-modules sql-lora=/adapters/sql "
    "--max-lora-rank 64 -tp 1 --max-model-len 32k --dtype half --served-model-name llama base": (
        "needs the gated model and a GPU (flags parsed here)"
    ),
}
INSTALL_THEN_SERVE = ("pip install torch==2.13.0 -e . && ledgerserve serve",)  # the serve part runs here
GPU_SCRIPTS = {
    "scripts/ops/gpu_smoke.sh": "runs the gpu tests and serves on CUDA",
    "scripts/ops/gpu_tp2.sh": "needs two GPUs",
}


def _kind(command: str) -> str:
    if command in NOT_ON_CPU:
        return "listed"
    if command.startswith("curl "):
        return "curl"
    if command.startswith("ledgerserve replay "):
        return "replay"
    if command.startswith("ledgerserve serve"):
        return "serve"
    return "unclassified"


def test_every_command_is_run_here_or_listed_with_a_reason() -> None:
    commands = readme_commands()
    assert len(commands) >= 15
    assert [c for c in commands if _kind(c) == "unclassified"] == []
    assert set(NOT_ON_CPU) <= set(commands), "NOT_ON_CPU lists a command the README no longer quotes"


def test_the_listed_serve_commands_parse() -> None:
    for command in NOT_ON_CPU:
        for part in command.split(" && "):
            words = shlex.split(part.removesuffix("&"))
            if words[:2] == ["ledgerserve", "serve"]:
                build_parser().parse_args(words[1:])  # exits on an unknown flag or a bad value


# ---- the servers, and the curl commands after each ------------------------------------------


@pytest.fixture(scope="module")
def readme_home(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A HOME whose demo cache is the session's demo build; its event logs go to the default place."""
    home = tmp_path_factory.mktemp("readme-home")
    cached = home / Path(default_cache_dir()).relative_to(Path.home())
    cached.parent.mkdir(parents=True)
    cached.symlink_to(demo_model_dir, target_is_directory=True)
    adapters = home / "adapters"  # the README's /adapters: copies of the demo adapters under its names
    for name, path in zip(("sql", "chat"), [path for _, path in demo_adapters(demo_model_dir)]):
        shutil.copytree(path, adapters / name)
    return home


def _local(command: str, home: Path, port: int | None = None) -> str:
    """The command as it runs here: this interpreter's ledgerserve and scripts, the README's
    /adapters in HOME, its port the server's."""
    command = re.sub(r"^ledgerserve ", f"{shlex.quote(sys.executable)} -m ledgerserve ", command)
    command = re.sub(r"^python ", f"{shlex.quote(sys.executable)} ", command)
    command = command.replace("/adapters", str(home / "adapters"))
    return command.replace("localhost:8000", f"127.0.0.1:{port}") if port else command


def _run(command: str, home: Path, timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(home)}
    return subprocess.run(["bash", "-c", command], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def _serve_then_curl(serve: str, curls: list[str], home: Path, out_path: Path) -> tuple[list[str], str]:
    """Start `serve` (on a free port), run each curl command against it, stop it: the curl
    outputs and the server's."""
    port = free_port()
    argv = shlex.split(_local(serve.split(" && ")[-1], home)) + ["--port", str(port)]
    with open(out_path, "wb") as out:
        server = subprocess.Popen(argv, env={**os.environ, "HOME": str(home)}, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(server, port, out_path)
        outputs = []
        for curl in curls:
            done = _run(_local(curl, home, port), home)
            assert done.returncode == 0, (curl, done.stderr)
            outputs.append(done.stdout)
    finally:
        server.send_signal(signal.SIGTERM)
        rc = server.wait(timeout=60)
    assert rc == 0, out_path.read_text()
    return outputs, out_path.read_text()


def _wait_healthy(server: subprocess.Popen, port: int, out_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, out_path.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(out_path.read_text())


@pytest.fixture(scope="module")
def sessions(readme_home: Path, tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, list[str], str]]:
    """Each `ledgerserve serve` of the README that curl commands follow, in order, run with them:
    (serve command, curl outputs, server output). The install line's serve part runs as given."""
    runs: list[tuple[str, list[str]]] = []
    for command in readme_commands():
        if command.split(" && ")[-1].startswith("ledgerserve serve"):
            runs.append((command, []))
        elif _kind(command) == "curl":
            runs[-1][1].append(command)
    results = []
    for index, (serve, curls) in enumerate(runs):
        if not curls:
            continue
        assert serve not in NOT_ON_CPU or serve in INSTALL_THEN_SERVE, f"curl commands follow an unrunnable {serve!r}"
        out_path = tmp_path_factory.mktemp("readme-server") / f"server-{index}.out"
        outputs, server_out = _serve_then_curl(serve, curls, readme_home, out_path)
        results.append((serve, outputs, server_out))
    return results


def _text_block_after_curls() -> dict[str, str]:
    """The README's `Their choices[0].text` block: model -> text."""
    text = README.read_text(encoding="utf-8")
    block = re.search(r"Their `choices\[0\]\.text`:\n\n```text\n(.*?)```", text, re.DOTALL)
    assert block is not None
    return {m.group(1): json.loads(m.group(2)) for m in re.finditer(r"^([\w-]+):\s+(\".*\")$", block.group(1), re.M)}


def _style(text: str) -> str:
    if PIRATE_CLOSING in text and POET_REFRAIN not in text:
        return "pirate"
    if POET_REFRAIN in text and PIRATE_CLOSING not in text:
        return "poet"
    return "demo-model" if PIRATE_CLOSING not in text and POET_REFRAIN not in text else "mixed"


@pytest.mark.slow
def test_the_demo_curls_answer_in_the_styles_the_readme_shows(sessions) -> None:
    serve, outputs, server_out = sessions[0]
    assert serve.endswith("&& ledgerserve serve")
    answers = {body["model"]: body["choices"][0]["text"] for body in map(json.loads, outputs)}
    assert set(answers) == {"demo-model", "pirate", "poet"}
    shown = _text_block_after_curls()
    assert set(shown) == set(answers)
    for model in answers:
        assert _style(answers[model]) == model == _style(shown[model]), (model, answers[model], shown[model])
    assert "launcher INFO ready in " in server_out
    assert "scheduler INFO engine: prompt throughput: " in server_out  # the stats line, once the engine idled


@pytest.mark.slow
def test_the_adapter_commands_load_and_use_an_adapter(sessions) -> None:
    (serve, outputs, _), *_ = [s for s in sessions if "--lora-modules sql=" in s[0]]
    load, completion = outputs
    assert load == "Success: LoRA adapter 'chat' added successfully."
    body = json.loads(completion)
    assert body["model"] == "chat" and body["usage"]["completion_tokens"] > 0


@pytest.mark.slow
def test_the_replay_commands_verify_the_servers_logs(sessions, readme_home: Path) -> None:
    logs = sorted((readme_home / ".cache" / "ledgerserve" / "events").glob("events-*.log"))
    assert len(logs) == len(sessions) >= 2
    demo_log = str(logs[0])  # the demo's run: three requests of 32 tokens, more than 40 steps
    for command in [c for c in readme_commands() if _kind(c) == "replay"]:
        local = _local(command, readme_home).replace("OTHER_LOG", demo_log).replace("LOG", demo_log)
        done = _run(local, readme_home)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        assert done.stdout.strip(), command
        if "--json" in command:
            json.loads(done.stdout)


# ---- the command line and the scripts -------------------------------------------------------


SCRIPT = re.compile(r"\bscripts[./](\w+)[./](\w+)\b")  # scripts/<shelf>/<name>.py or scripts.<shelf>.<name>


def _scripts_named() -> list[str]:
    """Every Python script of scripts/ the README and docs/ name, as `<shelf>.<name>`."""
    names = {f"{shelf}.{name}" for shelf, name in SCRIPT.findall(manual_text()) if name not in ("py", "sh")}
    return sorted(name for name in names if (ROOT / "scripts" / f"{name.replace('.', '/')}.py").is_file())


def test_every_script_the_readme_names_answers_help() -> None:
    shell = sorted(set(re.findall(r"scripts/(?:\w+/)?\w+\.sh", manual_text())))
    assert shell == sorted(GPU_SCRIPTS), "a shell script the README names is not classified"
    scripts = _scripts_named()
    assert {"serving.bench_serving", "ops.make_demo_model", "serving.load_test", "ops.tp_smoke"} <= set(scripts)
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # each is mostly importing torch: one per core
        runs = pool.map(_help, scripts)
    for name, done in zip(scripts, runs):
        assert done.returncode == 0 and "usage" in done.stdout.lower(), (name, done.stderr[-2000:])


def _help(name: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", f"scripts.{name}", "--help"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["replay", "--help"], ["--version"]])
def test_the_command_lines_help_and_version(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "ledgerserve", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip(), (argv, done.stderr)
