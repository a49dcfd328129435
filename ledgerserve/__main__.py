"""`python -m ledgerserve ...` is the `ledgerserve` command."""

from ledgerserve.cli import main

raise SystemExit(main())
