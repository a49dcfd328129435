"""A chat-template render process (render_pool.py starts it): `python -m
ledgerserve.tokenizer_proc.render_worker`, frames on stdin and stdout.

The first frame is the RenderSetup (the template source and special tokens); the worker compiles
the template and answers an empty RenderReply when ready. Each later frame is a RenderRequest,
answered with the text or the ChatTemplateError's message. The parent kills the worker at a
render's deadline; should the parent be gone, the worker still ends: SIGALRM (whose default
action ends the process) fires WORKER_GRACE_S after the deadline, and the end of stdin ends the
loop. Memory is capped at WORKER_MEMORY_BYTES, so a template building a huge string gets a
MemoryError, answered like any other template error.
"""

from __future__ import annotations

import resource
import signal
import sys

import msgspec

from ledgerserve.tokenizer_proc.chat_template import ChatTemplate, ChatTemplateError
from ledgerserve.tokenizer_proc.render_pool import (
    WORKER_GRACE_S,
    WORKER_MEMORY_BYTES,
    RenderReply,
    RenderRequest,
    RenderSetup,
    read_frame,
    write_frame,
)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's to handle
    _cap_memory()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    frame = read_frame(stdin)
    if frame is None:
        return 0
    setup = msgspec.msgpack.decode(frame, type=RenderSetup)
    template = ChatTemplate(setup.source, setup.bos_token, setup.eos_token)
    write_frame(stdout, msgspec.msgpack.encode(RenderReply()))
    while (frame := read_frame(stdin)) is not None:
        request = msgspec.msgpack.decode(frame, type=RenderRequest)
        write_frame(stdout, msgspec.msgpack.encode(render(template, request)))
    return 0


def render(template: ChatTemplate, request: RenderRequest) -> RenderReply:
    signal.setitimer(signal.ITIMER_REAL, request.max_seconds + WORKER_GRACE_S)
    try:
        text = template.render(
            request.messages, request.add_generation_prompt, request.extra, request.max_chars, request.max_seconds
        )
        return RenderReply(text=text)
    except ChatTemplateError as exc:
        return RenderReply(error=str(exc))
    except MemoryError:
        return RenderReply(error="chat template failed: it ran out of memory")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _cap_memory() -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = WORKER_MEMORY_BYTES if hard == resource.RLIM_INFINITY else min(hard, WORKER_MEMORY_BYTES)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


if __name__ == "__main__":
    raise SystemExit(main())
