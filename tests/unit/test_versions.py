"""versions.env is the one place for each version and default path: no other file of the
repository spells one of its values, and every name in it is read somewhere."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from trainkit import versions

REPO = Path(__file__).resolve().parents[2]
# prose may name a version for its reader; a patch is for one version; results and recorded
# answers are data
NOT_CODE = ("*.md", "patches/*", "tests/bench/results/*", "tests/unit/recorded/*")


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
