"""Turn a failed `ssh` into one line that names the host, the problem and the fix.

Used by roles/control_host (preflight of the bastion and every node before anything changes);
tests/unit/test_ansible_filters.py covers each case.
"""


_TELLING = ("open failed", "connect to host", "Permission denied", "Could not resolve", "timed out",
            "Connection refused", "No route to host")


def _last_line(stderr: str) -> str:
    """The line of ssh's stderr that says most: the first telling one, else the last."""
    lines = [ln.strip() for ln in (stderr or "").splitlines()
             if ln.strip() and not ln.startswith(("Warning: Permanently added", "@@@"))]
    for ln in lines:
        if any(t in ln for t in _TELLING):
            return ln
    return lines[-1] if lines else "ssh failed without a message"


def ssh_problem(stderr: str, host: str, addr: str, user: str, key: str, known_hosts: str,
                via: str = "", pinned: bool = False) -> str:
    """One line for a failed `ssh host true`: what went wrong and what to do about it.
    `pinned`: the inventory pins the host keys (dlc_known_hosts), so none is learnt at first contact."""
    err = stderr or ""
    where = f"{host} ({user}@{addr}{', through ' + via if via else ''})"
    if pinned and "host key is known for" in err:
        return (f"{where}: dlc_known_hosts pins no host key for it, and with pinned keys none is "
                f"taken on trust; add its line (`ssh-keyscan {addr}` from a trusted network, its "
                f"fingerprint compared with the server's console) and run again")
    if pinned and "Host key verification failed" in err:
        return (f"{where}: its host key is not the one dlc_known_hosts pins: someone may be in "
                f"the way; if the server was really reinstalled, pin its new key and run again")
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" in err or "Host key verification failed" in err:
        return (f"{where}: its host key is not the one recorded at first contact in {known_hosts}; "
                f"if that server was really reinstalled, forget the old key with "
                f"`ssh-keygen -R {addr} -f {known_hosts}` and run again")
    if "Permission denied" in err:
        return (f"{where}: the key {key} is not accepted for {user} ({_last_line(err)}); "
                f"check dlc_ssh_key and ansible_user in the inventory")
    if any(s in err for s in ("Could not resolve hostname", "Name or service not known")):
        return f"{where}: the name does not resolve ({_last_line(err)}); check ansible_host"
    if any(s in err for s in ("timed out", "No route to host", "Connection refused",
                              "Network is unreachable", "Connection closed", "Connection reset")):
        return (f"{where}: unreachable ({_last_line(err)}); check that it is up, its address and "
                f"port in the inventory, and the network{' behind the bastion' if via else ''}")
    if "No such file" in err and key in err:
        return f"{where}: the key {key} does not exist; set dlc_ssh_key in the inventory"
    return f"{where}: ssh failed: {_last_line(err)}"


def ssh_problems(results: list, hostvars: dict, key: str, known_hosts: str, via: str,
                 default_user: str, pinned: bool = False) -> list:
    """ssh_problem() for every failed item of a looped `ssh <node> true` (register.results)."""
    out = []
    for r in results:
        if r.get("rc", 1) == 0:
            continue
        host = r["item"]
        hv = hostvars[host]
        addr = str(hv.get("ansible_host", host))
        user = str(hv.get("ansible_user", default_user))
        out.append(ssh_problem(r.get("stderr", "") or r.get("msg", ""), host, addr, user, key,
                               known_hosts, via, pinned))
    return out


class FilterModule:
    def filters(self):
        return {"dlc_ssh_problem": ssh_problem, "dlc_ssh_problems": ssh_problems}
