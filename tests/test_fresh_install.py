"""The README's serve command on a new user's machine: its install line, as the README gives it,
in a fresh venv (no extras, so none of the test-only packages), then `ledgerserve serve` from
that venv with a fresh HOME (the demo model built from scratch), one completion, a clean stop."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from scripts.common.server_process import free_port
from tests.readme import readme_commands

ROOT = Path(__file__).resolve().parent.parent
INSTALL_TIMEOUT_S = 1200.0
READY_TIMEOUT_S = 600.0

pytestmark = pytest.mark.slow


def _source_copy(target: Path) -> Path:
    """The checkout's files (tracked, and new ones git does not ignore): installing writes beside them."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for path in listed:
        if (ROOT / path).is_file():
            (target / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / path, target / path)
    return target


def _venv_env(venv: Path, home: Path) -> dict[str, str]:
    """This environment with the venv first on PATH, no PYTHONPATH (nothing of the checkout leaks in)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    path = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return {**env, "PATH": path, "VIRTUAL_ENV": str(venv), "HOME": str(home)}


@pytest.mark.timeout(INSTALL_TIMEOUT_S + READY_TIMEOUT_S + 120)
def test_the_readme_serve_command_works_in_a_fresh_venv(tmp_path: Path) -> None:
    command = readme_commands()[0]
    install, serve = command.split(" && ")
    assert (install, serve) == ("pip install torch==2.13.0 -e .", "ledgerserve serve"), command
    source, venv, home = _source_copy(tmp_path / "source"), tmp_path / "venv", tmp_path / "home"
    home.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = _venv_env(venv, home)
    started = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", install], cwd=source, env=env, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    install_s = time.monotonic() - started
    no_peft = subprocess.run([str(venv / "bin" / "python"), "-c", "import peft"], env=env, capture_output=True)
    assert no_peft.returncode != 0  # the check means something: the test-only packages are not there
    assert shutil.which("ledgerserve", path=env["PATH"]) == str(venv / "bin" / "ledgerserve")
    text, out = _serve_once(venv, env, tmp_path / "server.out")
    assert text.strip(), out
    assert "demo model built in" in out and "launcher INFO ready in " in out, out
    print(f"fresh venv: install {install_s:.0f} s, then {out.count('demo model')} demo-build lines")


def _serve_once(venv: Path, env: dict[str, str], out_path: Path) -> tuple[str, str]:
    """`ledgerserve serve` from the venv on a free port: wait for ready, one completion, stop."""
    port = free_port()
    with open(out_path, "wb") as out:
        server = subprocess.Popen(
            [str(venv / "bin" / "ledgerserve"), "serve", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_ready(server, port, out_path)
        body = {"model": "demo-model", "prompt": "The morning", "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
    finally:
        server.send_signal(signal.SIGTERM)
        rc = server.wait(timeout=60)
    assert rc == 0, out_path.read_text()
    return text, out_path.read_text()


def _wait_ready(server: subprocess.Popen, port: int, out_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        assert server.poll() is None, out_path.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(out_path.read_text())
