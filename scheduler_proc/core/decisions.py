"""What the core decides: `Decisions`, the type of every list of decisions its functions return
(the union of shared/events.py's DECISION_TYPES: each is logged after its input, then sent)."""

from __future__ import annotations

from ledgerserve.shared import events as ev

Decisions = list[ev.Decision]
