"""matplotlib for the figures people would rather look at than read (`make bench`, the smoke's
baseline comparison), kept out of the project's pinned environment and its images: the pins in
plot-requirements.txt are installed once under $DLC_CACHE (keyed by them and this Python), on
first use, from the package index."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
from pathlib import Path

from trainkit import versions

REQUIREMENTS = Path(__file__).with_name("plot-requirements.txt")


def site() -> Path:
    key = hashlib.sha256(REQUIREMENTS.read_bytes() + sys.version.encode()).hexdigest()[:16]
    where = versions.cache_dir() / f"bench-plot-{key}"
    if not (where / ".complete").exists():
        where.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=where.name, dir=where.parent))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp),
                        "-r", str(REQUIREMENTS)], check=True)
        (tmp / ".complete").touch()
        try:
            tmp.rename(where)
        except OSError:  # another process installed it meanwhile
            pass
    return where


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display)."""
    if str(site()) not in sys.path:
        sys.path.insert(0, str(site()))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
