"""Print the cache key of the project's environment, or (--requirements) what it installs, or
(--runtime) only what the jobs need on a cluster node (no test tools).

The key changes exactly when what the environment holds changes: the Python version and the
pinned requirements in pyproject.toml (runtime + dev).
"""

import hashlib
import sys
import tomllib
from pathlib import Path

root = Path(__file__).resolve().parents[1]
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
reqs = project["dependencies"] + project["optional-dependencies"]["dev"]

if "--runtime" in sys.argv:
    print(" ".join(project["dependencies"]))
elif "--requirements" in sys.argv:
    print(" ".join(reqs))
else:
    text = "\n".join([sys.version.split()[0], *reqs])
    print(hashlib.sha256(text.encode()).hexdigest()[:16])
