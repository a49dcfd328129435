"""ledgerserve: one base model and many LoRA adapters behind an OpenAI-compatible server.

The product's packages live in the repository's top-level folders (`shared/`, `kernels/`,
`scheduler_proc/`, `tokenizer_proc/`, `worker_proc/`) and are imported as subpackages of
this one (`ledgerserve.kernels`, ...), so no generic top-level name reaches site-packages. A
wheel places those folders inside `ledgerserve/`; in a source checkout this package's search
path also covers the repository root.
"""

from pathlib import Path

_root = Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file() and (_root / "scheduler_proc").is_dir():
    __path__.append(str(_root))  # noqa: F821 - a package's __path__ is set by the import system
