"""make test / make check: run test tiers in lanes, then one table and one closing line.

Each argument is a lane: its tiers, joined by commas, run one after another; the lanes run side by
side. `then` ends a stage: the lanes after it start when every lane before it has ended. make test's
TEST_LANES: the emulated tier, the longest, from the start in a lane of its own, and every other
tier in turn beside it (each heavy tier alone leaves a core idle a third of the time on 2 cores;
docs/testing.md). Each tier is its own make target (make
test-unit, ...) run with `--junitxml`; the counts come from those JUnit reports (lint writes one
too: a case per linter), never from scraping output. With more than one lane in a stage every output
line starts with its tier's name. Every tier runs even after one failed, so the table is whole; the
exit code is non-zero when any tier failed, errored, or ran no test. Above the table: each failed
test with the first line of its failure (a CI log is often read from its tail only), and the least
free disk seen during the run (a full disk fails tests far from its cause). The last line printed
is the suite's `N passed, N failed, N skipped`.

    python scripts/test_suite.py lint,unit,gpu,cluster,image emulated         # make test
    python scripts/test_suite.py lint,unit,gpu,image then cluster emulated   # cheap tiers, then heavy ones
    python scripts/test_suite.py lint,unit,gpu,image,cluster,emulated         # one after another
    python scripts/test_suite.py lint,unit                                    # make check
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# tier -> (make target, what it is)
TIERS = {
    "lint": ("lint", "ruff, mypy, shellcheck, yamllint, role docs, ansible-lint"),
    "unit": ("test-unit", "tests/unit: no cluster"),
    "cluster": ("test-cluster", "tests/cluster: a throwaway local 2-node Ray cluster"),
    "image": ("test-image", "tests/container: the CPU image built and tested inside"),
    "emulated": ("test-emulated", "tests/emulated: a bastion and 3 node containers, real playbooks"),
    "gpu": ("test-gpu", "tests/gpu: CUDA, NCCL (skipped with its reason without a GPU)"),
}
PRINT = threading.Lock()
LINGER_S = 75  # ansible.cfg's ControlPersist (60 s), and some: looked at again after it


def budgets() -> dict[str, int]:
    """Seconds per tier, and the whole run's (`warm`, `cold`): pyproject.toml's
    [tool.dlcluster.test-budget], the one place they are kept."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f).get("tool", {}).get("dlcluster", {}).get("test-budget", {})


def say(line: str, prefix: str = "") -> None:
    with PRINT:
        print(f"{prefix}{line}", flush=True)


@dataclass
class Result:
    tier: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    rc: int = 0
    status: str = ""
    found: tuple[str, ...] = ()  # what a check that is not a pytest tier found (leftovers)


def counts(report: Path) -> tuple[int, int, int] | None:
    """(passed, failed, skipped) from a JUnit XML report; errors count as failed."""
    if not report.is_file():
        return None
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    tests = failed = skipped = 0
    for s in suites:
        tests += int(s.get("tests", 0))
        failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    return max(tests - failed - skipped, 0), failed, skipped


def failures(report: Path, most: int = 8) -> list[str]:
    """A line per failed or errored test of a JUnit report (at most `most`, then how many more):
    the test and the first line of its failure."""
    if not report.is_file():
        return []
    lines = []
    for case in ET.parse(report).getroot().iter("testcase"):
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is None:
            continue
        first = next((ln.strip() for ln in (bad.get("message") or bad.text or "").splitlines() if ln.strip()),
                     "(no message)")
        lines.append(f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}: {first[:160]}")
    return lines[:most] + ([f"... and {len(lines) - most} more"] if len(lines) > most else [])


def slowest(report: Path, most: int = 10) -> list[str]:
    """A tier's `most` slowest tests from its JUnit report (pytest's own seconds for each: setup,
    call and teardown), slowest first: a test whose time doubles shows in CI's log."""
    if not report.is_file():
        return []
    cases = [(float(c.get("time") or 0), f"{c.get('classname', '').rsplit('.', 1)[-1]}::{c.get('name')}")
             for c in ET.parse(report).getroot().iter("testcase")]
    return [f"{seconds:7.1f} s  {name}" for seconds, name in sorted(cases, key=lambda c: -c[0])[:most]]


