"""scripts/test_suite.py (make test, make check): counts from real pytest JUnit reports, lanes side
by side with every line named by its tier, the table, and the closing line."""

import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import test_suite  # noqa: E402

TIER_TESTS = {  # a tier's tests: name -> source
    "green": "import time\ndef test_a(): time.sleep(2)\ndef test_b(): pass\n",
    "mixed": ("import time, pytest\ndef test_ok(): time.sleep(2)\ndef test_bad(): assert 1 == 2\n"
              "@pytest.mark.skip(reason='no GPU here')\ndef test_gpu(): pass\n"),
    "empty": "# no test\n",
}


@pytest.fixture
def tiers(tmp_path, monkeypatch):
    """Tiers whose 'make target' is a real pytest run of a file of their own."""
    for name, source in TIER_TESTS.items():
        (tmp_path / f"tier_{name}.py").write_text(source)
    monkeypatch.setattr(test_suite, "TIERS", {n: (n, f"the {n} tier") for n in TIER_TESTS})
    monkeypatch.setattr(test_suite, "command", lambda target, args: [
        sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=-ra", "--rootdir",
        str(tmp_path), str(tmp_path / f"tier_{target}.py"), *args.split()])
    return tmp_path


def test_counts_come_from_the_junit_report(tiers):
    report = tiers / "mixed.xml"
    subprocess.run(test_suite.command("mixed", f"--junitxml={report}"), capture_output=True)
    assert test_suite.counts(report) == (1, 1, 1)
    assert test_suite.counts(tiers / "absent.xml") is None


def test_lanes_run_side_by_side_and_the_last_line_sums_every_tier(tiers, capsys):
    rc = test_suite.main(["green,mixed", "empty", "--reports", str(tiers / "reports")])
    out = capsys.readouterr().out
    assert rc == 1  # mixed failed a test, empty ran none
    lines = out.strip().splitlines()
    assert lines[-1] == "3 passed, 1 failed, 1 skipped"
    rows = {ln.split()[0]: ln.split() for ln in lines if re.match(r"(green|mixed|empty|all) +\d", ln)}
    assert rows["green"][1:4] == ["2", "0", "0"] and rows["green"][5:] == ["-", "ok"]  # no budget
    assert rows["mixed"][1:4] == ["1", "1", "1"] and rows["mixed"][6] == "FAILED"
    assert " ".join(rows["empty"][6:]) == "ran no test"
    assert rows["all"][1:4] == ["3", "1", "1"]
    # each tier's own output, named by its tier
    assert re.search(r"^mixed \| .*test_bad", out, re.M) and re.search(r"^green \| .*2 passed", out, re.M)
    assert "SKIPPED" in out and "no GPU here" in out  # -ra: a skip keeps its reason
    # the second lane did not wait for the first: empty ended before mixed started
    assert out.index("==== empty: 0 passed") < out.index("==== mixed: the mixed tier")
    # above the table, where a log's tail shows it: the failed test and its failure's first line,
    # and the least free disk seen
    start = out.index("failed in mixed:")
    digest = out[start:out.index("\ntier ", start)].splitlines()
    assert digest[1] == "  tier_mixed::test_bad: assert 1 == 2", digest
    disk = r"disk \(.*reports\): [\d.]+ GB free at the start, [\d.]+ GB at the least"
    assert re.fullmatch(disk, digest[3]), digest
    # each tier's slowest tests, slowest first, with pytest's own seconds
    slow = out[out.index("slowest in green:"):out.index("slowest in mixed:")].splitlines()
    assert re.fullmatch(r"  +2\.\d s  tier_green::test_a", slow[1]), slow
    assert re.fullmatch(r"  +0\.\d s  tier_green::test_b", slow[2]), slow
    assert "slowest in empty:" not in out  # no test, no line


def test_many_failures_are_cut_to_a_few_lines_and_a_count(tmp_path):
    fixture = "import pytest\n@pytest.fixture\ndef broken(): raise OSError('no space left')\n"
    (tmp_path / "t.py").write_text(fixture + "".join(f"def test_{i}(broken): pass\n" for i in range(11)))
    report = tmp_path / "r.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                    str(tmp_path / "t.py"), f"--junitxml={report}"], capture_output=True)
    lines = test_suite.failures(report)
    assert len(lines) == 9 and lines[-1] == "... and 3 more", lines
    assert lines[0].startswith("t::test_0: failed on setup with") and "no space left" in lines[0], lines


