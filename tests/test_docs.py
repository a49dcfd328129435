"""The docs stay true to the tree: README.md, docs/*.md and BENCHMARKS.md keep to their sizes,
every repository path they cite exists, every `path.py:name` citation names a def or class of
that file, BENCHMARKS.md cites exactly the reports under benchmarks/ (at most 20), and
docs/architecture.md names, for every decision type, the file that constructs it."""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

from ledgerserve.shared.events import DECISION_TYPES

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MD = ROOT / "BENCHMARKS.md"
ARCHITECTURE_MD = ROOT / "docs" / "architecture.md"
README_MD = ROOT / "README.md"
DOC_PAGES = sorted((ROOT / "docs").glob("*.md"))
MAX_LINES = {"README.md": 150, "BENCHMARKS.md": 200, "docs": 300}
MAX_REPORTS = 20
# The folders and files a citation may start with: the repository's own (not `~/.cache/...` or
# another project's `examples/...`).
TOP = (
    "ledgerserve",
    "shared",
    "tokenizer_proc",
    "scheduler_proc",
    "worker_proc",
    "kernels",
    "scripts",
    "tests",
    "docs",
    "benchmarks",
    ".ci",
)
TOP_FILES = ("README.md", "BENCHMARKS.md", "pyproject.toml")
REPO_PATH = re.compile(rf"(?<![\w./~-])((?:{'|'.join(re.escape(t) for t in TOP)})/[\w./-]*[\w/])")
LINK = re.compile(r"\]\(([^)#\s]+)\)")
SCRIPT_MODULE = re.compile(r"\bscripts((?:\.\w+)+)")  # python -m scripts.<shelf>.<name>
CITATION = re.compile(r"([\w./-]+\.py):([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")
CITED_PATH = re.compile(r"benchmarks/[\w./-]+")
REPORT_NAME = re.compile(r"^h[0-9]+_\d{4}-\d{2}-\d{2}_[\w.-]+$")  # GPU, date, what
DECIDER_ROW = re.compile(r"^\|\s*`(\w+)`\s*\|\s*`([\w./]+\.py)`\s*\|", re.MULTILINE)
PRODUCT = ("ledgerserve", "shared", "tokenizer_proc", "scheduler_proc", "worker_proc", "kernels", "scripts")
CODE_SPAN = re.compile(r"`([^`\s]+)`")
CLASS_MEMBER = re.compile(r"([A-Z]\w*\.[A-Za-z_]\w*)(?:\(.*\))?")  # `Core.apply`, `Core.apply(event)`
CLASS_NAME = re.compile(r"[A-Z][a-z]\w*")  # `RequestRun`, `StepPlan`: not `INPUT_TYPES`
BARE_FILE = re.compile(r"[\w-]+\.py")  # `plan.py`, named beside the folder it sits in


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


# ---- sizes, paths and code citations of the README, docs/ and BENCHMARKS.md -----------------


def manual() -> dict[str, str]:
    """Each page that cites the tree, by its path from the root."""
    pages = [README_MD, BENCHMARKS_MD, *DOC_PAGES]
    return {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in pages}


def cited_repo_paths(text: str, page: str) -> set[str]:
    """Every repository path the page names: `dir/...` forms, links (relative to the page) and
    `scripts.<shelf>.<name>` modules (as their file)."""
    paths = {m.rstrip(".") for m in REPO_PATH.findall(text)}
    paths |= {f"scripts{mod.replace('.', '/')}.py" for mod in SCRIPT_MODULE.findall(text) if mod.count(".") >= 2}
    base = Path(page).parent
    for link in LINK.findall(text):
        if "://" not in link:
            paths.add(os.path.normpath(base / link))
    return {p for p in paths if "*" not in p and "{" not in p}


def exists(path: str) -> bool:
    target = (ROOT / path).resolve()
    return target.exists()


def defined_names(source: str) -> set[str]:
    """`name` for every def and class anywhere in the file, and `Class.method` for each method."""
    tree = ast.parse(source)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{item.name}")
    return names


def module_names(source: str) -> set[str]:
    """The names a module binds at its top level by assignment (`ToScheduler = A | B`)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def product_files() -> list[Path]:
    return sorted(f for top in PRODUCT for f in (ROOT / top).rglob("*.py"))


def product_names(files: list[Path]) -> set[str]:
    """Every def, class, `Class.method` and top-level assigned name of the product's modules."""
    names: set[str] = set()
    for file in files:
        source = file.read_text(encoding="utf-8")
        names |= defined_names(source) | module_names(source)
    return names


