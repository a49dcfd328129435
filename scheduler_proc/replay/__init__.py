"""`ledgerserve replay`: re-feed a run's logged inputs into a fresh core and check every
decision (verify.py), show the state and the adapter figures where it stops (state.py,
figures.py), or compare two runs (diff.py, format.py); cli.py is the command."""

from ledgerserve.scheduler_proc.replay.cli import main
from ledgerserve.scheduler_proc.replay.verify import Divergence, HistoryTrimmed, ReplayResult, replay

__all__ = ["Divergence", "HistoryTrimmed", "ReplayResult", "main", "replay"]
