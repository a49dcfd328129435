"""Sans-IO deterministic scheduler core (docs/architecture.md, "The core")."""

from ledgerserve.scheduler_proc.core.adapters import AdapterManager, AdapterVersion
from ledgerserve.scheduler_proc.core.block_manager import (
    BlockAccounting,
    BlockAccountingError,
    BlockManager,
    BlockPool,
    PrefixMatch,
)
from ledgerserve.scheduler_proc.core.config import CoreConfig
from ledgerserve.scheduler_proc.core.core import Core
from ledgerserve.scheduler_proc.core.radix import RadixCache, block_hash, chain_hashes, namespace_seed
from ledgerserve.scheduler_proc.core.request import IllegalTransition, Request, RequestStatus, transition
from ledgerserve.scheduler_proc.core.slots import (
    IllegalSlotTransition,
    Slot,
    SlotAction,
    SlotState,
    SlotTable,
    transition_slot,
)

__all__ = [
    "AdapterManager",
    "AdapterVersion",
    "BlockAccounting",
    "BlockAccountingError",
    "BlockManager",
    "BlockPool",
    "Core",
    "CoreConfig",
    "IllegalSlotTransition",
    "IllegalTransition",
    "PrefixMatch",
    "RadixCache",
    "Request",
    "RequestStatus",
    "Slot",
    "SlotAction",
    "SlotState",
    "SlotTable",
    "block_hash",
    "chain_hashes",
    "namespace_seed",
    "transition",
    "transition_slot",
]
