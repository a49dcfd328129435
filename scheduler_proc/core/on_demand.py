"""An adapter registered on demand is never lost between its resolution and its request.

The HTTP process resolves a request's adapter (loading it on demand on first use), and only
then sends the RequestArrived. In between, another on-demand load past `max_on_demand_loras`
may unregister that adapter as the least recently used idle one: no request held it yet. So a
RequestArrived naming an adapter registered on demand carries that adapter's load
(`RequestArrived.on_demand`), and when its name is no longer registered the core registers it
again, exactly as an AdapterLoadRequested marked on_demand would (its own LRU choice, or a 503
when every adapter loaded on demand is in use), and admits the request on the new version, in
one apply. Nothing is reserved, so nothing can leak when a request never comes; a log without
the field replays as before.

The name is registered afresh only when no adapter holds it. When it is registered again
already (another request, or the HTTP process, got there first), a request carrying the load of
the same files (path and SHA-256) runs on that version; a name loaded meanwhile from
other files keeps its registration, and the request meets the usual version check (404). A name
the user unloaded meanwhile is registered again by the request that named it, as any request
naming an on-demand adapter may load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ledgerserve.scheduler_proc.core import movement
from ledgerserve.scheduler_proc.core.decisions import Decisions
from ledgerserve.shared import events as ev

if TYPE_CHECKING:
    from ledgerserve.scheduler_proc.core.core import Core


def register_for_request(core: Core, event: ev.RequestArrived) -> tuple[Decisions, int | None]:
    """(decisions, version id) registering `event`'s adapter from its on-demand load; the version
    id is None, and the decisions a RequestRejected, when the core refuses the load."""
    if event.on_demand is None or event.lora_name is None:
        raise ValueError("register_for_request needs a request carrying its on-demand load")
    load = event.on_demand
    request = ev.AdapterLoadRequested(
        op_id="",
        name=event.lora_name,
        path=load.path,
        max_rank=load.max_rank,
        num_bytes=load.num_bytes,
        content_sha256=load.content_sha256,
        on_demand=True,
    )
    made = movement.on_adapter_load_requested(core, request)
    (reply,) = [d for d in made if isinstance(d, ev.AdapterOpReplied)]  # no op to answer: not a decision
    if reply.code != 200:
        return [ev.RequestRejected(event.req_id, reply.message, reply.code, "model")], None
    return [d for d in made if d is not reply], reply.version_id


def same_files(core: Core, version_id: int, event: ev.RequestArrived) -> bool:
    """Whether registered `version_id` is the adapter `event`'s on-demand load would register:
    the same directory and content (SHA-256)."""
    load = event.on_demand
    version = core.adapters.versions[version_id]
    return load is not None and (version.path, version.content_sha256) == (load.path, load.content_sha256)
