"""Sans-IO deterministic scheduler core (DESIGN.md §3, §4)."""

from scheduler_proc.core.adapters import AdapterManager, AdapterVersion
from scheduler_proc.core.block_manager import BlockAccountingError, BlockManager, BlockPool, PrefixMatch
from scheduler_proc.core.config import CoreConfig
from scheduler_proc.core.core import Core
from scheduler_proc.core.request import IllegalTransition, Request, RequestStatus, transition
from scheduler_proc.core.slots import IllegalSlotTransition, Slot, SlotState, SlotTable, transition_slot

__all__ = [
    "AdapterManager",
    "AdapterVersion",
    "IllegalSlotTransition",
    "Slot",
    "SlotState",
    "SlotTable",
    "transition_slot",
    "BlockAccountingError",
    "BlockManager",
    "BlockPool",
    "Core",
    "CoreConfig",
    "IllegalTransition",
    "PrefixMatch",
    "Request",
    "RequestStatus",
    "transition",
]
