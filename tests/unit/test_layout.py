"""The layout's debts, counted so they only go down (issue: a layout that shows the architecture):
the import cycle among the harness's modules, the path tricks outside the tests, and the harness
never importing an operator's tool. Each allowance is today's count; a change that pays a debt off
lowers it here, a change that adds one fails."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HARNESS = REPO / "trainkit"
# the operator's tools that lived in trainkit until they moved to the operator's package, dlcluster/
MOVED_OUT = {"baseline", "doctor", "doctor_probe", "runs", "submissions", "upload", "plots", "record"}

# none since the contract (trainkit/contract.py, keras_base.py) left job.py and keras_loop.py
ALLOWED_IN_CYCLES = 0
# none left outside tests/: the Makefile's PYTHONPATH=, and the inserts of docker/report.py,
# ray/local_cluster.py, ray/smoke.py, dlc_jobs.py and scripts/envkey.py went with the moves into
# dlcluster/, scripts/test_suite.py's when make passed it the reports' folder, dlcluster/plots.py's
# (matplotlib's own cached site) when matplotlib was pinned in pyproject.toml
ALLOWED_PATH_TRICKS = 0


def imports(path: Path) -> set[str]:
    """The trainkit modules `path` imports, at any depth (top level, in functions, TYPE_CHECKING)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:  # from .x import y, from . import x
            found |= {node.module} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainkit"):
            rest = node.module.removeprefix("trainkit").lstrip(".")
            found |= {rest.split(".")[0]} if rest else {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("trainkit.")}
    modules = {p.stem for p in HARNESS.glob("*.py")}
    return found & modules - {path.stem}


def graph() -> dict[str, set[str]]:
    return {p.stem: imports(p) for p in HARNESS.glob("*.py") if p.stem != "__init__"}


def reach(edges: dict[str, set[str]], starts: set[str]) -> set[str]:
    """Every module reached from `starts` through one import or more."""
    seen, stack = set(), list(starts)
    while stack:
        for nxt in edges.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def in_cycles(edges: dict[str, set[str]]) -> set[str]:
    """The modules that reach themselves through their imports."""
    return {m for m in edges if m in reach(edges, {m})}


def test_the_import_cycle_among_the_harness_modules_does_not_grow():
    cycle = in_cycles(graph())
    print(f"{len(cycle)} harness modules in an import cycle: {sorted(cycle)}")
    assert len(cycle) <= ALLOWED_IN_CYCLES, sorted(cycle)
    # the counting sees a cycle where there is one: two modules importing each other
    assert in_cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == {"a", "b"}


def operator_imports(path: Path) -> set[str]:
    """What `path` imports of the operator's package (dlcluster), at any depth."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        found |= {n for n in names if n == "dlcluster" or n.startswith("dlcluster.")}
    return found


def test_the_harness_never_imports_the_operators_package(tmp_path):
    """trainkit/ (what the jobs import on the nodes, and the image installs), jobs/ and ray/ (the
    cluster's Ray side: what runs there as a job) import nothing of dlcluster/ (the control host's
    tools), which the image does not hold; one side per file."""
    edges = graph()
    jobs = set()
    for job in (REPO / "jobs").glob("*.py"):
        jobs |= imports(job)
    reached = jobs | reach(edges, jobs)
    assert {"job", "flags", "torch_loop"} <= reached, sorted(reached)  # the walk finds the harness
    assert not {p.stem for p in HARNESS.glob("*.py")} & MOVED_OUT
    found = {str(p.relative_to(REPO)): operator_imports(p)
             for p in [*HARNESS.glob("*.py"), *(REPO / "jobs").glob("*.py"), *(REPO / "ray").rglob("*.py")]}
    assert "ray/smoke_checks.py" in found, sorted(found)
    assert {p: names for p, names in found.items() if names} == {}
    # the walk sees such an import where there is one, in a function too
    (tmp_path / "m.py").write_text("import os\ndef f():\n    from dlcluster import doctor\n"
                                   "import dlcluster.cli\n")
    assert operator_imports(tmp_path / "m.py") == {"dlcluster", "dlcluster.cli"}


def test_path_tricks_outside_the_tests_do_not_grow():
    files = subprocess.run(["git", "ls-files", "*.py", "Makefile", "*.sh"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    # (scripts/gpu_tier.sh's `export PYTHONPATH=` is a bare GPU machine's site of staged wheels)
    tricks = [f"{name}:{n}" for name in files if not name.startswith("tests/")
              for n, line in enumerate((REPO / name).read_text().splitlines(), 1)
              if re.search(r"sys\.path\.(insert|append)\(|^\s*@?PYTHONPATH=", line)]
    print(f"{len(tricks)} path tricks: {tricks}")
    assert len(tricks) <= ALLOWED_PATH_TRICKS, tricks


def test_the_readme_stays_short_enough_to_read_through():
    """At most 250 lines: the two commands, every Make target and variable, the measured figures;
    the rest lives in docs/ (the run log among it: docs/testing.md)."""
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move detail to docs/ and link it"


def test_every_test_the_security_page_names_exists():
    """docs/security.md names the test behind each claim: every name it gives is a test of this
    suite, so a renamed or removed test leaves no claim resting on nothing; each claim names one."""
    page = (REPO / "docs/security.md").read_text()
    defined = set()
    for f in (REPO / "tests").rglob("*.py"):
        defined |= set(re.findall(r"^def (test_\w+)", f.read_text(), re.M))
    named = set(re.findall(r"`(test_\w+)`", page))  # a function's name (a file's ends in .py)
    assert named and named <= defined, sorted(named - defined)
    rows = [line for line in page.splitlines() if line.startswith("| ") and not line.startswith("| claim")]
    assert all(re.search(r"`test_\w+", row) for row in rows), [r[:80] for r in rows if "`test_" not in r]


APT_LOCK = "/var/lock/dlcluster-apt.lock"


def test_every_apt_get_on_this_machine_waits_for_the_one_lock():
    """make test's lanes install what they lack side by side, and two apt-gets at once fail on dpkg's
    lock (on a fresh machine lint's shellcheck install lost it to the emulated lane's docker.io and
    lint skipped shellcheck, 2026-12-02): every apt-get that installs on this machine goes through
    one flock. (tests/emulated's run on the nodes, through ssh.)"""
    files = subprocess.run(["git", "ls-files", "*.sh", "*.py", ".ci/run"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    direct, unlocked = [], []
    for name in files:
        if name.startswith(("tests/unit/", "tests/emulated/")):
            continue
        text = (REPO / name).read_text()
        for n, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0] if name.endswith((".sh", "run")) else line
            if re.search(r"(^|[;{&|]\s*|=\S+\s+)apt-get\s+(update|install)\b", code.strip()):
                direct.append(f"{name}:{n}: {line.strip()}")
        if re.search(r"\"\$\{apt\[@\]\}\" install|\[\"apt-get\", \"install\"", text) and APT_LOCK not in text:
            unlocked.append(name)
    assert direct == [], f"apt-get called without the lock ({APT_LOCK}): {direct}"
    assert unlocked == [], unlocked
    installers = [name for name in files if APT_LOCK in (REPO / name).read_text()]
    assert {"scripts/lint.sh", "docker/engine.sh", "docker/mkbase.sh", "tests/browser.py"} <= set(installers)
