"""The pytest plugin behind make smoke's output: per test (a step, named test_<step>) a progress
line when it starts and a PASS/FAIL/SKIP line when it ends; then the JSON report and the summary.

pytest does the work a step runner would: ordering (the file's), selection (`steps`, a
collection hook), time limits (pytest-timeout, a marker per test), skips with reasons
(pytest.skip), failures with messages (pytest.fail; any other exception fails the step with its
type and text). This plugin only turns pytest's reports into the report's step results,
{name, ok, skipped, seconds, details}, where details is the test's `details` fixture (plus
"error" when it failed, or only {"reason"} when it skipped)."""

from __future__ import annotations

import datetime as dt
import json
import platform
import socket
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

from dlcluster import record
from dlcluster.smoke.lib import log
from trainkit.smoke_protocol import MIB


class SmokeReport:
    """pytest.main(..., plugins=[SmokeReport(...)]): `rec` the cluster record, `config`
    its path, `path` where the JSON report goes, `steps` the ones to run (None: all collected),
    `limits` each step's time limit in seconds (pytest-timeout stops it `hard_after` later),
    `started` and `t0` (time.monotonic) when the run began (default: now)."""

    def __init__(self, rec: record.ClusterRecord, config: Path, path: Path,
                 steps: Iterable[str] | None = None, limits: dict[str, float] | None = None,
                 hard_after: float = 0, started: dt.datetime | None = None, t0: float | None = None):
        self.rec, self.config, self.path = rec, config, path
        self.steps = list(steps) if steps is not None else None
        self.limits, self.hard_after = dict(limits or {}), hard_after
        self.results: list[dict] = []
        self.report: dict | None = None
        self.interrupted = False
        self.broken: list[str] = []  # the suite's files that did not load
        self.printed = False
        self.started = started or dt.datetime.now(dt.UTC)  # the run's start (the report's times)
        self.t0 = time.monotonic() if t0 is None else t0
        self._current: dict | None = None

    # ---------------------------------------------------------------- collection
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """Keep the chosen steps (in the file's order, whatever order --only gave) and give each
        its time limit."""
        if self.steps is not None:
            chosen = [i for i in items if step_name(i) in self.steps]
            left = [i for i in items if step_name(i) not in self.steps]
            if left:
                config.hook.pytest_deselected(items=left)
            items[:] = chosen
        for item in items:
            limit = self.limits.get(step_name(item))
            if limit is not None:
                item.add_marker(pytest.mark.timeout(limit + self.hard_after))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:  # a broken suite: say so; the run cannot pass
            self.broken.append(report.nodeid)
            log(f"the suite's {report.nodeid} did not load:\n{report.longreprtext}")

    # ---------------------------------------------------------------- each step
    @pytest.fixture
    def details(self) -> dict:
        """What the report keeps of the step: the test fills it as it learns things."""
        return {}

    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        name = step_name(item)
        limit = self.limits.get(name)
        log(f"{name}: starting" + (f" (limit {limit:.0f} s)" if limit is not None else ""))
        self._current = {"name": name, "ok": True, "skipped": False, "seconds": 0.0, "details": {}}

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo):
        report = yield
        r = self._current
        if r is None:
            return report
        r["seconds"] += call.duration
        if call.when == "call" or (call.when == "setup" and call.excinfo is not None):
            r["details"] = item.funcargs.get("details", {}) if hasattr(item, "funcargs") else {}
            e = call.excinfo
            if e is None:
                pass
            elif e.errisinstance(pytest.skip.Exception):
                r.update(skipped=True, ok=False, details={"reason": str(e.value)})
            elif e.errisinstance(pytest.fail.Exception):
                r.update(ok=False, details={"error": str(e.value), **r["details"]})
            else:  # a bug or an unexpected answer: the step fails, the others still run
                r.update(ok=False, details={"error": f"{e.typename}: {e.value}", **r["details"]})
        if call.when == "teardown":
            r["seconds"] = round(r["seconds"], 1)
            self.results.append(r)
            self._current = None
            log(step_line(r))
            if not r["ok"] and not r["skipped"] and r["details"].get("log_tail"):
                log(f"{r['name']}: the job's last {len(r['details']['log_tail'])} log lines:")
                for line in r["details"]["log_tail"]:
                    print(f"    {line}", flush=True)
        return report

    def pytest_report_teststatus(self, report: pytest.TestReport):
        """No progress letters: the lines above say it."""
        return report.outcome, "", ""

    # ---------------------------------------------------------------- the end
    def pytest_keyboard_interrupt(self, excinfo: pytest.ExceptionInfo) -> None:
        # Ctrl-C; not pytest's stop after a collection error (a KeyboardInterrupt too)
        self.interrupted = not excinfo.errisinstance(pytest.Session.Interrupted)

    def pytest_sessionfinish(self) -> None:
        self.report = build_report(self.rec, self.config, self.results, self.started,
                                   time.monotonic() - self.t0)
        if self.broken:
            self.report.update(ok=False, error=f"the suite did not load: {', '.join(self.broken)}")
        if self.interrupted:  # the step under way has no result: the run did not pass
            self.report.update(ok=False, error="interrupted")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.report, indent=2, default=str) + "\n")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        for line in self.summary_lines():
            terminalreporter.write_line(line)
        self.printed = True

    def summary_lines(self) -> list[str]:
        return summary(self.report, self.path) if self.report is not None else []


