"""How the core behaves where a log's schema says an older engine behaved otherwise. Replay takes
the policy of the log's header (`Policy.for_schema`) so an old log re-derives its own decisions;
a running engine, and every test or tool that is not replaying, takes `Policy.current()`.
shared/eventlog/format.py tells each schema's format."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    # Whether adapters may load beside the running steps (CoreConfig.lora_overlap_loading then
    # says whether they do). False: slots are assigned as a step is planned, loaded in command order.
    overlap_loading: bool = True
    # With overlapped loading: a waiting request whose adapter can have no slot gets one slot drained
    # for it (drain.py). False: once it has waited lora_max_wait_steps, no adapter request behind it
    # is admitted until it has a slot.
    targeted_drain: bool = True
    # An evicted prefix namespace stays in the state (and in every StateDigest) for good, instead of
    # leaving once its version is dropped.
    keep_dropped_namespaces: bool = False
    # Every AdapterOpReplied carries the whole registry after the op (now what an op changed goes to
    # the HTTP process unlogged: views/registry_changes.py).
    op_reply_registry: bool = False
    # With overlapped loading, each StateDigest also hashes the ranks that reported each slot load in
    # flight and each CPU-tier staging (reports nothing waits on, whose timing differs between runs).
    digest_load_reports: bool = False

    @staticmethod
    def current() -> Policy:
        """Today's engine."""
        return Policy()

    @staticmethod
    def for_schema(version: int) -> Policy:
        """The engine that wrote a log of this schema version: the one place that maps versions to
        behaviours."""
        return Policy(
            overlap_loading=version >= 3,  # schema 1 and 2 engines loaded every adapter in command order
            targeted_drain=version >= 4,  # schema 3 engines barred requests behind an aged one instead
            keep_dropped_namespaces=version < 2,  # schema 1 engines never forgot an evicted namespace
            op_reply_registry=version < 5,  # schema 4 and older engines sent the registry with each reply
            digest_load_reports=version < 6,  # schema 5 and older engines hashed the ranks' load reports
        )
