"""The steps' fixtures: `ctx` (the cluster record, the command line, the job client and this
step's deadline, handed over by dlcluster/smoke/run.py through the config's stash) and, from the report
plugin, `details` (what the report keeps of the step)."""

from __future__ import annotations

import time

import pytest

from dlcluster.smoke.lib import CONTEXT, TIMEOUTS, Context


@pytest.fixture
def ctx(request: pytest.FixtureRequest) -> Context:
    """The run's Context with this step's deadline: its TIMEOUTS entry times --timeout-factor.
    Jobs still running then are stopped and the step fails with their last lines."""
    c = request.config.stash[CONTEXT]
    step = request.node.originalname.removeprefix("test_")
    c.deadline = time.monotonic() + TIMEOUTS[step] * c.args.timeout_factor
    return c