class DiskWatch(threading.Thread):
    """The least free space seen on `path`'s filesystem, every `every` seconds until stopped."""

    def __init__(self, path: Path, every: float = 10.0) -> None:
        super().__init__(daemon=True)
        self.path, self.every, self.done = path, every, threading.Event()
        self.start_free = self.least = shutil.disk_usage(path).free

    def run(self) -> None:
        while not self.done.wait(self.every):
            self.least = min(self.least, shutil.disk_usage(self.path).free)

    def stop(self) -> str:
        self.done.set()
        self.least = min(self.least, shutil.disk_usage(self.path).free)
        return (f"disk ({self.path}): {self.start_free / 1e9:.1f} GB free at the start, "
                f"{self.least / 1e9:.1f} GB at the least")


def judge(r: Result, got: tuple[int, int, int] | None) -> Result:
    """A tier's counts and status from its report and exit code."""
    if got is None:
        r.failed, r.status = 1, f"no report (exit {r.rc}): the tier stopped before its tests"
        return r
    r.passed, r.failed, r.skipped = got
    if r.rc == 5 or r.passed + r.failed + r.skipped == 0:
        r.status = "ran no test"
    elif r.rc != 0 and r.failed == 0:  # e.g. pytest's own error after the tests, or a teardown
        r.failed, r.status = 1, f"exit {r.rc} with no failed test: counted as one failure"
    else:
        r.status = "ok" if r.rc == 0 else "FAILED"
    return r


def command(target: str, pytest_args: str) -> list[str]:
    """How a tier runs: its make target, with the pytest flags that write its report."""
    return ["make", "--no-print-directory", target, f"PYTEST_ARGS={pytest_args}"]


def run_tier(tier: str, reports: Path, pytest_args: str, prefix: str) -> Result:
    target, what = TIERS[tier]
    report = reports / f"{tier}.xml"
    report.unlink(missing_ok=True)
    say(f"==== {tier}: {what} (make {target}), started {time.strftime('%H:%M:%S')}", prefix)
    env = {**os.environ, "LINT_JUNIT": str(report)}
    # beside another lane a line per test (-v): pytest's dots reach a line only when a file ends
    args = (f"{pytest_args}{' -v' if prefix else ''} --durations=10 --durations-min=5"
            f" --junitxml={shlex.quote(str(report))} -o junit_family=xunit1").strip()
    started = time.monotonic()
    proc = subprocess.Popen(command(target, args), cwd=REPO,
                            env=env, stdout=subprocess.PIPE if prefix else None,
                            stderr=subprocess.STDOUT if prefix else None, text=True, errors="replace")
    if prefix and proc.stdout is not None:
        for line in proc.stdout:
            say(line.rstrip("\n"), prefix)
    rc = proc.wait()
    r = judge(Result(tier, rc=rc, seconds=time.monotonic() - started), counts(report))
    say(f"==== {tier}: {r.passed} passed, {r.failed} failed, {r.skipped} skipped in {r.seconds:.0f} s"
        f" ({r.status})", prefix)
    return r


def lane_problem(order: list[str]) -> str | None:
    """What is wrong with the tiers named (in lane order), or None."""
    if not order:
        return "no tier"
    for tier in order:
        if tier not in TIERS:
            return f"{tier!r} is not a tier" if tier else "an empty tier name (two commas, or one at an end)"
        if order.count(tier) > 1:
            return f"{tier} is named {order.count(tier)} times"
    return None


