#!/usr/bin/env python3
"""Replay and verify an event log: same as `ledgerserve replay`."""

import sys

from ledgerserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["replay", *sys.argv[1:]]))
