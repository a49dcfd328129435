"""The fresh venv of tests/test_fresh_install.py, installed in the background: the README's install
line takes a minute or two (torch and triton), so tests/conftest.py starts it as soon as the session
has collected that test, and the test waits for it when its turn comes. Nothing else uses it."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


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
    """`python -m venv` then `install` (a shell line) run in a copy of the checkout, in the background."""

    install: str
    root: Path
    proc: subprocess.Popen | None = None
    started_s: float = 0.0
    ended_s: float = 0.0

    @property
    def source(self) -> Path:
        return self.root / "source"

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def log(self) -> Path:
        return self.root / "install.out"

    def env(self) -> dict[str, str]:
        return venv_env(self.venv, self.home)

    def start(self) -> Install:
        source_copy(self.source)
        self.home.mkdir()
        script = f"{shlex.quote(sys.executable)} -m venv {shlex.quote(str(self.venv))} && {self.install}"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                ["bash", "-c", script], cwd=self.source, env=self.env(), stdout=out, stderr=subprocess.STDOUT
            )
        self.started_s = time.monotonic()
        return self

    def wait(self, timeout_s: float) -> tuple[int, str, float]:
        """(exit code, its output, seconds it ran)."""
        assert self.proc is not None
        rc = self.proc.wait(timeout=timeout_s)
        self.ended_s = self.ended_s or time.monotonic()
        return rc, self.log.read_text(errors="replace"), self.ended_s - self.started_s

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


_started: Install | None = None


def start(install: str) -> Install:
    """Begin the install (once per session)."""
    global _started
    if _started is None:
        _started = Install(install, Path(tempfile.mkdtemp(prefix="ledgerserve-fresh-venv-"))).start()
    return _started


def started() -> Install | None:
    return _started


def stop() -> None:
    if _started is not None:
        _started.stop()
