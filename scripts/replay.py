#!/usr/bin/env python
"""Replay and verify a scheduler event log: `scripts/replay.py LOG_OR_DIR [--verify] [--show]`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scheduler_proc.replay import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
