"""The docs stay true to the tree: BENCHMARKS.md cites exactly the reports under benchmarks/,
and docs/architecture.md names, for every decision type, the file that constructs it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from ledgerserve.shared.events import DECISION_TYPES

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
ARCHITECTURE_MD = ROOT / "docs" / "architecture.md"
CITED_PATH = re.compile(r"benchmarks/[\w./-]+")
REPORT_NAME = re.compile(r"^h[0-9]+_\d{4}-\d{2}-\d{2}_[\w.-]+$")  # GPU, date, what
DECIDER_ROW = re.compile(r"^\|\s*`(\w+)`\s*\|\s*`([\w./]+\.py)`\s*\|", re.MULTILINE)


def cited_paths(text: str) -> set[str]:
    """Every `benchmarks/...` path the text names, trailing sentence punctuation dropped."""
    return {match.rstrip(".") for match in CITED_PATH.findall(text)}


def tracked_reports() -> set[str]:
    """The files under benchmarks/ that git tracks; outside a git checkout, those on disk."""
    try:
        out = subprocess.run(["git", "ls-files", "benchmarks"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return {p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks").rglob("*") if p.is_file()}
    return set(out.stdout.split())


def deciders(text: str) -> dict[str, str]:
    """The "event -> file" table: decision type name -> the path in its row."""
    return dict(DECIDER_ROW.findall(text))


def constructs(source: str, type_name: str) -> bool:
    """`TypeName(` as a call, not as the class statement."""
    return re.search(rf"(?<!class )\b{type_name}\(", source) is not None


def test_every_path_benchmarks_md_cites_exists():
    cited = cited_paths(BENCHMARKS_MD.read_text())
    assert cited, "BENCHMARKS.md cites no report"
    for path in sorted(cited):
        target = ROOT / path
        assert target.is_dir() if path.endswith("/") else target.is_file(), (
            f"BENCHMARKS.md cites {path}, which does not exist"
        )


def test_every_report_under_benchmarks_is_cited_and_named_by_gpu_and_date():
    cited = cited_paths(BENCHMARKS_MD.read_text())
    reports = tracked_reports()
    assert reports, "no report under benchmarks/"
    assert sorted(reports - cited) == [], "reports BENCHMARKS.md does not cite"
    for path in sorted(reports):
        assert "session" not in path.lower(), path
        assert REPORT_NAME.match(Path(path).name), f"{path}: not named <gpu>_<YYYY-MM-DD>_<what>"


def test_architecture_names_the_file_that_constructs_each_decision():
    table = deciders(ARCHITECTURE_MD.read_text())
    names = [t.__name__ for t in DECISION_TYPES]
    assert sorted(set(table) - set(names)) == [], "rows for types that are not decisions"
    for name in names:
        assert name in table, f"docs/architecture.md has no row for {name}"
        path = ROOT / table[name]
        assert path.is_file(), f"{name}: {table[name]} does not exist"
        assert constructs(path.read_text(), name), f"{name}: {table[name]} does not construct it"


def test_the_checks_catch_what_they_guard():
    """The helpers see a missing row, a file that only declares the class, and an uncited path."""
    assert deciders("| `StepPlan` | `scheduler_proc/core/plan.py` | x |") == {"StepPlan": "scheduler_proc/core/plan.py"}
    assert not constructs("class StepPlan(Event):\n    step: int", "StepPlan")
    assert not constructs("isinstance(d, events.StepPlan)", "StepPlan")
    assert constructs("return ev.StepPlan(step, new_reqs)", "StepPlan")
    assert cited_paths("see `benchmarks/gpu/h100_2026-11-25_sweep.json`.") == {
        "benchmarks/gpu/h100_2026-11-25_sweep.json"
    }
    assert cited_paths("reports are in `benchmarks/gpu/`") == {"benchmarks/gpu/"}
