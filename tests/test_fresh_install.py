"""The README's serve command on a new user's machine: its install line, as the README gives it,
in a fresh venv (no extras, so none of the test-only packages; tests/fresh_venv.py), then
`ledgerserve serve` from that venv with a fresh HOME (the demo model built from scratch), one
completion, a clean stop. The build there, in another environment without PEFT, must match the
session's byte for byte."""

from __future__ import annotations

import hashlib
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from ledgerserve.demo_model import DEMO_MODEL_NAME, recipe_digest
from scripts.common.server_process import free_port
from tests import fresh_venv
from tests.readme import readme_commands

INSTALL_TIMEOUT_S = 1200.0
READY_TIMEOUT_S = 600.0

pytestmark = pytest.mark.slow


def readme_install_line() -> str:
    """The README's install line; its command must be exactly `install && ledgerserve serve`."""
    command = readme_commands()[0]
    install, serve = command.split(" && ")
    assert (install, serve) == ("pip install torch==2.13.0 -e .", "ledgerserve serve"), command
    return install


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


@pytest.mark.timeout(INSTALL_TIMEOUT_S + READY_TIMEOUT_S + 120)
def test_the_readme_serve_command_works_in_a_fresh_venv(demo_model_dir: str, tmp_path: Path) -> None:
    install = fresh_venv.Install(readme_install_line(), tmp_path)
    done, install_s = install.run(INSTALL_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    venv, env = install.venv, install.env()
    no_peft = subprocess.run([str(venv / "bin" / "python"), "-c", "import peft"], env=env, capture_output=True)
    assert no_peft.returncode != 0  # the check means something: the test-only packages are not there
    assert shutil.which("ledgerserve", path=env["PATH"]) == str(venv / "bin" / "ledgerserve")
    text, out = _serve_once(venv, env, install.root / "server.out")
    assert text.strip(), out
    assert "demo model built in" in out and "launcher INFO ready in " in out, out
    built = install.home / ".cache" / "ledgerserve" / f"demo-{recipe_digest()}" / DEMO_MODEL_NAME
    session = _tree(Path(demo_model_dir))
    assert {"adapters/pirate/adapter_model.safetensors", "adapters/poet/adapter_config.json"} <= set(session)
    assert _tree(built) == session  # deterministic: the same files, byte for byte, built without PEFT
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
