"""One line for each prerequisite cluster-up checks before it changes anything.

Used by roles/control_host; tests/unit/test_ansible.py covers each case.
  bastion_problem:  a service was asked of the bastion (the package proxy) and the login there
                    has no passwordless sudo or no python3.
  package_problem:  nodes that cannot reach the package source they will use.
  account_problem:  nodes where Ray's uid or gid belongs to someone else, or Ray's account
                    exists with another uid (Ubuntu cloud images give 1000 to `ubuntu`).
  network_problem:  nodes where no interface holds the private address, the firewall's network
                    (firewall_private_cidr) is wider than the nodes' own, or the operator's
                    shared path (dlc_shared_storage: path) is missing.
"""

import ipaddress

FIX_BASTION = ("set dlc_bastion_apt_proxy: false to use the bastion as a jump host only, and give "
               "the nodes your site's proxy (dlc_apt_proxy: http://host:port) or a route out")


FIX_REGISTRY = ("set docker_image_from: control (this machine streams the image to each node through "
                "the bastion)")


def bastion_problem(result: dict, host: str, user: str, proxy: bool = True, registry: bool = False) -> str:
    """'' when `sudo -n true; command -v python3` passed on the bastion, else one line naming the
    services asked of it (the package proxy, the image registry) and how to do without each."""
    if result.get("skipped") or result.get("rc", 1) == 0:
        return ""
    out = f"{result.get('stdout', '')} {result.get('stderr', '')}"
    if "NOPYTHON" in out:
        why = "there is no python3 there, which Ansible needs to install it"
    elif "NOSUDO" in out:
        why = f"{user} has no sudo without a password there (`sudo -n true` failed)"
    else:
        why = f"the check failed: {' '.join(out.split())[:200]}"
    asked = ((["the package proxy on the bastion (dlc_bastion_apt_proxy: true)"] if proxy else [])
             + (["the image registry on the bastion (docker_image_from: bastion)"] if registry else []))
    fixes = ([FIX_BASTION] if proxy else []) + ([FIX_REGISTRY] if registry else [])
    return (f"{host}: {' and '.join(asked)} need{'s' if len(asked) == 1 else ''} root there, but {why}; "
            f"{'; '.join(fixes)}")


def package_problem(results: list, proxy: str, bastion_proxy: bool, bastion_ip: str) -> str:
    """'' when every node reached its package source, else one line naming those that did not,
    why, and the settings that would fix it."""
    failed = [r for r in results if r.get("rc", 1) != 0]
    if not failed:
        return ""
    whys = {}
    for r in failed:
        if r.get("rc") == 127:
            why = "no python3 on the node (Ansible needs it)"
        else:
            why = " ".join(str(r.get("stdout") or r.get("stderr") or "no answer").split())[:200]
        whys.setdefault(why, []).append(r["item"])
    said = "; ".join(f"{', '.join(hosts)}: {why}" for why, hosts in whys.items())
    if proxy and bastion_proxy:
        source = f"the bastion's package proxy {proxy}"
        fix = (f"the nodes must reach the bastion at {bastion_ip}: set the bastion's `ip` to its "
               f"address on the nodes' network, or use your site's proxy (dlc_apt_proxy) instead")
    elif proxy:
        source = f"the package proxy {proxy} (dlc_apt_proxy)"
        fix = ("check dlc_apt_proxy (http://host:port, reachable from the nodes), or set "
               "dlc_bastion_apt_proxy: true for a caching proxy on the bastion")
    else:
        source = "their package mirrors directly (no proxy is set)"
        fix = ("set dlc_bastion_apt_proxy: true (a caching proxy on the bastion) or dlc_apt_proxy: "
               "http://host:port (your site's proxy), or give the nodes a route out")
    hosts = sorted({h for hs in whys.values() for h in hs})
    return (f"{', '.join(hosts)} cannot reach {source} ({said}): {fix}; nothing was changed on "
            f"any node")


# What each node answers, a line each: the user with the uid, the group with the gid (as a gid
# Ray's group would get), the uid of Ray's account; empty where there is none.
ACCOUNT_PROBE = ('getent passwd "$1" | cut -d: -f1; getent group "$1" | cut -d: -f1; '
                 'id -u "$2" 2>/dev/null; true')


