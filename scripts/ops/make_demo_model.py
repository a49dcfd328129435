"""Build the demo model (a tiny Qwen3 trained on the demo corpus, and its demo adapters) and print its directory.

The build tells its progress on stderr (each stage; a training's step and loss every few seconds).

Usage: python -m scripts.ops.make_demo_model [--out DIR]
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ledgerserve.demo_model import ensure_demo_model  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=None, help="target directory (default: ~/.cache/ledgerserve/demo-RECIPE/demo-model)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    print(ensure_demo_model(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
