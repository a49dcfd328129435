"""Every request field is honoured or refused: known-but-unsupported features and unknown
fields get a 400 naming them (never a silent 200), values that ask for nothing are accepted,
validation messages name the field without pydantic's union-branch labels, and logit_bias
reaches the engine. Each refusal is followed by a good request within a 1 s client timeout."""

from __future__ import annotations

import openai
import pytest

from ledgerserve.tokenizer_proc.protocol import MAX_LOGIT_BIAS
from tests.tokenizer_proc.app_client import MODEL, assert_error, assert_still_serves

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
BASE = {
    CHAT: {"model": MODEL, "messages": MESSAGES, "max_tokens": 2},
    COMPLETIONS: {"model": MODEL, "prompt": "hi", "max_tokens": 2},
}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    ("route", "field", "value"),
    [
        (CHAT, "tools", [TOOL]),
        (CHAT, "tools", "nope"),
        (CHAT, "tools", []),
        (CHAT, "tool_choice", "required"),
        (CHAT, "tool_choice", "auto"),
        (CHAT, "tool_choice", {"type": "function", "function": {"name": "f"}}),
        (CHAT, "functions", [TOOL["function"]]),
        (CHAT, "function_call", "auto"),
        (CHAT, "response_format", {"type": "json_object"}),
        (CHAT, "response_format", {"type": "yaml"}),
        (COMPLETIONS, "response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
        (COMPLETIONS, "guided_json", {"type": "object"}),
        (CHAT, "guided_regex", "[a-z]+"),
        (COMPLETIONS, "guided_choice", ["yes", "no"]),
        (CHAT, "guided_grammar", "root ::= 'a'"),
        (CHAT, "structured_outputs", {"json": {"type": "object"}}),
        (CHAT, "continue_final_message", True),
        (COMPLETIONS, "echo", True),
        (COMPLETIONS, "suffix", "tail"),
        (CHAT, "store", True),
        (CHAT, "service_tier", "priority"),
        (CHAT, "modalities", ["text", "audio"]),
        (CHAT, "reasoning_effort", "low"),
        (COMPLETIONS, "use_beam_search", True),
        (COMPLETIONS, "allowed_token_ids", [1, 2]),
        (COMPLETIONS, "include_stop_str_in_output", True),
        (COMPLETIONS, "cache_salt", "tenant-a"),
    ],
)
async def test_unsupported_field_is_refused_naming_it(client, engine, route: str, field: str, value) -> None:
    r = await client.post(route, json={**BASE[route], field: value})
    assert f"`{field}` is not supported yet" in assert_error(r, 400, field)
    assert engine.arrivals == []  # nothing reached the engine
    await assert_still_serves(client)


@pytest.mark.parametrize("route", [CHAT, COMPLETIONS])
async def test_unknown_field_is_refused_naming_it(client, route: str) -> None:
    r = await client.post(route, json={**BASE[route], "frobnicate": 1})
    assert "`frobnicate` is not a known field" in assert_error(r, 400, "frobnicate")
    r = await client.post(route, json={**BASE[route], "x" * 5000: 1})  # a huge name is cut short
    assert len(assert_error(r, 400, "x" * 64 + "...")) < 200
    body = {**BASE[route], "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert "stream_options.continuous_usage_stats" in assert_error(
        await client.post(route, json=body), 400, "stream_options"
    )
    await assert_still_serves(client)


@pytest.mark.parametrize(
    ("route", "fields"),
    [
        (
            CHAT,
            {
                "tools": None,
                "tool_choice": "none",
                "functions": None,
                "function_call": "none",
                "response_format": {"type": "text"},
                "continue_final_message": False,
                "store": False,
                "service_tier": "auto",
                "modalities": ["text"],
                "parallel_tool_calls": True,
                "prompt_logprobs": None,
                "guided_json": None,
                "structured_outputs": None,
            },
        ),
        (
            COMPLETIONS,
            {
                "echo": False,
                "suffix": "",
                "use_beam_search": False,
                "length_penalty": 1.0,
                "include_stop_str_in_output": False,
                "spaces_between_special_tokens": True,
            },
        ),
        (
            COMPLETIONS,
            {"user": "u-1", "safety_identifier": "s", "prompt_cache_key": "k", "metadata": {"team": "search"}},
        ),
    ],
)
async def test_values_that_ask_for_nothing_are_accepted(client, engine, route: str, fields: dict) -> None:
    r = await client.post(route, json={**BASE[route], **fields})
    assert r.status_code == 200, r.text
    assert engine.arrivals[0].sampling.logit_bias == ()