def stale_bare_names(text: str, names: set[str], file_names: set[str], classes_too: bool) -> list[str]:
    """Code spans that name code without a path: `Class.method` (and, with `classes_too`, a bare
    `ClassName`) that no product module defines, and a bare `file.py` that no product folder holds."""
    stale = []
    for span in CODE_SPAN.findall(text):
        member = CLASS_MEMBER.fullmatch(span)
        if member and member[1] not in names:
            stale.append(span)
        elif classes_too and CLASS_NAME.fullmatch(span) and span not in names:
            stale.append(span)
        elif BARE_FILE.fullmatch(span) and span not in file_names:
            stale.append(span)
    return stale


def stale_citations(text: str) -> list[str]:
    """The `path.py:name` citations whose file does not exist or does not define the name."""
    stale = []
    for path, name in CITATION.findall(text):
        file = ROOT / path
        if not file.is_file() or name not in defined_names(file.read_text(encoding="utf-8")):
            stale.append(f"{path}:{name}")
    return stale


def test_pages_keep_to_their_sizes():
    for page, text in manual().items():
        limit = MAX_LINES["docs"] if page.startswith("docs/") else MAX_LINES[page]
        assert len(text.splitlines()) <= limit, f"{page}: {len(text.splitlines())} lines, at most {limit}"
    assert len(DOC_PAGES) >= 6, "docs/ lost a page"


def test_at_most_twenty_reports():
    assert len(tracked_reports()) <= MAX_REPORTS


def test_every_repository_path_cited_exists():
    missing = [f"{page}: {path}" for page, text in manual().items() for path in sorted(cited_repo_paths(text, page))]
    missing = [m for m in missing if not exists(m.split(": ", 1)[1])]
    assert missing == [], f"cited paths that do not exist: {missing}"


def test_every_code_citation_names_a_def_or_class():
    stale = [f"{page}: {c}" for page, text in manual().items() for c in stale_citations(text)]
    assert stale == [], f"citations of names their file does not define: {stale}"


def test_every_name_cited_without_a_path_exists():
    """The walk-throughs name methods as `Class.method` and files as `plan.py` beside their folder:
    each must still be defined somewhere in the product; docs/architecture.md's bare class names too
    (elsewhere a bare CamelCase word may be a Hugging Face architecture the server reads)."""
    files = product_files()
    names, file_names = product_names(files), {f.name for f in files}
    stale = [
        f"{page}: {span}"
        for page, text in manual().items()
        for span in stale_bare_names(text, names, file_names, classes_too=page == "docs/architecture.md")
    ]
    assert stale == [], f"names no product module defines: {stale}"


def test_the_citation_checks_catch_what_they_guard():
    assert cited_repo_paths("see `scheduler_proc/gone.py` and [x](../docs/api.md)", "docs/a.md") == {
        "scheduler_proc/gone.py",
        "docs/api.md",
    }
    assert cited_repo_paths("`python -m scripts.decode.bench_decode` and `~/.cache/x/y`", "README.md") == {
        "scripts/decode/bench_decode.py"
    }
    assert cited_repo_paths("vLLM's `examples/online/x.json`", "README.md") == set()
    assert stale_citations("`scheduler_proc/ledger.py:Ledger.apply`") == []
    assert stale_citations("`scheduler_proc/ledger.py:Ledger.vanish`") == ["scheduler_proc/ledger.py:Ledger.vanish"]
    assert stale_citations("`worker_proc/nowhere.py:run`") == ["worker_proc/nowhere.py:run"]
    assert "Core.apply" in defined_names("class Core:\n    def apply(self):\n        pass\n")
    assert module_names("ToWorker = A | B\nx: int = 1\nprint(x)\n") == {"ToWorker", "x"}
    names, file_names = {"Core", "Core.apply", "StepPlan"}, {"plan.py"}
    text = "`Core.apply(event)` `Core.gone` `StepPlan` `Vanished` `plan.py` `batch.py` `max_loras` `LlamaForCausalLM`"
    assert stale_bare_names(text, names, file_names, classes_too=False) == ["Core.gone", "batch.py"]
    assert stale_bare_names(text, names, file_names, classes_too=True) == [
        "Core.gone",
        "Vanished",
        "batch.py",
        "LlamaForCausalLM",
    ]
