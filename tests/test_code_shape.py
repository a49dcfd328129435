"""Small files and small functions, and one module that reads the environment: every non-test
Python file stays within MAX_FILE_LINES lines and every function within MAX_FUNCTION_LINES,
except the few listed below, each with the reason it is larger. A new exception needs a line
here; a listed one that shrank below the bound must leave the list."""

from __future__ import annotations

import ast
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_FILE_LINES = 300
MAX_FUNCTION_LINES = 50

LARGE_FILES = {
    "shared/events.py": "every message type of every channel in one place: the log's schema reads as one file",
    "scheduler_proc/core/adapters.py": "the adapter registry and its version lifecycle (pins, on-demand marks)",
    "scheduler_proc/views/adapter_stats.py": "the fold of every adapter-related event into per-adapter figures",
}
LARGE_FUNCTIONS = {
    ("kernels/paged_attention.py", "paged_decode_attention"): "a Triton kernel body: splitting it costs registers",
    ("kernels/prefill_attention.py", "_prefill_kernel"): "a Triton kernel body: splitting it costs registers",
    ("kernels/paged_attention.py", "_decode_partition_kernel"): "a Triton kernel body: splitting it costs registers",
}


def _source_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [path for path in out.split() if not path.startswith("tests/") and os.path.exists(os.path.join(ROOT, path))]


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _function_lengths(path: str) -> dict[str, int]:
    """name -> the longest function of that name in the file (methods of several classes share names)."""
    lengths: dict[str, int] = {}
    for node in ast.walk(ast.parse(_read(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lengths[node.name] = max(lengths.get(node.name, 0), node.end_lineno - node.lineno + 1)
    return lengths


def test_files_stay_small():
    sizes = {path: len(_read(path).splitlines()) for path in _source_files()}
    too_large = sorted(path for path, n in sizes.items() if n > MAX_FILE_LINES and path not in LARGE_FILES)
    assert not too_large, f"over {MAX_FILE_LINES} lines: {[(p, sizes[p]) for p in too_large]}"
    shrunk = sorted(path for path in LARGE_FILES if sizes.get(path, 0) <= MAX_FILE_LINES)
    assert not shrunk, f"no longer large (drop them from LARGE_FILES): {shrunk}"


def test_functions_stay_small():
    found: dict[tuple[str, str], int] = {}
    for path in _source_files():
        for name, n in _function_lengths(path).items():
            if n > MAX_FUNCTION_LINES:
                found[(path, name)] = n
    too_long = sorted(key for key in found if key not in LARGE_FUNCTIONS)
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {[(k, found[k]) for k in too_long]}"
    shrunk = sorted(key for key in LARGE_FUNCTIONS if key not in found)
    assert not shrunk, f"no longer long (drop them from LARGE_FUNCTIONS): {shrunk}"


PRODUCT_PACKAGES = ("ledgerserve/", "shared/", "kernels/", "tokenizer_proc/", "scheduler_proc/", "worker_proc/")
ENV_MODULE = "shared/env.py"


def test_only_one_module_reads_the_environment():
    readers = sorted(
        path
        for path in _source_files()
        if path.startswith(PRODUCT_PACKAGES)
        and path != ENV_MODULE
        and ("os.environ" in _read(path) or "getenv" in _read(path))
    )
    assert not readers, f"read environment variables through {ENV_MODULE}: {readers}"


# Non-test Python lines per package: (budget, why it is this size). A package that outgrows its
# budget raises it here with its reason; one that shrank well below it lowers it, so each budget
# stays a statement about the package, not a ceiling nobody reads.
PACKAGE_BUDGETS = {
    "ledgerserve/": (2800, "CLI, launcher and process group, the demo model's builder, the in-process engine, sim/"),
    "shared/": (
        4800,
        "every event of every channel, the codec, config and flags, the event-log format and its group commit, "
        "the serving-path profile's spans, the adapter reader with its expert forms",
    ),
    "tokenizer_proc/": (5300, "the OpenAI/vLLM HTTP surface: routes, schemas, auth, templates, metrics, mailboxes"),
    "scheduler_proc/": (5700, "the sans-IO core with adapter placement, its views, the ledger, shell and replay"),
    "worker_proc/": (
        5900,
        "models (dense and mixture-of-experts), KV cache, LoRA slots and tiers, sampling, CUDA graphs "
        "for decode and mixed steps, tensor parallelism, warm-up, step timing",
    ),
    "kernels/": (3400, "Triton kernels, each beside its torch reference; the MoE routing and grouped expert GEMMs"),
    "scripts/": (6500, "benchmarks (the serving-path profile among them) and operating tools on six shelves"),
}
MAX_BUDGET_HEADROOM = 0.08  # a budget more than 8% above its package's lines must come down


def _package_lines() -> dict[str, int]:
    lines: dict[str, int] = {}
    for path in _source_files():
        package = path.split("/")[0] + "/"
        if "/" in path:
            lines[package] = lines.get(package, 0) + len(_read(path).splitlines())
    return lines


def test_packages_stay_within_their_budgets():
    lines = _package_lines()
    unbudgeted = sorted(set(lines) - set(PACKAGE_BUDGETS) - {".ci/"})
    assert not unbudgeted, f"packages with no line budget (add one, with its reason): {unbudgeted}"
    over = {
        pkg: (n, PACKAGE_BUDGETS[pkg][0])
        for pkg, n in lines.items()
        if pkg in PACKAGE_BUDGETS and n > PACKAGE_BUDGETS[pkg][0]
    }
    assert not over, f"over budget (lines, budget): {over}; raise the budget with a reason, or shrink"
    slack = {
        pkg: (lines.get(pkg, 0), budget)
        for pkg, (budget, _) in PACKAGE_BUDGETS.items()
        if lines.get(pkg, 0) < budget * (1 - MAX_BUDGET_HEADROOM)
    }
    assert not slack, f"budgets far above their packages (lines, budget): {slack}; lower them"
