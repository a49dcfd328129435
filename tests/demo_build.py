"""The session's demo-model build as a background job (tests/background_job.py), started once the
session has collected a test that needs it: it trains on one core while the tests that do not
need it run (tests/conftest.py runs the modules that do after the others)."""

from __future__ import annotations

import sys

from tests.background_job import BackgroundJob

BUILD_TIMEOUT_S = 900.0
_BUILD = (
    "import sys\nfrom ledgerserve.demo_model import ensure_demo_model\nensure_demo_model(sys.argv[1] + '/demo-model')\n"
)


def start_demo_build() -> BackgroundJob:
    return BackgroundJob.run("ls-demo-", [sys.executable, "-c", _BUILD])


def built_model_dir(build: BackgroundJob) -> str:
    """The model the job built; AssertionError with its output if the build failed."""
    build.wait(BUILD_TIMEOUT_S)
    return str(build.root / "demo-model")
