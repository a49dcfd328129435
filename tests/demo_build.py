"""The session's demo-model build as a background process, started once the session has
collected a test that needs it: it trains on one core while the tests that do not need it run
(tests/conftest.py runs the end-to-end tests, which do, after the others)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 900.0
_BUILD = "import sys\nfrom ledgerserve.demo_model import ensure_demo_model\nensure_demo_model(sys.argv[1])\n"


@dataclass
class DemoBuild:
    root: Path
    proc: subprocess.Popen

    @property
    def model_dir(self) -> Path:
        return self.root / "demo-model"

    @classmethod
    def start(cls) -> DemoBuild:
        root = Path(tempfile.mkdtemp(prefix="ls-demo-"))
        log = open(root / "build.out", "wb")  # noqa: SIM115 - the child holds it
        command = [sys.executable, "-c", _BUILD, str(root / "demo-model")]
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        return cls(root, proc)

    def wait(self) -> str:
        """The built model's directory; AssertionError with the build's output if it failed."""
        rc = self.proc.wait(timeout=BUILD_TIMEOUT_S)
        assert rc == 0, (self.root / "build.out").read_text()[-3000:]
        return str(self.model_dir)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)