def account_problem(results: list, user: str, uid: int) -> str:
    """'' when Ray's account can be `user` with uid = gid = `uid` on every node, else one line."""
    problems = []
    for r in results:
        if r.get("rc", 1) != 0:
            err = " ".join(str(r.get("stderr", "")).split())[:120]
            problems.append(f"{r['item']}: the check failed ({err})")
            continue
        by_uid, by_gid, user_uid = ((r.get("stdout", "") + "\n\n\n").splitlines() + ["", "", ""])[:3]
        if user_uid and user_uid != str(uid):
            problems.append(f"{r['item']}: {user} already exists with uid {user_uid}")
        elif by_uid and by_uid != user:
            problems.append(f"{r['item']}: uid {uid} belongs to {by_uid}")
        elif by_gid and by_gid != user:
            problems.append(f"{r['item']}: gid {uid} belongs to the group {by_gid}")
    if not problems:
        return ""
    return (f"Ray's account {user} (dlc_ray_user, uid and gid {uid}, dlc_ray_user_uid) cannot be "
            f"made the same on every node: {'; '.join(problems)}: set dlc_ray_user_uid to an id free "
            f"on every node (or dlc_ray_user to the account that has it); nothing was changed on any node")


def _networks(stdout: str) -> dict:
    """address -> (interface, its network) from `ip -o -4 addr show`."""
    out = {}
    for line in stdout.splitlines():
        f = line.split()
        if len(f) >= 4 and f[2] == "inet":
            iface = ipaddress.IPv4Interface(f[3])
            out[str(iface.ip)] = (f[1], iface.network)
    return out


def network_problem(results: list, addresses: dict, settings: dict) -> str:
    """'' when every node has an interface with its private address, the firewall's network (where
    firewall_private_cidr is set) is no wider than the smallest one holding the nodes' own networks,
    and the shared path exists where the operator shares one; else one line per problem.
    results: the loop over nodes of `ip -o -4 addr show; echo storage yes|no`; settings: host ->
    {cidr, storage, path}."""
    problems, nets = [], {}
    for r in results:
        host = r["item"]
        addr, s = addresses[host], settings[host]
        if r.get("rc", 1) != 0:
            problems.append(f"{host}: could not list its addresses ({(r.get('stderr') or '').strip()[:120]})")
            continue
        found = _networks(r.get("stdout", ""))
        if addr not in found:
            problems.append(f"{host}: no interface has the address {addr} (it has "
                            f"{', '.join(sorted(found)) or 'none'}): set `ip` on this host in the "
                            f"inventory to its address on the private network")
        else:
            nets[host] = found[addr][1]
        if s.get("storage") == "path" and "storage yes" not in r.get("stdout", ""):
            problems.append(f"{host}: dlc_shared_storage_path {s.get('path')} does not exist: mount the "
                            f"shared filesystem there on every node, or set dlc_shared_storage: nfs")
    if nets:
        low = min(int(n.network_address) for n in nets.values())
        high = max(int(n.broadcast_address) for n in nets.values())
        span = next(n for n in (ipaddress.IPv4Network((low, p), strict=False) for p in range(32, -1, -1))
                    if int(n.broadcast_address) >= high)
        for host in addresses:
            cidr = settings[host].get("cidr") or ""
            if cidr and host in nets and ipaddress.IPv4Network(cidr, strict=False).prefixlen < span.prefixlen:
                problems.append(f"{host}: firewall_private_cidr {cidr} is wider than the nodes' private "
                                f"network {span}: every address in it could reach Ray's ports; give "
                                f"{span} (or leave it out)")
    merged: dict = {}
    for line in problems:
        host, _, what = line.partition(": ")
        merged.setdefault(what, []).append(host)
    return "; ".join(f"{', '.join(h)}: {what}" for what, h in merged.items())


class FilterModule:
    def filters(self):
        return {"dlc_bastion_problem": bastion_problem, "dlc_package_problem": package_problem,
                "dlc_network_problem": network_problem,
                "dlc_account_problem": account_problem, "dlc_account_probe": lambda _: ACCOUNT_PROBE}
