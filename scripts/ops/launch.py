#!/usr/bin/env python3
"""Start the ledgerserve process group: same as `ledgerserve serve`."""

import sys

from ledgerserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
