from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests import fresh_venv
from tests.model_factory import DENSE_ARCHS, MOE_ARCHS, make_tiny_checkpoint

FRESH_JOB = pytest.StashKey[fresh_venv.Job]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the fresh-venv job (tests/fresh_venv.py) when its test is collected: it runs beside the
    tests before it, at the lowest CPU priority."""
    if any(item.path.name == "test_fresh_install.py" for item in session.items):
        from tests.test_fresh_install import readme_install_line

        session.config.stash[FRESH_JOB] = fresh_venv.Job.start(readme_install_line())


def pytest_sessionfinish(session: pytest.Session) -> None:
    if (job := session.config.stash.get(FRESH_JOB, None)) is not None:
        job.stop()


@pytest.fixture(scope="session", params=DENSE_ARCHS)
def tiny_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """One tiny random checkpoint per dense architecture, shared by the whole session."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    path: Path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    return make_tiny_checkpoint(request.param, path)


@pytest.fixture(scope="session", params=MOE_ARCHS)
def tiny_moe_checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """One tiny random checkpoint per mixture-of-experts architecture, shared by the whole session."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo model, built once into the session's temp dir (not the user's cache)."""
    from ledgerserve.demo_model import ensure_demo_model

    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "demo-model"))


@pytest.fixture(scope="session")
def demo_home(demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A HOME whose demo-model cache is `demo_model_dir`: a server started there with no
    MODEL_DIR serves the session's demo build instead of building its own."""
    from ledgerserve.demo_model import default_cache_dir

    home = tmp_path_factory.mktemp("home")
    cached = home / Path(default_cache_dir()).relative_to(Path.home())
    cached.parent.mkdir(parents=True)
    cached.symlink_to(demo_model_dir, target_is_directory=True)
    return str(home)


@pytest.fixture(scope="session")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random llama checkpoint, for tests of adapter files against a base (read only)."""
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("base") / "llama")


@pytest.fixture(scope="session")
def base(base_dir: str):
    """The shapes of `base_dir`, as adapter validation reads them."""
    from ledgerserve.shared.adapter_format import BaseShapes

    return BaseShapes.from_hf_config(json.loads(Path(base_dir, "config.json").read_text()))