async def test_a_false_is_not_a_zero(client) -> None:
    """`priority: false` is not the accepted 0, nor `length_penalty: true` the accepted 1."""
    assert_error(await client.post(COMPLETIONS, json={**BASE[COMPLETIONS], "priority": False}), 400, "priority")
    assert_error(
        await client.post(COMPLETIONS, json={**BASE[COMPLETIONS], "length_penalty": True}), 400, "length_penalty"
    )
    await assert_still_serves(client)


@pytest.mark.parametrize(
    ("route", "extra", "param", "message"),
    [
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
            "messages.0.content.0: image content parts are not supported yet",
        ),
        (
            CHAT,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "text", "text": "a"}, {"type": "input_audio", "input_audio": {}}],
                    }
                ]
            },
            "messages",
            "messages.0.content.1: audio content parts are not supported yet",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": 5}]},
            "messages",
            "messages.0.content: Input should be a valid string; or Input should be a valid list",
        ),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages",
            "messages.0.content.0.text: Field required",
        ),
        (COMPLETIONS, {"prompt": [-1]}, "prompt", "prompt.0: Input should be greater than or equal to 0"),
        (COMPLETIONS, {"stop": 5}, "stop", "stop: Input should be a valid string; or Input should be a valid list"),
        (COMPLETIONS, {"logit_bias": {"5": 101}}, "logit_bias", "logit_bias.5: Input should be less than or equal"),
    ],
)
async def test_validation_messages_name_the_field(client, route: str, extra: dict, param: str, message: str) -> None:
    got = assert_error(await client.post(route, json={**BASE[route], **extra}), 400, param)
    assert got.startswith(message), got
    assert "list[" not in got and ".str" not in got and "function-" not in got
    await assert_still_serves(client)


async def test_logit_bias_reaches_the_engine(client, engine) -> None:
    bias = {"7": 10, "3": -100, "9": 0, "5": 2.5}
    r = await client.post(COMPLETIONS, json={**BASE[COMPLETIONS], "logit_bias": bias})
    assert r.status_code == 200, r.text
    assert engine.arrivals[0].sampling.logit_bias == ((3, -100.0), (5, 2.5), (7, 10.0))  # id order, no zeros


@pytest.mark.parametrize(
    "bias",
    [
        {"abc": 1},
        {"1.5": 1},
        {" 5": 1},
        {"5": 1, "05": 2},
        {"-1": 1},
        {"99999": 1},
        {"9" * 40: 1},
        {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)},
        {"5": -100.5},
        {"5": "x"},
        [],
    ],
)
async def test_bad_logit_bias_is_refused(client, bias) -> None:
    assert_error(await client.post(COMPLETIONS, json={**BASE[COMPLETIONS], "logit_bias": bias}), 400, "logit_bias")
    await assert_still_serves(client)


async def test_the_openai_client_sees_refusals_and_logit_bias(client, engine) -> None:
    async with openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=client, max_retries=0) as oai:
        with pytest.raises(openai.BadRequestError) as refused:
            await oai.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[TOOL])
        assert refused.value.param == "tools" and "not supported yet" in refused.value.message
        with pytest.raises(openai.BadRequestError) as refused:
            await oai.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"})
        assert refused.value.param == "response_format"
        done = await oai.completions.create(model=MODEL, prompt="hi", max_tokens=2, logit_bias={"11": 50})
        assert done.choices[0].finish_reason == "length"
    assert engine.arrivals[-1].sampling.logit_bias == ((11, 50.0),)
