"""A command the session runs beside the tests (tests/conftest.py starts them at collection):
its own process session, its files under a temporary `root` (its output in root/job.out), ended
and removed when the session finishes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAIL_CHARS = 6000


@dataclass
class BackgroundJob:
    root: Path
    proc: subprocess.Popen

    @classmethod
    def run(cls, prefix: str, command: list[str]) -> BackgroundJob:
        """Start `command(root)` in the repository root; `command` gets the job's root directory."""
        root = Path(tempfile.mkdtemp(prefix=prefix))
        log = open(root / "job.out", "wb")  # noqa: SIM115 - the child holds it; closed when the job ends
        proc = subprocess.Popen(
            [*command, str(root)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        return cls(root, proc)

    def wait(self, timeout_s: float) -> None:
        """Wait for the job; AssertionError with the end of its output if it failed."""
        rc = self.proc.wait(timeout=timeout_s)
        assert rc == 0, (self.root / "job.out").read_text()[-TAIL_CHARS:]

    def stop(self) -> None:
        """End the job's processes (if still running) and remove its files."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