def step_name(item: pytest.Item) -> str:
    return getattr(item, "originalname", item.name).removeprefix("test_")


# ------------------------------------------------------------------ the report's lines
def fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def key_numbers(result: dict) -> str:
    d, name = result["details"], result["name"]
    if result["skipped"]:
        return d.get("reason", "")
    if not result["ok"]:
        return d.get("error", "")
    if name == "nodes":
        return (f"{d['alive']}/{d['expected']} nodes alive, {d['agents']} agents, CPUs {d['cpus']}, "
                f"GPUs {d['gpus']}")
    if name == "allreduce":
        big = max(d["rows"], key=lambda r: r["bytes"])
        return (f"{d['backend']}, {d['world_size']} ranks on {d['nodes_used']} nodes; "
                f"{fmt_bytes(big['bytes'])}: {big['time_us']:.0f} us, algbw {big['algbw_gbs']:.3f} "
                f"GB/s, busbw {big['busbw_gbs']:.3f} GB/s; #wrong {sum(r['wrong'] for r in d['rows'])}")
    if name == "perf":
        n = d["now"]
        verb = f"recorded as the baseline {d['recorded']}" if d.get("recorded") else \
            f"against {d['baseline']}, 0 findings"
        return f"{len(n['nodes'])} nodes, {len(n['links'])} links measured; {verb}"
    if name == "trainers":
        return ", ".join(f"{j} {r['seconds']:.0f} s (parity {r['check']['parity']['max_abs_diff']:.1e})"
                         for j, r in d["jobs"].items())
    if name == "proxyjump":
        return (f"{len(d['nodes'])} node(s): direct :22 blocked, ssh through {d['bastion']} ok"
                + (f"; not checked (no ip): {', '.join(d['not_checked'])}" if d["not_checked"] else ""))
    return ""


def step_line(result: dict) -> str:
    verdict = "SKIP" if result["skipped"] else "PASS" if result["ok"] else "FAIL"
    try:
        numbers = key_numbers(result)
    except (KeyError, TypeError, ValueError) as e:  # an odd payload must not cost the report
        numbers = f"(details incomplete: {type(e).__name__} {e})"
    return f"{verdict} {result['name']:<10} {result['seconds']:7.1f} s  {numbers}"


def allreduce_table(details: dict) -> list[str]:
    """nccl-tests' columns (in place): size, count, type, redop, time, algbw, busbw, #wrong."""
    lines = [f"all-reduce: {details['backend']}, {details['world_size']} ranks on "
             f"{details['nodes_used']} nodes ({details['placement_strategy']}), in place; time: "
             f"mean over ranks; busbw = algbw * 2(n-1)/n",
             f"{'size (B)':>12} {'count':>10} {'type':>6} {'redop':>6} {'time (us)':>11} "
             f"{'algbw (GB/s)':>13} {'busbw (GB/s)':>13} {'#wrong':>7}"]
    for r in details["rows"]:
        lines.append(f"{r['bytes']:>12} {r['count']:>10} {r['type']:>6} {r['redop']:>6} "
                     f"{r['time_us']:>11.1f} {r['algbw_gbs']:>13.3f} {r['busbw_gbs']:>13.3f} "
                     f"{r['wrong']:>7}")
    return lines


def build_report(rec: record.ClusterRecord, config: Path, steps: list[dict], started: dt.datetime,
                 seconds: float) -> dict:
    """The JSON report. Its "description" key (the cluster record's path) keeps its old name:
    readers of earlier reports look it up."""
    ran = [s for s in steps if not s["skipped"]]
    return {
        "cluster": rec.name, "kind": rec.kind, "description": str(config),
        "job_api": rec.job_api, "nodes": len(rec.nodes),
        "started": started.isoformat(timespec="seconds"),
        "finished": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "ok": all(s["ok"] for s in ran),
        "passed": sum(1 for s in ran if s["ok"]), "failed": sum(1 for s in ran if not s["ok"]),
        "skipped": sum(1 for s in steps if s["skipped"]),
        "client": {"python": platform.python_version(), "hostname": socket.gethostname()},
        "steps": steps,
    }


def summary(report: dict, path: Path | None = None) -> list[str]:
    lines = [f"smoke tests of cluster {report['cluster']} ({report['kind']}, {report['nodes']} "
             f"node(s), job API {report['job_api']}):"]
    lines += ["  " + step_line(s) for s in report["steps"]]
    for s in report["steps"]:
        if s["name"] == "allreduce" and s["details"].get("rows"):
            lines += ["  " + line for line in allreduce_table(s["details"])]
        if s["name"] == "perf" and s["details"].get("table"):
            lines += ["  perf: " + line for line in s["details"]["table"]]
            lines += [f"  perf: plot {s['details']['plot']}"] if s["details"].get("plot") else []
    verdict = "PASS" if report["ok"] else "FAIL"
    lines.append(f"smoke: {verdict}: {report['passed']} passed, {report['failed']} failed, "
                 f"{report['skipped']} skipped in {report['seconds']:.0f} s"
                 + (f"; report {path}" if path else ""))
    return lines
