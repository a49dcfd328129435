"""`python -m ledgerserve ...` is the `ledgerserve` command."""

from ledgerserve.cli import main

main()
