#!/usr/bin/env python3
"""Each role variable's description is written once: as the comment above it in the role's
defaults/main.yml, where kubespray-style readers look for it. This script copies that comment into
the variable's `description` in the role's meta/argument_specs.yml, which ansible-doc and Ansible's
own argument check (run when the role starts) read; everything else in the spec (its header,
short_description, the options' order, their types) is hand-written and left byte for byte.

A variable's comment: the `#` lines at column 0 directly above it, `# ` stripped, joined with
single spaces. Variables that follow one another with no blank or comment line between them are
a group, and the comment above the group's first describes each of them (e.g. ray's ports). A
blank line ends a comment (a file's or a section's header above one is not part of it).

scripts/role_docs.py          rewrite the out-of-date spec files, print which
scripts/role_docs.py --check  print one line per out-of-date description and exit 1 (make lint)
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
ROLES = REPO / "ansible" / "roles"
WIDTH = 110  # the spec files' wrap, indentation included
OPTION = re.compile(r"^ {6}(\w+):\n(?: {8,}\S.*\n)*", re.M)  # a declared option and its keys
DESCRIPTION = re.compile(r"^ {8}description:.*\n(?: {10,}\S.*\n)*", re.M)


def comments(defaults: Path) -> dict[str, str]:
    """Each variable of a defaults file, with the comment that describes it (see above)."""
    found: dict[str, str] = {}
    block: list[str] = []
    group = ""
    for line in defaults.read_text().splitlines():
        if line.startswith("#"):
            block.append(line[1:])
            group = ""
        elif not line.strip() or line == "---":
            block, group = [], ""
        elif match := re.match(r"(\w+):", line):
            if block:
                group, block = " ".join(" ".join(block).split()), []
            if group:
                found[match[1]] = group
        # else: a line of the value above (indented, or a list item)
    return found


def described(text: str) -> str:
    """The description key of a spec option, a folded scalar wrapped at WIDTH."""
    body = textwrap.fill(text, WIDTH, initial_indent=" " * 10, subsequent_indent=" " * 10,
                         break_long_words=False, break_on_hyphens=False)
    return f"        description: >-\n{body}\n"


def generate(role: Path, problems: list[str]) -> tuple[str, str, list[str]]:
    """The role's spec text as it is, as it should be, and the variables whose descriptions differ."""
    spec = role / "meta/argument_specs.yml"
    old = spec.read_text()
    docs = comments(role / "defaults/main.yml") if (role / "defaults/main.yml").exists() else {}
    stale: list[str] = []

    def option(match: re.Match[str]) -> str:
        name, block = match[1], match[0]
        if name not in docs:
            problems.append(f"role_docs: {spec.relative_to(REPO)}: {name} has no comment above it in "
                            "defaults/main.yml: write one there")
            return block
        new = described(docs[name])
        assert yaml.safe_load(textwrap.dedent(new))["description"] == docs[name], name  # round trip
        if DESCRIPTION.search(block):
            new = DESCRIPTION.sub(lambda _: new, block, count=1)
        else:
            new = block + new
        if new != block:
            stale.append(name)
        return new

    return old, OPTION.sub(option, old), stale


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print("usage: scripts/role_docs.py [--check]", file=sys.stderr)
        return 2
    problems: list[str] = []
    for role in sorted(p for p in ROLES.iterdir() if (p / "meta/argument_specs.yml").exists()):
        spec = role / "meta/argument_specs.yml"
        old, new, stale = generate(role, problems)
        if check:
            problems += [f"role_docs: {spec.relative_to(REPO)}: {name}'s description differs from its "
                         "comment in defaults/main.yml: run scripts/role_docs.py" for name in stale]
        elif new != old:
            spec.write_text(new)
            print(f"role_docs: wrote {spec.relative_to(REPO)}")
    for line in problems:
        print(line)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
