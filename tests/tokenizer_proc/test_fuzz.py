"""Property-based HTTP fuzzing, in process, with the fake engine. The property: never a 5xx,
always the OpenAI error shape or a valid response (JSON with no NaN; a stream of such events
ending in [DONE]).

1. Schemathesis against the app's own OpenAPI schema: valid and invalid bodies for every
   POST route. Cases come from schemathesis's hypothesis strategies, driven by plain
   hypothesis (not its pytest plugin, which reaches into pytest internals that change between
   releases). Each POST route gets EXAMPLES positive and EXAMPLES negative cases (the
   tokenizer-only routes TOKENIZE_EXAMPLES), derandomized, so CI runs are reproducible:
   4 routes x 2 modes x 75 + 2 x 2 x 25 = 700 cases.
2. Unicode edge cases in every text field (EDGE_EXAMPLES each, derandomized): lone
   surrogates, NUL, U+2028/2029, U+0085, combining and right-to-left marks, emoji and other
   astral characters, long strings; streamed and not.
3. Adapter configs: random values for every adapter_config.json field (the reader's own
   property-test strategies) loaded through /v1/load_lora_adapter.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from starlette.testclient import TestClient

from ledgerserve.shared.config import EngineConfig
from ledgerserve.tokenizer_proc.app import build_app
from tests.tokenizer_proc.fake_engine import FakeEngine

EXAMPLES = 75
TOKENIZE_EXAMPLES = 25  # /tokenize and /detokenize: no engine, few code paths
TOKENIZE_BODIES = ({"count", "max_model_len", "tokens", "token_strs"}, {"prompt"})  # /tokenize, /detokenize
MAX_STREAM_EVENTS = 10_000  # schemathesis stops reading a stream after 20 events by default
POST_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/tokenize",
    "/detokenize",
)


@pytest.fixture(scope="module")
def post_operations(tokenizer, demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> list:
    allowed = tmp_path_factory.mktemp("adapters")
    config = EngineConfig(
        model_dir=demo_model_dir,
        served_model_name="demo",
        max_model_len=64,
        enable_lora=True,
        lora_allowed_dirs=(str(allowed),),
    )
    engine = FakeEngine()
    engine.encode_events = True  # catch values that only fail when encoded for the engine
    schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(engine, tokenizer, config))
    schema.config.max_stream_events = MAX_STREAM_EVENTS  # read whole streams: their [DONE] is checked
    operations = [result.ok() for result in schema.get_all_operations()]
    return sorted((op for op in operations if op.method.upper() == "POST"), key=lambda op: op.path)


def _fuzz(operation, mode: GenerationMode, cases: Counter, statuses: Counter) -> None:
    examples = TOKENIZE_EXAMPLES if operation.path in ("/tokenize", "/detokenize") else EXAMPLES

    @settings(
        max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        cases[case.path] += 1
        if isinstance(case.body, dict) and cases[case.path] % 4 != 0:
            case.body["model"] = "demo"  # reach past the 404 to the rest of the validation
        response = case.call()
        statuses[response.status_code] += 1
        content_type = response.headers.get("content-type") or [""]  # schemathesis: a list per header
        assert_answer(response.status_code, content_type[0], response.text, f"{case.method} {case.path} {case.body!r}")

    run()


def test_no_server_errors_on_any_post_route(post_operations) -> None:
    cases: Counter[str] = Counter()
    statuses: Counter[int] = Counter()
    assert tuple(op.path for op in post_operations) == tuple(sorted(POST_ROUTES))
    for operation in post_operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(operation, mode, cases, statuses)
    print(f"fuzz cases: {dict(cases)} total={sum(cases.values())} statuses={dict(statuses)}")
    assert sum(cases.values()) >= 500, cases
    assert max(statuses) < 500 and statuses[200] > 0, statuses


def assert_answer(status: int, content_type: str, text: str, request: str) -> None:
    """Not a 5xx; an error in the OpenAI shape, or a valid response."""
    assert status < 500, f"{request} -> {status} {text[:500]}"
    if status >= 400:
        error = _strict_json(text)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, text[:500]
    elif content_type.startswith("text/event-stream"):
        events = [line[len("data: ") :] for line in text.split("\n\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", text[-500:]
        for event in events[:-1]:
            body = _strict_json(event)
            assert "choices" in body or set(body["error"]) == {"message", "type", "param", "code"}, event
    elif content_type.startswith("application/json"):
        body = _strict_json(text)
        assert set(body) in TOKENIZE_BODIES or body["object"] in ("text_completion", "chat.completion"), text[:500]
    else:
        assert text.startswith("Success: LoRA adapter"), text[:500]


def _strict_json(text: str) -> Any:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in a response")

    return json.loads(text, parse_constant=refuse)


EDGE_CHARS = [
    "\ud800",
    "\udbff",
    "\udc00",
    "\udfff",
    "\x00",
    "\u2028",
    "\u2029",
    "\x85",
    "\u0301",
    "\u0344",
    "\u200f",
    "\u202e",
    "\u061c",
    "\U0001f600",
    "\U0001f469\u200d\U0001f4bb",
    "\U00010348",
    "\ufeff",
    "\ufffd",
    "\n",
    "\r",
    "\\",
    '"',
    "<|im_end|>",
]
LONG_CHARS = [2_000, 70_000]  # the second is tokenized off the event loop
EDGE_EXAMPLES = 10  # per field: 18 fields x 10 = 180 cases
COMPLETION = {"model": "demo", "prompt": "hi", "max_tokens": 2}
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT_FIELDS: dict[str, tuple[str, Callable[[str], dict]]] = {
    "prompt": ("/v1/completions", lambda t: {**COMPLETION, "prompt": t}),
    "prompt list": ("/v1/completions", lambda t: {**COMPLETION, "prompt": [t]}),
    "model": ("/v1/completions", lambda t: {**COMPLETION, "model": t}),
    "stop": ("/v1/completions", lambda t: {**COMPLETION, "stop": [t]}),
    "user": ("/v1/completions", lambda t: {**COMPLETION, "user": t}),
    "lora_path": ("/v1/completions", lambda t: {**COMPLETION, "lora_path": t}),
    "metadata": ("/v1/completions", lambda t: {**COMPLETION, "metadata": {"k": t}}),
    "logit_bias key": ("/v1/completions", lambda t: {**COMPLETION, "logit_bias": {t: 1}}),
    "field name": ("/v1/completions", lambda t: {**COMPLETION, t: 1}),
    "content": ("/v1/chat/completions", lambda t: {**CHAT, "messages": [{"role": "user", "content": t}]}),
    "content part": (
        "/v1/chat/completions",
        lambda t: {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": t}]}]},
    ),
    "name": ("/v1/chat/completions", lambda t: {**CHAT, "messages": [{"role": "user", "content": "x", "name": t}]}),
    "chat model": ("/v1/chat/completions", lambda t: {**CHAT, "model": t}),
    "chat stop": ("/v1/chat/completions", lambda t: {**CHAT, "stop": t}),
    "chat_template_kwargs": ("/v1/chat/completions", lambda t: {**CHAT, "chat_template_kwargs": {"k": t, t: 1}}),
    "load lora_name": ("/v1/load_lora_adapter", lambda t: {"lora_name": t, "lora_path": "/nowhere"}),
    "load lora_path": ("/v1/load_lora_adapter", lambda t: {"lora_name": "a", "lora_path": t}),
    "unload lora_name": ("/v1/unload_lora_adapter", lambda t: {"lora_name": t}),
}


def edge_text() -> st.SearchStrategy[str]:
    short = st.lists(st.one_of(st.sampled_from(EDGE_CHARS), st.text(max_size=6)), max_size=8).map("".join)
    long = st.builds(
        lambda piece, size: (piece * size)[:size], st.sampled_from(EDGE_CHARS + ["ab "]), st.sampled_from(LONG_CHARS)
    )
    return st.one_of(short, short, long)


@pytest.fixture(scope="module")
def edge_client(tokenizer, demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    config = EngineConfig(
        model_dir=demo_model_dir,
        served_model_name="demo",
        max_model_len=64,
        enable_lora=True,
        lora_allowed_dirs=(str(tmp_path_factory.mktemp("adapters")),),
    )
    engine = FakeEngine()
    engine.encode_events = True
    return TestClient(build_app(engine, tokenizer, config), raise_server_exceptions=False)


@pytest.mark.parametrize("field", sorted(TEXT_FIELDS))
def test_unicode_edge_cases_in_every_text_field(edge_client: TestClient, field: str) -> None:
    route, body_with = TEXT_FIELDS[field]

    @settings(
        max_examples=EDGE_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(text=edge_text(), stream=st.booleans())
    def run(text: str, stream: bool) -> None:
        body = body_with(text)
        if stream and route.endswith("completions"):
            body["stream"] = True
        content = json.dumps(body).encode()  # a lone surrogate goes out escaped, as JSON allows
        response = edge_client.post(route, content=content, headers={"content-type": "application/json"})
        request = f"{route} {field}={text[:80]!r}"
        assert_answer(response.status_code, response.headers.get("content-type", ""), response.text, request)
        if not _is_utf8_text(text):  # a lone surrogate is refused, never served
            assert response.status_code == 400, request

    run()


def _is_utf8_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


ADAPTER_EXAMPLES = 60


@pytest.fixture(scope="module")
def adapter_client(tokenizer, demo_model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """An app whose allowed dir holds one good adapter of the demo model, whose config each case rewrites."""
    from tests.adapter_factory import make_peft_adapter

    root = tmp_path_factory.mktemp("fuzz-adapters")
    path = make_peft_adapter(demo_model_dir, root / "a", r=4, alpha=8, targets=["q_proj", "v_proj"])
    config = EngineConfig(
        model_dir=demo_model_dir,
        served_model_name="demo",
        max_model_len=64,
        enable_lora=True,
        max_lora_rank=16,
        lora_allowed_dirs=(str(root),),
    )
    engine = FakeEngine()
    return TestClient(build_app(engine, tokenizer, config), raise_server_exceptions=False), engine, path


def test_adapter_configs_over_http(adapter_client) -> None:
    """Random adapter configs (every field, plausible and hostile values) through
    /v1/load_lora_adapter: a 200 that registers, or a 400 in the OpenAI shape; never a 5xx,
    and the server answers a completion after each."""
    from tests.shared.test_adapter_fuzz import FIELDS, PLAUSIBLE

    client, engine, path = adapter_client
    config_path = os.path.join(path, "adapter_config.json")
    good = json.loads(open(config_path).read())
    statuses: Counter[int] = Counter()

    @settings(
        max_examples=ADAPTER_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(changes=st.fixed_dictionaries({}, optional={field: PLAUSIBLE[field] for field in FIELDS}))
    def run(changes: dict[str, Any]) -> None:
        with open(config_path, "w") as f:
            json.dump({**good, **changes}, f)
        name = f"a{sum(statuses.values())}"
        response = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        statuses[response.status_code] += 1
        assert response.status_code in (200, 400), (changes, response.status_code, response.text[:300])
        if response.status_code == 400:
            error = _strict_json(response.text)["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400, response.text
        assert (name in engine.registry) == (response.status_code == 200)
        done = client.post("/v1/completions", json=COMPLETION)
        assert done.status_code == 200, done.text[:300]

    run()
    assert statuses[200] > 0 and statuses[400] > 0, statuses
