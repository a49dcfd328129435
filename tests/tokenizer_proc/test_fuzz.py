"""Schemathesis against the app's own OpenAPI schema, in process, with the fake engine:
valid and invalid bodies for every POST route; no response may be a 5xx.

max_examples=150 per route and generation phase (schemathesis also runs its explicit-example
and coverage phases), so well over 500 cases in all; derandomized, so CI runs are reproducible.
"""

from __future__ import annotations

from collections import Counter

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from shared.config import EngineConfig
from tests.tokenizer_proc.fake_engine import FakeEngine
from tokenizer_proc.app import build_app

EXAMPLES_PER_ROUTE = 150
POST_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
CASES: Counter[str] = Counter()
STATUSES: Counter[int] = Counter()


@pytest.fixture(scope="module")
def fuzz_schema(tokenizer, demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    allowed = tmp_path_factory.mktemp("adapters")
    config = EngineConfig(model_dir=demo_model_dir, served_model_name="demo", max_model_len=64,
                          enable_lora=True, lora_allowed_dirs=(str(allowed),))
    engine = FakeEngine()
    engine.encode_events = True
    app = build_app(engine, tokenizer, config)
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return schema


schema = schemathesis.pytest.from_fixture("fuzz_schema").include(method="POST")


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case) -> None:
    CASES[case.path] += 1
    if isinstance(case.body, dict) and CASES[case.path] % 4 != 0:
        case.body["model"] = "demo"  # reach past the 404 to the rest of the validation
    response = case.call()
    STATUSES[response.status_code] += 1
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {response.text}"
    case.validate_response(response, checks=[not_a_server_error])


def test_fuzz_covered_every_post_route() -> None:
    if not CASES:
        pytest.skip("run together with test_no_server_errors")
    assert set(CASES) == set(POST_ROUTES), CASES
    assert sum(CASES.values()) >= 500, CASES
    print(f"fuzz cases: {dict(CASES)} total={sum(CASES.values())} statuses={dict(STATUSES)}")
