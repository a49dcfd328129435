from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(demo_model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine():
    from tests.tokenizer_proc.fake_engine import FakeEngine

    return FakeEngine()


@pytest.fixture
async def client(engine, tokenizer, demo_model_dir: str):
    """The in-process app on `engine` (a module may define its own `client` with other settings)."""
    from tests.tokenizer_proc.app_client import app_client

    async with app_client(engine, tokenizer, demo_model_dir) as c:
        yield c
