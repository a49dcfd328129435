"""Request fields this server knows but does not implement, and what a field it does not know gets.

Every field of a completions or chat request is either implemented (declared on the request
models in protocol.py) or refused with a 400 naming it. A known-but-unsupported field is
accepted only with a value that asks for nothing, the value it has when left out
(`tools: null`, `tool_choice: "none"`, `response_format: {"type": "text"}`, `store: false`).
"""

from __future__ import annotations

import json
from typing import Any

NOT_SUPPORTED: dict[str, tuple[Any, ...]] = {  # field -> the values that ask for nothing
    # tool calling and structured output
    "tools": (None,),
    "tool_choice": (None, "none"),
    "functions": (None,),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "structured_outputs": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    # outputs
    "echo": (None, False),
    "suffix": (None, ""),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "return_tokens_as_token_ids": (None, False),
    "include_stop_str_in_output": (None, False),
    "spaces_between_special_tokens": (None, True),
    # prompt handling
    "continue_final_message": (None, False),
    "add_special_tokens": (None,),
    "truncate_prompt_tokens": (None,),
    "prompt_embeds": (None,),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
    "cache_salt": (None,),
    # decoding
    "allowed_token_ids": (None,),
    "bad_words": (None,),
    "logits_processors": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0, 1),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    # serving
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
    "priority": (None, 0),
    "request_id": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
}
MAX_SHOWN_NAME_CHARS = 64


def refusal(name: str, value: Any) -> str | None:
    """Why a field that no request model declares is refused (None: its value asks for nothing)."""
    shown = shown_name(name)
    accepted = NOT_SUPPORTED.get(name)
    if accepted is None:
        return f"`{shown}` is not a known field of this request"
    if any(type(value) is type(off) and value == off for off in accepted):  # no 0 == False, 1 == True
        return None
    allowed = [off for off in accepted if off is not None]
    hint = f" (accepted: {', '.join(json.dumps(off) for off in allowed)})" if allowed else ""
    return f"`{shown}` is not supported yet{hint}"


def shown_name(name: str) -> str:
    """A client-chosen field name, cut short for an error message."""
    return name if len(name) <= MAX_SHOWN_NAME_CHARS else name[:MAX_SHOWN_NAME_CHARS] + "..."
