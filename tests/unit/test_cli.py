"""The operator's one command (dlcluster/cli.py), installed by make setup: every operator Make target
calls it, its --help lists every command and says what each changes, each command has its own flags,
and it runs this checkout's code, found with no link, no folder change and no guard."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from dlcluster import cli

REPO = Path(__file__).resolve().parents[2]


DLCLUSTER = Path(sys.executable).parent / "dlcluster"  # .venv/bin/dlcluster


def dlcluster(*args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(DLCLUSTER), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def recipes() -> dict[str, list[str]]:
    """Each Make target's recipe lines."""
    out, target = {}, None
    for line in (REPO / "Makefile").read_text().splitlines():
        if m := re.match(r"^([a-z][a-z-]*):", line):
            target = m.group(1)
            out[target] = []
        elif line.startswith("\t") and target:
            out[target].append(line.strip())
    return out


def test_every_make_target_that_runs_python_goes_through_the_one_command():
    found = recipes()
    assert {"cluster-up", "token", "bench", "test"} <= set(found), sorted(found)
    python = [(t, line) for t, lines in found.items() for line in lines
              if "$(PY)" in line or "$(PYTHON)" in line or "$(DLC)" in line]
    assert len(python) >= 20, python
    # what may run Python besides the operator's command: the test tiers (pytest, the suite's runner
    # and its check for what the tiers left behind)
    allowed = r"\$\(DLC\) \S+|\$\(PY\) -m pytest |\$\(PY\) scripts/(test_suite|leftovers)\.py "
    stray = [(t, line) for t, line in python if not re.search(allowed, line)]
    assert stray == [], stray
    # and each command is the one its Make target calls, under the name the help gives
    for name, command in cli.COMMANDS.items():
        lines = found[command.target]
        assert any(re.search(rf"\$\(DLC\) {re.escape(name)}( |$)", line) for line in lines), (name, lines)
    for t, line in python:
        if m := re.search(r"\$\(DLC\) (\S+)", line):
            assert m.group(1) in cli.COMMANDS, (t, line)


def test_help_lists_every_command_with_what_it_changes():
    proc = dlcluster("--help")
    assert proc.returncode == 0, proc.stderr
    rows = "".join(proc.stdout.split())  # argparse wraps the lines (and breaks "all-reduce" after its -)
    for name, command in cli.COMMANDS.items():
        assert name + "".join(command.changes.split()) in rows, name
    for name, command in cli.COMMANDS.items():
        proc = dlcluster(name, "--help")
        first = proc.stdout.splitlines()[0]
        want = f"dlcluster {name} (make {command.target}): {command.changes}"
        assert proc.returncode == 0 and first == want, (name, proc.stdout[-500:], proc.stderr[-1500:])
        # then the command's own flags, from its parser
        assert "usage: " in proc.stdout and "--help" in proc.stdout, (name, proc.stdout[-500:])


def test_an_unknown_command_is_one_line_naming_the_known_ones():
    proc = dlcluster("tokn")
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = [line for line in proc.stderr.splitlines() if not line.startswith("usage:")]
    assert "invalid choice: 'tokn'" in line and "'token'" in line and "'submit'" in line, line


def test_the_command_is_installed_and_runs_this_checkouts_code():
    """pyproject's console script in .venv (make setup, editable): the packages it imports are this
    checkout's files, whatever folder it runs from; git tracks no link (jobs/ reached the harness
    through one)."""
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="dlcluster")
    assert script.value == "dlcluster.cli:main"
    where = subprocess.run([sys.executable, "-c", "import dlcluster, trainkit; print(dlcluster.__file__); "
                            "print(trainkit.__file__)"], cwd="/", capture_output=True, text=True, check=True)
    assert where.stdout.split() == [str(REPO / "dlcluster/__init__.py"), str(REPO / "trainkit/__init__.py")]
    index = subprocess.run(["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True)
    links = [line for line in index.stdout.splitlines() if line.startswith("120000")]
    assert links == []
    proc = dlcluster("remove-node", "--help", cwd=Path("/"))
    assert proc.returncode == 0 and "--inventory PATH" in proc.stdout and "NODE" in proc.stdout, proc.stdout


def test_a_command_runs_its_program_with_the_flags_given(tmp_path):
    """Flags reach the program behind the command untouched, and its refusal is its own line."""
    env = {**os.environ, "DLC_CONFIG": str(tmp_path)}
    proc = dlcluster("smoke", "--only", "trainerz", env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "smoke: error: --only 'trainerz': unknown step(s) trainerz; "
        "use some of nodes,allreduce,perf,trainers,proxyjump")
    proc = dlcluster("submit", "nope", env=env)
    assert proc.returncode == 2 and proc.stderr.startswith("submit: error: no jobs/nope.py; JOB is one of: ")
