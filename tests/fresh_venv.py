"""The fresh venv of tests/test_fresh_install.py: a copy of the checkout, `python -m venv`, then the
README's install line run in it, in a fresh HOME."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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
