"""Print the cache key of the project's environment, or (--requirements) what it installs, or
(--runtime) only what the jobs need on a cluster node (no test tools), or (--runtime-key) the key
of that runtime alone: the wheelhouse's, which images install from.

Each key changes exactly when what it names changes: the virtualenv's, the Python version and the
pinned requirements in pyproject.toml (runtime + dev); the wheelhouse's, the Python version, the
runtime pins and what versions.env pins of its other files (pip, the Horovod sdist), so a new
test tool neither collects the wheelhouse again nor rebuilds an image.
"""

import hashlib
import sys
import tomllib
from pathlib import Path

root = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(root))
from trainkit import versions  # noqa: E402  (the standard library only: runs before any venv)

project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
reqs = project["dependencies"] + project["optional-dependencies"]["dev"]
# versions.env's lines for the wheelhouse's other files
WHEELHOUSE_PINS = ("PIN_PIP", "PIN_HOROVOD", "PIN_HOROVOD_SDIST_SHA256")


def key(*parts: str) -> str:
    return hashlib.sha256("\n".join([sys.version.split()[0], *parts]).encode()).hexdigest()[:16]


if "--runtime" in sys.argv:
    print(" ".join(project["dependencies"]))
elif "--requirements" in sys.argv:
    print(" ".join(reqs))
elif "--runtime-key" in sys.argv:
    pins = versions.values(root / "versions.env")
    print(key(*project["dependencies"], *sorted(f"{name}={pins[name]}" for name in WHEELHOUSE_PINS)))
else:
    print(key(*reqs))
