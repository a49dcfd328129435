"""What gets installed: one top-level package, `ledgerserve`, holding the repository's product
folders as subpackages, so it sits beside Hugging Face's `kernels` (which transformers may
import) without shadowing it or being shadowed."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT_FOLDERS = ("shared", "kernels", "scheduler_proc", "tokenizer_proc", "worker_proc")


def _tracked_files(pattern: str = "*") -> list[str]:
    out = subprocess.run(["git", "ls-files", pattern], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [path for path in out.splitlines() if (ROOT / path).is_file()]


def _top_level_imports(path: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse((ROOT / path).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_code_imports_product_folders_through_ledgerserve():
    bare = {path: sorted(_top_level_imports(path) & set(PRODUCT_FOLDERS)) for path in _tracked_files("*.py")}
    bare = {path: names for path, names in bare.items() if names}
    assert not bare, f"import these as ledgerserve.<name>: {bare}"


def test_pyproject_lists_every_product_package():
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"ledgerserve"}
    for folder in ("ledgerserve", *PRODUCT_FOLDERS):
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT).parts
            found.add(".".join(parts if parts[0] == "ledgerserve" else ("ledgerserve", *parts)))
    assert listed == found


CHECK_BOTH = """
import sys, kernels, ledgerserve, ledgerserve.kernels.ops, ledgerserve.shared.events, ledgerserve.cli
target = sys.argv[1]
assert ledgerserve.__file__.startswith(target), ledgerserve.__file__
assert not kernels.__file__.startswith(target), kernels.__file__
assert callable(kernels.get_kernel), "Hugging Face's kernels package"
assert ledgerserve.kernels.ops.__name__ == "ledgerserve.kernels.ops"
print("ok")
"""


def test_installed_wheel_sits_beside_hugging_face_kernels(tmp_path: Path):
    source, wheel_dir, target = tmp_path / "source", tmp_path / "wheel", tmp_path / "site"
    for path in _tracked_files():  # a copy: building writes build/ beside the sources
        (source / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, source / path)
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    clean_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the checkout's folders stay off the path
    subprocess.run(
        [*pip, "wheel", str(source), "--no-deps", "--no-build-isolation", "-w", str(wheel_dir)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
        env=clean_env,
    )
    (wheel,) = wheel_dir.glob("ledgerserve-*.whl")
    subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
        env=clean_env,
    )
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info") and p.name != "bin") == [
        "ledgerserve"
    ]
    env = clean_env | {"PYTHONPATH": str(target)}
    done = subprocess.run(
        [sys.executable, "-c", CHECK_BOTH, str(target)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