def left_behind(state: Path, tiers: list[str], before: set[str]) -> Result:
    """scripts/leftovers.py after every lane ended: what the tiers that ran left (their ports, state
    files, the emulated tier's containers and rules, files in the checkout), as a row of the table:
    one check, passed when nothing is left."""
    import leftovers  # scripts/, beside this file (its psutil: the project's environment)

    t0 = time.monotonic()
    say("==== leftovers: what the tiers left behind (make leftovers)")
    found = leftovers.find(state, tiers, before)
    if found:  # an ssh connection Ansible keeps open (ControlPersist) ends a minute after its last use
        time.sleep(LINGER_S)
        found = leftovers.find(state, tiers, before)
    found = [f"left behind: {line}" for line in found]
    for line in found or ["left behind: nothing"]:
        say(line)
    return Result("leftovers", int(not found), int(bool(found)), 0, seconds=time.monotonic() - t0,
                  status="failed" if found else "ok", found=tuple(found))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lanes", nargs="*", metavar="TIER[,TIER...]",
                    help=f"a lane: tiers run in turn; lanes run side by side; `then` waits for the lanes "
                         f"before it. Tiers: {', '.join(TIERS)}")
    ap.add_argument("--reports", type=Path, required=True,
                    help="folder for each tier's JUnit XML report (make: $DLC_CACHE/test-reports)")
    ap.add_argument("--state", type=Path,
                    help="the tiers' state folder (make: $DLC_CACHE/test-state): when given, what the "
                         "tiers left behind is looked for after the lanes, a row of the table "
                         "(scripts/leftovers.py)")
    ap.add_argument("--check-lanes", action="store_true",
                    help="only check the lanes and exit (scripts/test.sh, before setup: the standard "
                         "library alone)")
    a = ap.parse_args(argv)
    stages: list[list[list[str]]] = [[]]  # `then` starts the next stage
    for arg in a.lanes:
        if arg == "then":
            stages.append([])
        else:
            stages[-1].append(arg.split(","))
    lanes = [lane for stage in stages for lane in stage]
    order = [t for lane in lanes for t in lane]
    problem = lane_problem(order) or ("'then' needs lanes before and after it"
                                      if len(stages) > 1 and not all(stages) else None)
    if problem:
        print(f"test: error: lanes {' '.join(a.lanes)!r}: {problem}; name each of {', '.join(TIERS)} at most "
              "once, comma-separated within a lane, `then` between two groups of lanes "
              "(make test: TEST_LANES)",
              file=sys.stderr)
        return 2
    if a.check_lanes:
        return 0
    a.reports.mkdir(parents=True, exist_ok=True)
    pytest_args = os.environ.get("PYTEST_ARGS", "")
    width = max(map(len, order))
    results: dict[str, Result] = {}

    def run_lane(lane: list[str], beside: bool) -> None:
        for tier in lane:
            prefix = f"{tier:<{width}} | " if beside else ""
            results[tier] = run_tier(tier, a.reports, pytest_args, prefix)

    started = time.monotonic()
    # what git shows in the checkout now: at the end, anything more is a test's (scripts/leftovers.py)
    import leftovers

    before = leftovers.git_status() if a.state else set()
    disk = DiskWatch(a.reports)
    disk.start()
    for stage in stages:
        if len(stage) > 1:
            say("lanes, side by side: " + "  |  ".join(" -> ".join(lane) for lane in stage))
        threads = [threading.Thread(target=run_lane, args=(lane, len(stage) > 1)) for lane in stage]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    ordered = [results[t] for t in order]
    if a.state:
        ordered.append(left_behind(a.state, [t for t in order if t in leftovers.TIERS], before))
    budget = budgets()
    for r in ordered:
        if slow := slowest(a.reports / f"{r.tier}.xml"):
            print(f"\nslowest in {r.tier}:")
            for line in slow:
                print(f"  {line}")
    for r in ordered:
        if r.failed:
            print(f"\nfailed in {r.tier}:")
            for line in failures(a.reports / f"{r.tier}.xml") or r.found[:8]:
                print(f"  {line}")
    print(f"\n{disk.stop()}\n")
    print(f"{'tier':<10} {'passed':>7} {'failed':>7} {'skipped':>8} {'seconds':>8} {'budget':>7}  status")
    for r in ordered:
        over = (f", {r.seconds - budget[r.tier]:.0f} s over its budget"
                if r.seconds > budget.get(r.tier, float("inf")) else "")
        print(f"{r.tier:<10} {r.passed:>7} {r.failed:>7} {r.skipped:>8} {r.seconds:>8.0f} "
              f"{budget.get(r.tier, '-'):>7}  {r.status}{over}")
    passed, failed, skipped = (sum(getattr(r, k) for r in ordered) for k in ("passed", "failed", "skipped"))
    total = Result("all", passed, failed, skipped, seconds=time.monotonic() - started)
    whole = f"warm {budget['warm']}, cold {budget['cold']}" if {"warm", "cold"} <= budget.keys() else "-"
    print(f"{'all':<10} {total.passed:>7} {total.failed:>7} {total.skipped:>8} {total.seconds:>8.0f} "
          f"{'':>7}  (wall clock; budget: {whole} s; reports: {a.reports})")
    bad = [r.tier for r in ordered if r.status != "ok"]
    if bad:
        print(f"test: not passed: {', '.join(bad)}", file=sys.stderr, flush=True)
    print(f"{total.passed} passed, {total.failed} failed, {total.skipped} skipped", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
