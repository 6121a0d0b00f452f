"""make test / make check: run test tiers in order, then one table and one closing line.

Each tier is its own make target (make test-unit, ...) run with `--junitxml`; the counts come
from those JUnit reports (lint writes one too: a case per linter), never from scraping output.
Every tier runs even after one failed, so the table is whole; the exit code is non-zero when any
tier failed, errored, or ran no test. The last line printed is the suite's
`N passed, N failed, N skipped`.

    python scripts/test_suite.py lint unit cluster image emulated gpu
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# tier -> (make target, what it is). Order on the command line is the order they run in.
TIERS = {
    "lint": ("lint", "ruff, shellcheck, yamllint, ansible-lint"),
    "unit": ("test-unit", "tests/unit: no cluster"),
    "cluster": ("test-cluster", "tests/cluster: a throwaway local 2-node Ray cluster"),
    "image": ("test-image", "tests/container: the CPU image built and tested inside"),
    "emulated": ("test-emulated", "tests/emulated: a bastion and 3 node containers, real playbooks"),
    "gpu": ("test-gpu", "tests/gpu: CUDA, NCCL (skipped with its reason without a GPU)"),
}


@dataclass
class Result:
    tier: str
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    rc: int = 0
    status: str = ""


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


def run_tier(tier: str, reports: Path, pytest_args: str, index: int, total: int) -> Result:
    target, what = TIERS[tier]
    report = reports / f"{tier}.xml"
    report.unlink(missing_ok=True)
    print(f"\n==== [{index}/{total}] {tier}: {what} (make {target}), started {time.strftime('%H:%M:%S')}",
          flush=True)
    env = {**os.environ, "LINT_JUNIT": str(report)}
    args = (f"{pytest_args} --durations=10 --durations-min=5 --junitxml={shlex.quote(str(report))}"
            " -o junit_family=xunit1").strip()
    started = time.monotonic()
    rc = subprocess.call(["make", "--no-print-directory", target, f"PYTEST_ARGS={args}"], cwd=REPO, env=env)
    r = Result(tier, seconds=time.monotonic() - started, rc=rc)
    got = counts(report)
    if got is None:
        r.failed, r.status = 1, f"no report (exit {rc}): the tier stopped before its tests"
    else:
        r.passed, r.failed, r.skipped = got
        if rc == 5 or r.passed + r.failed + r.skipped == 0:
            r.status = "ran no test"
        elif rc != 0 and r.failed == 0:  # e.g. pytest's own error after the tests, or a teardown
            r.failed, r.status = 1, f"exit {rc} with no failed test: counted as one failure"
        else:
            r.status = "ok" if rc == 0 else "FAILED"
    print(f"==== {tier}: {r.passed} passed, {r.failed} failed, {r.skipped} skipped in {r.seconds:.0f} s"
          f" ({r.status})", flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tiers", nargs="+", choices=list(TIERS))
    cache = Path(os.environ.get("DLC_CACHE", Path.home() / ".cache/dlcluster"))
    ap.add_argument("--reports", type=Path, default=cache / "test-reports",
                    help="folder for each tier's JUnit XML report")
    a = ap.parse_args()
    a.reports.mkdir(parents=True, exist_ok=True)
    pytest_args = os.environ.get("PYTEST_ARGS", "")
    started = time.monotonic()
    results = [run_tier(t, a.reports, pytest_args, i, len(a.tiers)) for i, t in enumerate(a.tiers, 1)]
    print(f"\n{'tier':<10} {'passed':>7} {'failed':>7} {'skipped':>8} {'seconds':>8}  status")
    for r in results:
        print(f"{r.tier:<10} {r.passed:>7} {r.failed:>7} {r.skipped:>8} {r.seconds:>8.0f}  {r.status}")
    total = Result("all", *(sum(getattr(r, k) for r in results) for k in ("passed", "failed", "skipped")),
                   seconds=time.monotonic() - started)
    print(f"{'all':<10} {total.passed:>7} {total.failed:>7} {total.skipped:>8} {total.seconds:>8.0f}"
          f"  (reports: {a.reports})")
    bad = [r.tier for r in results if r.status != "ok"]
    if bad:
        print(f"test: not passed: {', '.join(bad)}", file=sys.stderr, flush=True)
    print(f"{total.passed} passed, {total.failed} failed, {total.skipped} skipped", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
