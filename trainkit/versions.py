"""versions.env, the one place for each version and default path, for Python code on the control
host (the Makefile, the scripts, docker/Dockerfile and Ansible read the same file)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

FILE = Path(__file__).resolve().parents[1] / "versions.env"


@functools.cache
def values(path: Path = FILE) -> dict[str, str]:
    """NAME -> value of every `NAME=value` line (comments and blank lines skipped)."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.partition("=")
            found[name] = value
    return found


def cache_dir() -> Path:
    """$DLC_CACHE, else its default under the home folder."""
    return Path(os.environ.get("DLC_CACHE") or Path.home() / values()["DEFAULT_CACHE_IN_HOME"])
