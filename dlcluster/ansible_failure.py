"""The one line that says why a playbook run failed, from its log (dlcluster/lifecycle.py prints it).

Reads Ansible's output (the default callback, results as YAML), takes the last `fatal:` result
and prints `WHAT: error: [host] <its msg> (log: LOG)`; a failure before any task ran (a bad
inventory, a syntax error) prints Ansible's own ERROR line instead. When some servers were
already changed before the run stopped, the line says which, so nothing is left half-configured
without saying so.
"""

import re
from pathlib import Path

import yaml


def failure(text: str) -> str | None:
    lines = text.splitlines()
    found = None
    for i, line in enumerate(lines):
        m = re.match(r"^fatal: \[([^\]]+)\]: (FAILED|UNREACHABLE)! =>\s*(.*)$", line)
        if m:
            body, j = [m.group(3)] if m.group(3).strip() else [], i + 1
            while j < len(lines) and (lines[j].startswith(" ") or not lines[j].strip()):
                body.append(lines[j])
                j += 1
            try:
                result = yaml.safe_load("\n".join(body)) or {}
            except yaml.YAMLError:
                result = {}
            msg = result.get("msg") if isinstance(result, dict) else None
            text = " ".join(str(msg or m.group(2).lower()).split())
            # the control host's checks name the host they are about in the message itself
            # (and so do messages that start with the host's name)
            found = text if m.group(1) == "localhost" or text.startswith(f"{m.group(1)}: ") \
                else f"[{m.group(1)}] {text}"
    if found:
        return found
    for line in lines:
        if line.startswith(("ERROR!", "[ERROR]")):
            text = " ".join(line.split(":", 1)[-1].split()) if line.startswith("[ERROR]") else line[7:]
            m = re.search(r"parse inventory source (\S+)", text)
            if m:
                text += f"; `ansible-inventory -i {m.group(1)} --list` shows where"
            return text
    return None


def changed_hosts(text: str) -> dict[str, int]:
    """Servers (not the control host) with changes in the PLAY RECAP: host -> number changed."""
    out = {}
    for m in re.finditer(r"^(\S+)\s+: ok=\d+\s+changed=(\d+)", text, re.M):
        if m.group(1) != "localhost" and int(m.group(2)) > 0:
            out[m.group(1)] = int(m.group(2))
    return out


def summary(log: Path, what: str) -> str:
    """`WHAT: error: [host] <its msg> (log: LOG)`, and the servers changed before it stopped."""
    text = log.read_text(errors="replace")
    line = failure(text) or "the playbook failed"
    changed = changed_hosts(text)
    if changed:
        done = ", ".join(f"{h} ({n} changes)" for h, n in changed.items())
        line += (f"; already changed before it stopped: {done}; once fixed, run it again: it "
                 f"continues where it stopped")
    return f"{what}: error: {line} (log: {log})"
