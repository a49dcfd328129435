"""The README's serve command on a new user's machine: its install line, as the README gives it,
in a fresh venv (no extras, so none of the test-only packages), then `ledgerserve serve` from that
venv with a fresh HOME (the demo model built from scratch), one completion, a clean stop. The
build there, in another environment without PEFT, must match the session's byte for byte.

The steps run as a background job the session starts once it has collected this test
(tests/fresh_venv.py, tests/conftest.py); this test waits for the job's facts and checks them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from ledgerserve.demo_model import DEMO_MODEL_NAME, recipe_digest
from tests import fresh_venv
from tests.background_job import BackgroundJob
from tests.readme import readme_commands

pytestmark = pytest.mark.slow
JOB_TIMEOUT_S = fresh_venv.INSTALL_TIMEOUT_S + fresh_venv.READY_TIMEOUT_S + 120


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


@pytest.fixture
def fresh_job(request: pytest.FixtureRequest):
    """The session's job (started at collection), or one started now."""
    from tests.conftest import FRESH_JOB

    job = request.config.stash.get(FRESH_JOB, None)
    if job is not None:
        yield job  # the session stops it
        return
    job = fresh_venv.start_job(readme_install_line())
    yield job
    job.stop()


@pytest.mark.timeout(JOB_TIMEOUT_S + 60)
def test_the_readme_serve_command_works_in_a_fresh_venv(demo_model_dir: str, fresh_job: BackgroundJob) -> None:
    readme_install_line()
    facts = fresh_venv.job_facts(fresh_job, JOB_TIMEOUT_S)
    assert facts.install_rc == 0, facts.install_tail
    install = fresh_venv.Install("", fresh_job.root)  # its paths
    assert facts.peft_import_rc != 0  # the check means something: the test-only packages are not there
    assert facts.ledgerserve_path == str(install.venv / "bin" / "ledgerserve")
    out = facts.server_output
    assert facts.status_code == 200 and facts.text.strip(), (facts.text, out)
    assert facts.server_rc == 0, out
    assert "demo model built in" in out and "launcher INFO ready in " in out, out
    built = install.home / ".cache" / "ledgerserve" / f"demo-{recipe_digest()}" / DEMO_MODEL_NAME
    session = _tree(Path(demo_model_dir))
    assert {"adapters/pirate/adapter_model.safetensors", "adapters/poet/adapter_config.json"} <= set(session)
    assert _tree(built) == session  # deterministic: the same files, byte for byte, built without PEFT
    print(f"fresh venv: install {facts.install_s:.0f} s, then {out.count('demo model')} demo-build lines")
