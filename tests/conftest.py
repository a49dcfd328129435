from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests import fresh_venv
from tests.background_job import BackgroundJob
from tests.demo_build import built_model_dir, start_demo_build
from tests.model_factory import DENSE_ARCHS, MOE_ARCHS, make_tiny_checkpoint

FRESH_JOB = pytest.StashKey[BackgroundJob]()
DEMO_BUILD = pytest.StashKey[BackgroundJob]()


def _needs_demo(item: pytest.Item) -> bool:
    return "demo_model_dir" in getattr(item, "fixturenames", ())


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run order, by module (its module-scoped servers start once): modules that need no demo
    model first, while the demo model builds in the background, then those that do (and the
    end-to-end ones, some of which ask for it by name), then the
    fresh-venv check (its job ran beside them all). Stable: each stage keeps pytest's order."""
    demo_modules = {item.path for item in items if _needs_demo(item) or "e2e" in item.path.parts}

    def stage(item: pytest.Item) -> int:
        return 2 if item.path.name == "test_fresh_install.py" else int(item.path in demo_modules)

    items.sort(key=stage)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the background work the collected tests wait for: the demo-model build, and the
    fresh-venv job (tests/fresh_venv.py, at the lowest CPU priority)."""
    if any(_needs_demo(item) for item in session.items):
        session.config.stash[DEMO_BUILD] = start_demo_build()
    if any(item.path.name == "test_fresh_install.py" for item in session.items):
        from tests.test_fresh_install import readme_install_line

        session.config.stash[FRESH_JOB] = fresh_venv.start_job(readme_install_line())


def pytest_sessionfinish(session: pytest.Session) -> None:
    for key in (FRESH_JOB, DEMO_BUILD):
        if (job := session.config.stash.get(key, None)) is not None:
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
def demo_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The demo model, built once for the session (not into the user's cache): by the background
    build the session started at collection, or here."""
    if (build := request.config.stash.get(DEMO_BUILD, None)) is not None:
        return built_model_dir(build)
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
