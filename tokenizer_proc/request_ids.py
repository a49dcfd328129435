"""Request ids: the one the engine logs for a request, and the one its client sees.

The logged id is what every decision about the request carries, so it is derived from the
inputs alone and two runs of the same traffic log the same ids (`ledgerserve replay --diff`):

- with an `X-Request-Id` header H (1-128 printable ASCII characters, no space), as vLLM does:
  `cmpl-H` for a completion, `chatcmpl-H` for a chat completion. The client picked it, so it is
  also the response `id`. One whose request (or any of its choices) is still in flight gets 400;
  once that request ended, the id may be used again.
- without one: `req-N`, N counting this HTTP process's generation requests from 1 (same traffic
  in the same order, same ids). The response `id` is then `cmpl-<random hex>` (`chatcmpl-...`):
  unique across restarts, as a client storing ids expects.

A logged id starting `req-` can only come from the counter, one starting `cmpl-` or `chatcmpl-`
only from a header, so the two never collide. n > 1 or several prompts: choice i is logged as
`<id>-<i>` (fanout.choice_req_id). The response's `X-Request-Id` header carries the logged id,
for finding the request in the event log.

Adapter op ids (`/v1/load_lora_adapter`, start-up and on-demand loads, unloads) count the same
way: `lora-op-N`.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

from ledgerserve.tokenizer_proc.errors import ApiError

HEADER = "X-Request-Id"
MAX_HEADER_CHARS = 128
_HEADER_ID = re.compile(rf"[\x21-\x7e]{{1,{MAX_HEADER_CHARS}}}")
COUNTED_PREFIX = "req"


@dataclass(frozen=True)
class RequestId:
    logged: str  # the engine's request id (choice i of several: `<logged>-<i>`)
    response: str  # the response body's `id`


class Counter:
    """`<prefix>-1`, `<prefix>-2`, ... in call order."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.num_issued = 0

    def next(self) -> str:
        self.num_issued += 1
        return f"{self.prefix}-{self.num_issued}"


def check_header(value: str) -> str:
    """The header's value if it can name a request, else a 400."""
    if _HEADER_ID.fullmatch(value) is None:
        raise ApiError(
            400,
            f"The {HEADER} header must be 1 to {MAX_HEADER_CHARS} printable ASCII characters without spaces.",
            HEADER,
        )
    return value


def request_id(header: str | None, kind: str, counter: Counter) -> RequestId:
    """`kind`: the response id's prefix, `cmpl` or `chatcmpl`."""
    if header is not None:
        chosen = f"{kind}-{check_header(header)}"
        return RequestId(chosen, chosen)
    return RequestId(counter.next(), f"{kind}-{uuid.uuid4().hex}")


def refuse_in_flight(taken: list[str]) -> None:
    """400 naming the first of a request's engine ids that is still in flight (its request has not ended)."""
    if taken:
        raise ApiError(
            400,
            f"Request id `{taken[0]}` is already in flight; send another {HEADER}, or wait for that request to end.",
            HEADER,
        )
