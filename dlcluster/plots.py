"""matplotlib for the figures people would rather look at than read (`make bench`, the smoke's
baseline comparison): pinned in pyproject.toml, so requirements.lock and the virtualenv hold it."""

from __future__ import annotations


def pyplot():
    """matplotlib.pyplot on the Agg backend (files, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
