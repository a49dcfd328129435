"""The fresh venv of tests/test_fresh_install.py: a copy of the checkout, `python -m venv`, the
README's install line run in it, then `ledgerserve serve` from that venv in a fresh HOME (the demo
model built from scratch), one completion, a clean stop.

That is minutes of mostly single-core work, so it runs as a background job (`start_job`), started when
the session has collected the test and run at the lowest CPU priority: it takes the core the other
tests leave idle, and the test waits for its facts (`result.json`) and checks them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from tests.background_job import ROOT, BackgroundJob

INSTALL_TIMEOUT_S = 1200.0
READY_TIMEOUT_S = 600.0
TAIL_CHARS = 3000


def source_copy(target: Path) -> Path:
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


def venv_env(venv: Path, home: Path) -> dict[str, str]:
    """This environment with the venv first on PATH, no PYTHONPATH (nothing of the checkout leaks in)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    path = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return {**env, "PATH": path, "VIRTUAL_ENV": str(venv), "HOME": str(home)}


@dataclass
class Install:
    """The venv under `root` and `install` (a shell line) run in a copy of the checkout."""

    install: str
    root: Path

    @property
    def source(self) -> Path:
        return self.root / "source"

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def home(self) -> Path:
        return self.root / "home"

    def env(self) -> dict[str, str]:
        return venv_env(self.venv, self.home)

    def run(self, timeout_s: float) -> tuple[subprocess.CompletedProcess, float]:
        """(the install line's run, seconds it took)."""
        source_copy(self.source)
        self.home.mkdir()
        subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True, timeout=300)
        started = time.monotonic()
        done = subprocess.run(
            ["bash", "-c", self.install],
            cwd=self.source,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        return done, time.monotonic() - started


@dataclass
class Facts:
    """What the job saw, for the test to check. Empty fields: the job stopped before that step."""

    install_rc: int
    install_tail: str  # the install line's stdout and stderr, last TAIL_CHARS of each
    install_s: float
    peft_import_rc: int = 0
    ledgerserve_path: str = ""  # `which ledgerserve` in the venv's environment
    status_code: int = 0  # the completion's
    text: str = ""  # the completion's text, or its error body
    server_rc: int | None = None
    server_output: str = ""


def run_job(root: Path, install_line: str) -> Facts:
    install = Install(install_line, root)
    done, install_s = install.run(INSTALL_TIMEOUT_S)
    facts = Facts(done.returncode, done.stdout[-TAIL_CHARS:] + done.stderr[-TAIL_CHARS:], install_s)
    if done.returncode != 0:
        return facts
    env = install.env()
    python = str(install.venv / "bin" / "python")
    facts.peft_import_rc = subprocess.run([python, "-c", "import peft"], env=env, capture_output=True).returncode
    facts.ledgerserve_path = shutil.which("ledgerserve", path=env["PATH"]) or ""
    _serve_once(install, facts)
    return facts


def _serve_once(install: Install, facts: Facts) -> None:
    """`ledgerserve serve` from the venv on a free port: wait for ready, one completion, stop."""
    from scripts.common.server_process import free_port

    port, out_path = free_port(), install.root / "server.out"
    with open(out_path, "wb") as out:
        command = [str(install.venv / "bin" / "ledgerserve"), "serve", "--port", str(port)]
        server = subprocess.Popen(command, env=install.env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        if _wait_ready(server, port):
            body = {"model": "demo-model", "prompt": "The morning", "max_tokens": 8, "temperature": 0}
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
            facts.status_code = r.status_code
            facts.text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
    finally:
        server.send_signal(signal.SIGTERM)
        facts.server_rc = server.wait(timeout=60)
        facts.server_output = out_path.read_text()


def _wait_ready(server: subprocess.Popen, port: int) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def start_job(install_line: str) -> BackgroundJob:
    """`run_job` in the background (tests/background_job.py), at the lowest CPU priority."""
    return BackgroundJob.run("ls-fresh-", ["nice", "-n", "19", sys.executable, "-m", "tests.fresh_venv", install_line])


def job_facts(job: BackgroundJob, timeout_s: float) -> Facts:
    """Wait for the job; its facts, or AssertionError with its output if it wrote none."""
    job.wait(timeout_s)
    result = job.root / "result.json"
    assert result.exists(), (job.root / "job.out").read_text()[-2 * TAIL_CHARS :]
    return Facts(**json.loads(result.read_text()))


def main() -> None:
    install_line, root = sys.argv[1], Path(sys.argv[2])
    facts = run_job(root, install_line)
    partial = root / "result.json.partial"
    partial.write_text(json.dumps(asdict(facts)))
    partial.rename(root / "result.json")


if __name__ == "__main__":
    main()
