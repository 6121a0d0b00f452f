"""Show how far a long transfer is, under its task: the docker role ships images asynchronously
and its shipper (roles/docker/files/dlc_ship.py) keeps one line per node in
$DLC_PROGRESS_DIR/<node>; each async poll prints that line (scripts/cluster.sh sets the folder)."""

from __future__ import annotations

import os
from pathlib import Path

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: dlc_progress
type: notification
short_description: print a shipping task's progress line at each async poll
description: reads $DLC_PROGRESS_DIR/<host>, written by the docker role's shipper
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "notification"
    CALLBACK_NAME = "dlc_progress"
    CALLBACK_NEEDS_ENABLED = True

    def v2_runner_on_async_poll(self, result):
        folder = os.environ.get("DLC_PROGRESS_DIR")
        if not folder:
            return
        try:
            line = (Path(folder) / result._host.get_name()).read_text().strip()
        except OSError:
            return
        if line:
            self._display.display(f"  {line}")
