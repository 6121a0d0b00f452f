"""The docker_engine role's decisions for a GPU node's engine settings, from what the node holds.

Used by roles/docker_engine; tests/unit/test_ansible.py covers each case.
  daemon_json_problem:  /etc/docker/daemon.json exists but is not a JSON object: one line naming
                        the node and the fix (nothing is rewritten on top of a file nobody can read).
  needs_nvidia_runtime: the engine's settings lack the NVIDIA runtime, whether or not the file
                        exists (a daemon.json with a site's own settings still gets the runtime:
                        `nvidia-ctk runtime configure` merges it in and keeps the rest).
"""

import base64
import json

DAEMON_JSON = "/etc/docker/daemon.json"


def _settings(slurped: dict):
    """The file's settings: {} when it does not exist, None when it cannot be read as an object."""
    if "content" not in slurped:  # slurp failed (failed_when: false): missing is fine, unreadable not
        return {} if "not found" in str(slurped.get("msg", "")).lower() else None
    try:
        data = json.loads(base64.b64decode(slurped["content"]).decode() or "{}")
    except (ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def daemon_json_problem(slurped: dict, host: str) -> str:
    if _settings(slurped) is not None:
        return ""
    why = slurped.get("msg") or "it is not a JSON object"
    why = " ".join(str(why).split())[:120]
    return (f"{host}: {DAEMON_JSON} cannot be read as the engine's settings ({why}): "
            f"fix or move it away, then run again (nothing was changed on {host})")


def needs_nvidia_runtime(slurped: dict) -> bool:
    settings = _settings(slurped)
    return settings is not None and "nvidia" not in (settings.get("runtimes") or {})


class FilterModule:
    def filters(self):
        return {"dlc_daemon_json_problem": daemon_json_problem,
                "dlc_needs_nvidia_runtime": needs_nvidia_runtime}
