"""Read models folded from the event stream: per-adapter figures (adapter_stats), the engine's
gauges (engine_stats) and what an input changed in the adapter registry (registry_changes).
Used by the shell, replay and tests, never by the core: each reads the core's state or the
logged records after the fact and decides nothing, so none of it is logged."""