def test_then_starts_the_next_lanes_when_every_lane_before_it_has_ended(tiers, capsys):
    """make test's order: the cheap tiers first, then the two heavy ones side by side."""
    rc = test_suite.main(["green", "then", "mixed", "empty", "--reports", str(tiers / "reports")])
    out = capsys.readouterr().out
    assert rc == 1 and out.strip().splitlines()[-1] == "3 passed, 1 failed, 1 skipped"
    green_ended = out.index("==== green: 2 passed")
    assert green_ended < out.index("==== mixed: the mixed tier")
    assert green_ended < out.index("==== empty: the empty tier")
    assert "green | " not in out  # alone in its stage: its lines as they are
    assert "lanes, side by side: mixed  |  empty" in out
    assert out.index("==== empty: 0 passed") < out.index("==== mixed: 1 passed")  # side by side


def test_each_tier_is_shown_beside_its_budget_and_one_over_it_is_named(tiers, capsys, monkeypatch):
    monkeypatch.setattr(test_suite, "budgets", lambda: {"green": 1, "mixed": 600, "warm": 2700, "cold": 3600})
    assert test_suite.main(["green,mixed", "--reports", str(tiers / "reports")]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    green = next(ln for ln in lines if ln.startswith("green ")).split()
    seconds = int(green[4])
    assert seconds >= 2 and green[5] == "1"  # its test sleeps 2 s: over a budget of 1
    assert " ".join(green[6:]) == f"ok, {seconds - 1} s over its budget"
    mixed = next(ln for ln in lines if ln.startswith("mixed ")).split()
    assert mixed[5:] == ["600", "FAILED"]
    assert "budget: warm 2700, cold 3600 s" in next(ln for ln in lines if ln.startswith("all "))


def test_the_budgets_are_kept_in_one_place_for_every_tier():
    b = test_suite.budgets()
    assert set(test_suite.TIERS) | {"warm", "cold"} == set(b)
    assert b["warm"] <= b["cold"] <= 5400  # CI's hard limit
    # make test's lanes (the Makefile's TEST_LANES): every tier in one; the stages one after another
    # (`then`), each as long as its longest lane, whose tiers run in turn: within the whole run's
    lanes = re.search(r"^TEST_LANES\s*\?=\s*(.+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    stages = [stage.split() for stage in lanes.split(" then ")]
    tiers = sorted(t for stage in stages for lane in stage for t in lane.split(","))
    assert tiers == sorted(test_suite.TIERS), lanes
    assert sum(max(sum(b[t] for t in lane.split(",")) for lane in stage) for stage in stages) <= b["warm"], b


def test_one_lane_prints_as_it_is(tiers, capsys):
    assert test_suite.main(["green", "--reports", str(tiers / "reports")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "2 passed, 0 failed, 0 skipped"


@pytest.mark.parametrize("lanes,problem", [
    (["green,nope"], "'nope' is not a tier"),
    (["green", "green"], "green is named 2 times"),
    (["green,,mixed"], "an empty tier name"),
    ([], "no tier"),
    (["then", "green"], "'then' needs lanes before and after it"),
    (["green", "then"], "'then' needs lanes before and after it"),
    (["green", "then", "mixed,green"], "green is named 2 times"),
])
def test_bad_lanes_are_one_line_before_any_tier_runs(tiers, capsys, lanes, problem):
    assert test_suite.main([*lanes, "--reports", str(tiers / "reports")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not (tiers / "reports").exists()  # nothing ran, nothing written
    (line,) = err.strip().splitlines()
    assert line.startswith("test: error: lanes ") and problem in line and "TEST_LANES" in line, line


def test_make_test_refuses_bad_lanes_before_setup_or_any_install(tmp_path):
    """scripts/test.sh checks TEST_LANES with the standard library alone (test_suite.py --check-lanes),
    before make setup and before the Docker engine, base image and wheelhouse it starts beside it:
    with an empty cache folder, nothing is made there."""
    cache = tmp_path / "cache"
    env = {**os.environ, "DLC_CACHE": str(cache)}
    argv = [str(REPO / "scripts/test.sh"), "--reports", str(cache / "reports"), "emulated,bogus"]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("test: error: lanes 'emulated,bogus': 'bogus' is not a tier"), line
    assert not cache.exists()
    ok = subprocess.run([sys.executable, "scripts/test_suite.py", "--check-lanes", "--reports",
                         str(cache / "reports"), "lint,unit", "emulated"], cwd=REPO, capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout == ok.stderr == "" and not cache.exists(), ok.stderr

def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A git checkout of its own for scripts/leftovers.py (the real one is never written to): a
    tracked file, and the upload test's names ignored as the project's .gitignore ignores them."""
    import leftovers

    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / ".gitignore").write_text(".env\nid_ed25519\n")
    (repo / "tracked.py").write_text("x = 1\n")
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(leftovers, "REPO", repo)
    # a test's processes known by a folder of this test's own (another tier's, running beside this
    # one in make test's lanes, are not this test's to find)
    monkeypatch.setattr(leftovers, "TEST_TMP", f"/leftover-{uuid.uuid4().hex}/")
    monkeypatch.setattr(test_suite, "LINGER_S", 0)
    return repo


def test_leftovers_names_a_tiers_port_state_file_and_what_a_test_wrote_into_the_checkout(checkout, tmp_path,
                                                                                          monkeypatch):
    import socket

    import leftovers

    state = tmp_path / "state"
    (checkout / "mine.txt").write_text("a user's own file, there before the run\n")
    before = set(subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=checkout,
                                capture_output=True, text=True).stdout.splitlines())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        monkeypatch.setattr(leftovers, "CLUSTER_PORTS", [port + 1])
        assert leftovers.find(state, ["cluster"], before) == []  # a listener on a port not the tier's
        monkeypatch.setattr(leftovers, "CLUSTER_PORTS", [port + 1, port])
        (state / "cluster-tier").mkdir(parents=True)
        (state / "cluster-tier" / "6390-8290").write_text("/tmp/dlc-config\n")
        (checkout / "tracked.py").write_text("x = 2\n")
        (checkout / "jobs").mkdir()
        marker = "# a secret that must not leave this machine\n"  # the upload test's SECRET
        (checkout / "jobs" / "untracked_script.py").write_text(marker)
        (checkout / ".env").write_text(marker)
        (checkout / "id_ed25519").write_text("a key of the user's own, ignored by git\n")
        found = leftovers.find(state, ["cluster"], before)
    assert found[0].startswith(f"port {port} listening (pid {os.getpid()} ") and found[0].endswith(
        "): the cluster tier's"), found
    assert found[1] == (f"{state}/cluster-tier/6390-8290: the cluster tier's state file (a killed run's; "
                        "the tier's next run removes what it names)")
    assert found[2:] == [
        "in the checkout: .env (the upload test's planted file; it removes it when it runs again)",
        "in the checkout: M tracked.py (written during the run; git status)",
        "in the checkout: ?? jobs/untracked_script.py (written during the run; git status)"], found
    assert leftovers.find(state, [], None) == [found[2]]  # without the status before: the planted file only
    # a process a test started that outlived it (no pytest above it: here, its parent sh exited)
    argv = f"{sys.executable} -c 'import time; time.sleep(60)' {leftovers.TEST_TMP}dlc-config"
    subprocess.run(["sh", "-c", f"{argv} >/dev/null 2>&1 &"], check=True)
    deadline = time.time() + 10
    while not (left := [ln for ln in leftovers.find(state, ["cluster"], before)
                        if ln.startswith("process ")]):
        assert time.time() < deadline
        time.sleep(0.2)
    (line,) = left
    pid = int(line.split()[1])
    os.kill(pid, 9)
    assert re.fullmatch(rf"process {pid} \({re.escape(sys.executable)} -c import time; time\.sleep\(60\) "
                        r"/leftover-\w+\): a test's, still running", line), line


def test_make_test_ends_with_a_row_for_what_the_tiers_left_behind(tiers, checkout, capsys):
    state = tiers / "state"
    assert test_suite.main(["green", "--reports", str(tiers / "reports"), "--state", str(state)]) == 0
    out = capsys.readouterr().out
    assert "left behind: nothing" in out and out.strip().splitlines()[-1] == "3 passed, 0 failed, 0 skipped"
    assert next(ln for ln in out.splitlines() if ln.startswith("leftovers ")).split()[1:4] == ["1", "0", "0"]
    (checkout / "written_by_a_test.txt").write_text("x\n")  # (green's test writes nothing: as if it did)
    after = test_suite.left_behind(state, [], set())
    assert after.failed == 1 and after.status == "failed"
    assert after.found == ("left behind: in the checkout: ?? written_by_a_test.txt (written during "
                                   "the run; git status)",)
