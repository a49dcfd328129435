from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> str:
    from shared.demo_model import ensure_demo_model

    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "demo-model"))
