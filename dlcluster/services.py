"""The services an operator reaches through the ssh tunnel, as the one list declares them
(ansible/roles/cluster_defaults/defaults/main.yml: `dlc_services`), for the operator's side: each service's
Make variable and its default (the default of its tunnel variable there), checked and handed to
Ansible by dlcluster/lifecycle.py: tunnel_ends(), the tunnel's local ends from the environment (the
Make variables, else their defaults), each checked, or a UserError naming the problem.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from trainkit.errors import UserError

DEFAULTS = Path(__file__).resolve().parents[1] / "ansible/roles/cluster_defaults/defaults/main.yml"


@dataclass(frozen=True)
class Service:
    name: str
    make_var: str  # the Make variable of the tunnel's local end on the control host
    local_port: str  # roles/cluster_defaults's variable that dlcluster/lifecycle.py sets to it
    head_port: str  # the variable of the head's port
    enabled: tuple[str, ...]  # the variables that turn it on, all of them (none: always on)
    record: str  # the cluster record's URL field (dlcluster/record.py)
    credential: str
    default: int  # the tunnel's local end when the Make variable is not set


def services() -> list[Service]:
    defaults = yaml.safe_load(DEFAULTS.read_text())
    return [Service(s["name"], s["make_var"], s["local_port"], s["head_port"], tuple(s["enabled"]),
                    s["record"], s["credential"], int(defaults[s["local_port"]]))
            for s in defaults["dlc_services"]]


def tunnel_ends(env: Mapping[str, str] = os.environ) -> dict[str, int]:
    """Each service's tunnel variable -> its local port: the Make variable, else its default; a
    port below 1024 or not a number, or one port for two services, is a UserError naming it."""
    ends: dict[int, str] = {}
    out = {}
    for s in services():
        text = env.get(s.make_var) or str(s.default)
        if not text.isdigit() or text.startswith("0") or not 1024 <= int(text) <= 65535:
            raise UserError(f"{s.make_var}={text}: the tunnel's local end must be a port from 1024 to "
                            f"65535, free on this machine")
        port = int(text)
        if port in ends:
            raise UserError(f"{s.make_var} and {ends[port]} are both {port}: give each end of the tunnel "
                            f"its own port")
        ends[port] = s.make_var
        out[s.local_port] = port
    return out
