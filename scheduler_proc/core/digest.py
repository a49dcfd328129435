"""Canonical state encoding: the StateDigest hash and the plain-data snapshot."""

from __future__ import annotations

from typing import Any

import msgspec
import xxhash

from ledgerserve.scheduler_proc.core.adapters import AdapterManager
from ledgerserve.scheduler_proc.core.request import Request
from ledgerserve.scheduler_proc.core.scheduler import Scheduler

_encoder = msgspec.msgpack.Encoder()


def request_rows(requests: list[Request], with_in_flight: bool = False) -> list[list[Any]]:
    """One row per request; `with_in_flight` (async scheduling) adds its in-flight counts, which
    the one-step-in-flight loop leaves out so that its digests stay what older logs hold."""
    rows = []
    for req in sorted(requests, key=lambda r: (r.arrival_order, r.req_id)):
        row = [
            req.req_id,
            req.status.value,
            req.num_prompt_tokens,
            req.num_output_tokens,
            req.num_computed_tokens,
            list(req.block_ids),
            req.version_id,
            req.lora_slot,
            req.num_cached_tokens,
            req.num_shared_blocks,
        ]
        rows.append(row + [req.num_in_flight_tokens, req.num_pending_samples] if with_in_flight else row)
    return rows


def state_rows(
    step: int, scheduler: Scheduler, requests: list[Request], adapters: AdapterManager, with_in_flight: bool = False
) -> list[Any]:
    """The canonical encoding the StateDigest hashes: O(live state), not O(history)."""
    return [
        step,
        [req.req_id for req in scheduler.waiting],
        [req.req_id for req in scheduler.running],
        request_rows(requests, with_in_flight),
        _free_rows(scheduler),
        adapters.rows(),
        scheduler.block_manager.cache.rows() if scheduler.is_ready else [],
    ]


def encode_rows(rows: list[Any]) -> bytes:
    return _encoder.encode(rows)


def state_digest(rows: list[Any]) -> int:
    return xxhash.xxh64_intdigest(encode_rows(rows))


def _free_rows(scheduler: Scheduler) -> list[int]:
    """Which blocks are free, in O(1): their count and membership hash."""
    if not scheduler.is_ready:
        return []
    pool = scheduler.block_manager.pool
    return [pool.num_free, pool.free_membership]


def snapshot(
    step: int, in_flight_steps: list[int], scheduler: Scheduler, requests: list[Request], adapters: AdapterManager
) -> dict[str, Any]:
    ready = scheduler.is_ready
    return {
        "step": step,
        "in_flight_step": in_flight_steps[0] if in_flight_steps else None,  # the oldest
        "in_flight_steps": in_flight_steps,
        "num_total_blocks": scheduler.block_manager.num_total_blocks if ready else None,
        "num_free_blocks": scheduler.block_manager.num_free_blocks if ready else None,
        "waiting": [req.req_id for req in scheduler.waiting],
        "running": [req.req_id for req in scheduler.running],
        "requests": [
            {
                "req_id": req.req_id,
                "status": req.status.name,
                "lora_name": req.lora_name,
                "version_id": req.version_id,
                "lora_slot": req.lora_slot,
                "num_prompt_tokens": req.num_prompt_tokens,
                "num_output_tokens": req.num_output_tokens,
                "num_computed_tokens": req.num_computed_tokens,
                "num_in_flight_tokens": req.num_in_flight_tokens,
                "num_pending_samples": req.num_pending_samples,
                "num_cached_tokens": req.num_cached_tokens,
                "num_preemptions": req.num_preemptions,
                "block_ids": list(req.block_ids),
            }
            for req in sorted(requests, key=lambda r: (r.arrival_order, r.req_id))
        ],
        "free_block_ids": list(scheduler.block_manager.pool.free_block_ids) if ready else [],
        "adapters": adapters.snapshot(),
        "prefix_cache": prefix_snapshot(scheduler) if ready else None,
    }


def prefix_snapshot(scheduler: Scheduler) -> dict[str, Any]:
    manager = scheduler.block_manager
    accounting = manager.block_accounting()
    return {
        "num_cached_blocks": accounting.num_cached,
        "num_locked_blocks": accounting.num_locked,
        "namespaces": [{"namespace": ns, "num_blocks": n} for ns, n in manager.namespace_block_counts()],
        "evicted_namespaces": sorted(manager.cache.evicted_namespaces),
    }
