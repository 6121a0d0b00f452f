"""versions.env is the one place for each version and default path: no other file of the
repository spells one of its values, and every name in it is read somewhere."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from trainkit import versions

REPO = Path(__file__).resolve().parents[2]
# prose may name a version for its reader; a patch is for one version; results are data
NOT_CODE = ("*.md", "patches/*", "tests/bench/results/*")


def files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", ".",
                          *(f":!{p}" for p in NOT_CODE), ":!versions.env"],
                         cwd=root, check=True, capture_output=True, text=True).stdout
    return [n for n in out.splitlines() if (root / n).is_file() and not (root / n).is_symlink()]


def second_spellings(root: Path, pinned: dict[str, str]) -> list[str]:
    """`file:line: NAME's value` for each place that spells a pinned value itself."""
    found = []
    for name in files(root):
        text = (root / name).read_text(errors="ignore")
        for pin, value in pinned.items():
            for m in re.finditer(rf"(?<![\w.]){re.escape(value)}(?!\w)", text):
                found.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {pin}'s value {value}")
    return found


def test_no_file_spells_a_pinned_value_again():
    assert second_spellings(REPO, versions.values()) == [], "read it from versions.env instead"


def test_a_second_spelling_is_found(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "build.sh").write_text("echo ok\npip install horovod==9.8.7\n")
    (tmp_path / "README.md").write_text("Horovod 9.8.7\n")  # prose: allowed
    (tmp_path / "bench.json").write_text('{"median": 9.8.71}\n')  # a longer number: not it
    assert second_spellings(tmp_path, {"PIN_HOROVOD": "9.8.7"}) == ["build.sh:2: PIN_HOROVOD's value 9.8.7"]


def test_every_pin_is_read_somewhere():
    text = {name: (REPO / name).read_text(errors="ignore") for name in files(REPO)}
    unread = [pin for pin in versions.values() if not any(pin in t for t in text.values())]
    assert unread == []


def test_values_are_plain_for_make_shell_and_ansible():
    for pin, value in versions.values().items():
        assert re.fullmatch(r"[A-Z][A-Z0-9_]*", pin) and re.fullmatch(r"[\w.:/+-]+", value), (pin, value)


def test_the_wheelhouse_key_changes_with_the_runtime_not_with_a_test_tool(tmp_path):
    """The virtualenv's key follows every pin; the wheelhouse's (the images') only the runtime's
    and versions.env's pip and Horovod sdist: a new test tool rebuilds no image."""
    import shutil
    import sys

    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts/envkey.py", tmp_path / "scripts")
    (tmp_path / "trainkit").mkdir()  # envkey.py reads versions.env through trainkit/versions.py
    for name in ("__init__.py", "versions.py"):
        shutil.copy(REPO / "trainkit" / name, tmp_path / "trainkit")
    pyproject, env = (REPO / "pyproject.toml").read_text(), (REPO / "versions.env").read_text()

    def keys(pyproject_text: str, env_text: str) -> tuple[str, str]:
        (tmp_path / "pyproject.toml").write_text(pyproject_text)
        (tmp_path / "versions.env").write_text(env_text)
        run = [sys.executable, str(tmp_path / "scripts/envkey.py")]
        return tuple(subprocess.run([*run, *flag], check=True, capture_output=True, text=True).stdout.strip()
                     for flag in ([], ["--runtime-key"]))

    venv, house = keys(pyproject, env)
    assert keys(pyproject, env) == (venv, house)
    tool = keys(pyproject.replace('"pytest==', '"pytest-other==1.0",\n    "pytest=='), env)
    assert tool[0] != venv and tool[1] == house
    runtime = keys(pyproject.replace('"tqdm==', '"tqdm-other==1.0",\n    "tqdm=='), env)
    assert runtime[0] != venv and runtime[1] != house
    pip = versions.values()["PIN_PIP"]
    assert keys(pyproject, env.replace(f"PIN_PIP={pip}", "PIN_PIP=1.0"))[1] != house
    assert keys(pyproject, env + "\n# a comment\n")[1] == house
