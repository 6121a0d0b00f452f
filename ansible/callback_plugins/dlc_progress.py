"""Show how far a long transfer is, under its task: the node_image role ships images asynchronously
and its shipper (roles/node_image/files/dlc_ship.py) keeps one line per node in
$DLC_PROGRESS_DIR/<node>; an async poll prints that line, the first one and then at most one every
PRINT_EVERY_S per node (the role polls more often: docker_ship_poll_s), so a long transfer shows a
line every few seconds however often Ansible asks (dlcluster/lifecycle.py sets the folder)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: dlc_progress
type: notification
short_description: print a shipping task's progress line at each async poll
description: reads $DLC_PROGRESS_DIR/<host>, written by the node_image role's shipper
"""


PRINT_EVERY_S = 10


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "notification"
    CALLBACK_NAME = "dlc_progress"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self):
        super().__init__()
        self.printed_at: dict[str, float] = {}  # node -> when its line was last printed (this task)

    def v2_playbook_on_task_start(self, task, is_conditional):
        self.printed_at.clear()  # each shipping task's first poll shows its line

    def v2_runner_on_async_poll(self, result):
        folder = os.environ.get("DLC_PROGRESS_DIR")
        host = result._host.get_name()
        if not folder or time.monotonic() - self.printed_at.get(host, -PRINT_EVERY_S) < PRINT_EVERY_S:
            return
        try:
            line = (Path(folder) / host).read_text().strip()
        except OSError:
            return
        if line:
            self.printed_at[host] = time.monotonic()
            self._display.display(f"  {line}")
