"""Every value an inventory sets, checked before any host is touched: one line per problem, naming
the host, the variable and the fix.

Used by roles/inventory_checks (`groups['ray_nodes'] | dlc_inventory_problems(hostvars, bastion)`), which
stops the run on the first line; tests/unit/test_inventory.py holds a table of bad inventories.
Only what the inventory sets is checked here: the roles' defaults are valid by construction.

Each variable's type (and choices) is declared once, in its role's meta/argument_specs.yml, which
Ansible also checks when the role starts: here every declared int, float, bool, list and dict is
checked before any host is touched, every declared int named *_port is a port. What an argument
spec cannot say stays here: ranges, patterns, addresses, networks and rules across variables.
"""

import functools
import ipaddress
import re
from pathlib import Path

import yaml

ROLES = Path(__file__).resolve().parent.parent / "roles"

RUNTIMES = ("docker", "host")
STORAGES = ("nfs", "path")
IMAGE_SOURCES = ("bastion", "registry", "archive", "control")
# variables that must be absolute paths on the nodes; they go into unit files (ExecStart, Where=),
# the exports, `docker run -v` and shell commands, so each is one word of plain characters
PATHS = ("dlc_shared_storage_path", "dlc_venv", "ray_state_dir", "ray_temp_dir", "ray_home",
         "docker_image_dir", "dlc_registry_dir", "ray_tls_dir", "ray_tls_ca_dir", "tracking_tls_dir")
PATH = re.compile(r"/[A-Za-z0-9._+@/-]*")
# whole numbers >= low ("" means "Ray decides" for the resources: their specs say raw)
NUMBERS = {"ray_num_cpus": 0, "ray_num_gpus": 0, "ray_object_store_memory": 78643200,
           "dlc_ray_user_uid": 1, "ray_join_timeout": 1, "ray_upgrade_drain_timeout": 1,
           "ray_remove_timeout": 1, "dlc_registry_keep": 1, "ray_tls_days": 2,
           "ray_tls_renew_days": 1, "ray_tls_ca_days": 2,
           "docker_ship_poll_s": 1}  # (0 would make the image's shipping fire and forget)
# checked by the rules below in words of their own, not by their declared type alone
OWN_RULES = ("dlc_ray_runtime", "docker_image_from", "dlc_shared_storage", "firewall_public_tcp_ports",
             "ray_start_extra_args", "nvidia_unattended_upgrades_blacklist")
KINDS = {"int": "a whole number", "float": "a number", "bool": "true or false, unquoted",
         "list": "a list, such as [a, b]", "dict": "a mapping, such as {key: value}"}
# `ray start` flags (a list, one item per argument): each item is quoted where it is used (the
# unit's ExecStart, the container's shell), so JSON such as '{"nvme": 1}' stays one argument; no
# quote, `$`, `%`, backslash or line break, which systemd or the shell would still read
EXTRA_ARG = re.compile(r'[A-Za-z0-9 {}":,._=/+@\[\]-]*')
# the cluster's name: its folder under $DLC_CONFIG/clusters and a word in the ssh config
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")

# values written into the ssh config and command lines as one word: no spaces, newlines, quotes
# or `#` that could end the word and start a directive (`ProxyCommand ...`) or a command
WORDS = ("ansible_host", "ansible_user", "dlc_ssh_user", "dlc_ssh_key", "dlc_ssh_gateway", "dlc_image",
         "docker_image_archive")
WORD = re.compile(r"[A-Za-z0-9._~/@:+%=,\[\]-]+")
# Ray's account: a POSIX account name (the run history's login too: it goes into a shell and a
# Python string when its password is set; and the account its server runs as)
ACCOUNT = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
ACCOUNTS = ("dlc_ray_user", "dlc_tracking_user", "dlc_tracking_jobs_user", "tracking_service_user")
# PostgreSQL's names for the run history (its account and databases): SQL identifiers, unquoted
SQL_NAMES = ("tracking_db_user", "tracking_db", "tracking_auth_db")
SQL_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
# URLs written into every node's ray.env (KEY=VALUE lines): a scheme, a host and a port, a path
URLS = ("dlc_tracking_page_url",)
URL = re.compile(r"https?://[A-Za-z0-9.\[\]:-]+(/[A-Za-z0-9._~/-]*)?")
# the run history's name on the cluster's network (dlc_tracking_name): DNS labels
DNS_NAME = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*")
# images pulled onto the nodes by reference and run as root: pinned by digest (a tag can move)
PINNED_IMAGES = ("metrics_dcgm_exporter_image",)
PINNED = re.compile(r"[a-z0-9][a-z0-9._/:-]*@sha256:[0-9a-f]{64}")


@functools.cache
def declared() -> dict[str, tuple[str, dict]]:
    """Every role variable's declaration: name -> (role, its option in meta/argument_specs.yml)."""
    out = {}
    for path in sorted(ROLES.glob("*/meta/argument_specs.yml")):
        options = yaml.safe_load(path.read_text())["argument_specs"]["main"].get("options") or {}
        out.update({name: (path.parts[-3], option) for name, option in options.items()})
    return out


def port_names() -> list[str]:
    """Every declared port (an int named *_port) and ssh's."""
    ints = (name for name, (_, option) in declared().items() if option["type"] == "int")
    return ["ansible_port", *(name for name in ints if name.endswith("_port"))]


def _is(kind: str, value) -> bool:
    if kind == "int":
        return _whole(value) is not None
    if kind == "float":
        try:
            float(value)
        except (TypeError, ValueError):
            return False
        return not isinstance(value, bool)
    return isinstance(value, {"bool": bool, "list": list, "dict": dict}[kind])


def type_problems(host: str, hv) -> list:
    """A value of another type than its role declares (meta/argument_specs.yml), or not one of its
    choices: one line each."""
    out = []
    for name, (role, option) in declared().items():
        if name not in hv or name in OWN_RULES or name in NUMBERS or name.endswith("_port"):
            continue
        try:
            value, kind = hv[name], option["type"]
        except Exception:  # noqa: BLE001 - a template this play cannot resolve (see _value)
            continue
        if kind in KINDS and not _is(kind, value):
            out.append(f"{host}: {name} is {value!r}: give {KINDS[kind]} "
                       f"(roles/{role}/meta/argument_specs.yml)")
        elif "choices" in option and str(value) not in map(str, option["choices"]):
            out.append(f"{host}: {name} is {value!r}: give one of {', '.join(map(str, option['choices']))} "
                       f"(roles/{role}/meta/argument_specs.yml)")
    return out


def _value(hv, name):
    """hv[name], or None when absent or when it is a template this play cannot resolve (one that
    names a role's default): the inventory_checks role passes such values resolved, as `cluster`."""
    try:
        return str(hv[name]) if name in hv else None  # str(): Ansible may template only now
    except Exception:  # noqa: BLE001 - Ansible's undefined-variable errors vary by version
        return None


def word_problems(host: str, hv, names=WORDS) -> list:
    out = []
    for name in names:
        value = _value(hv, name)
        if value is not None and str(value) != "" and not WORD.fullmatch(str(value)):
            out.append(f"{host}: {name} is {str(value)!r}: it goes into the ssh config and "
                       f"commands as one word, so it may hold no spaces, quotes, `#` or line breaks")
    for name in ACCOUNTS:
        user = _value(hv, name)
        if user is not None and not ACCOUNT.fullmatch(str(user)):
            out.append(f"{host}: {name} is {str(user)!r}: an account name is lower "
                       f"case letters, digits, _ and -, starting with a letter or _")
    for name in SQL_NAMES:
        value = _value(hv, name)
        if value is not None and not SQL_NAME.fullmatch(str(value)):
            out.append(f"{host}: {name} is {str(value)!r}: PostgreSQL takes it unquoted, so use lower "
                       f"case letters, digits and _, starting with a letter or _")
    for name in URLS:
        value = _value(hv, name)
        if value is not None and not URL.fullmatch(str(value)):
            out.append(f"{host}: {name} is {str(value)!r}: a URL such as http://127.0.0.1:5000 (a scheme, "
                       f"a host, a port; no spaces, quotes or line breaks)")
    for name in PINNED_IMAGES:
        value = _value(hv, name)
        if value is not None and not PINNED.fullmatch(str(value)):
            out.append(f"{host}: {name} is {str(value)!r}: pin it by digest, NAME:TAG@sha256:<64 hex "
                       f"digits> (`docker buildx imagetools inspect NAME:TAG` prints it; a copy in "
                       f"your registry keeps it): it runs as root with the GPUs, and a tag can be "
                       f"pushed again")
    return out


def private_address(host: str, hv) -> str:
    """A node's address on the private network: `ip`, else ansible_host, else its name."""
    return str(hv.get("ip", hv.get("ansible_host", host)))


def private_addresses(hosts: list[str], hostvars) -> dict[str, str]:
    """host -> its private address, for plays on the control host (roles/cluster_defaults's dlc_node_ip is a
    node's own variable: the control host's play cannot read it through hostvars)."""
    return {h: private_address(h, hostvars[h]) for h in hosts}


def _whole(value) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    text = str(value).strip()
    return int(text) if text.isdigit() else None


def host_problems(host: str, hv) -> list:
    out = word_problems(host, hv)
    addr = private_address(host, hv)
    try:
        ipaddress.IPv4Address(addr)
    except ValueError:
        out.append(f"{host}: its private address '{addr}' (`ip`, else ansible_host) is not an IPv4 "
                   f"address: set `ip: <its address on the nodes' network>` on it")
    if "dlc_ray_runtime" in hv and hv["dlc_ray_runtime"] not in RUNTIMES:
        out.append(f"{host}: dlc_ray_runtime is '{hv['dlc_ray_runtime']}': set docker (Ray in the "
                   f"project's image) or host (Ray in a virtualenv on the node)")
    if "docker_image_from" in hv and str(hv["docker_image_from"]) not in IMAGE_SOURCES:
        out.append(f"{host}: docker_image_from is '{hv['docker_image_from']}': set bastion (pushed "
                   f"once to a registry on the bastion, the nodes pull it), registry (the nodes pull "
                   f"dlc_image from your registry), archive (docker_image_archive streamed to each node) or "
                   f"control (this machine's Docker engine streams dlc_image through the bastion)")
    if str(hv.get("docker_image_from", "")) == "archive" and not str(hv.get("docker_image_archive", "")):
        out.append(f"{host}: docker_image_from is archive but docker_image_archive is empty: set it to "
                   f"a `docker save` archive on this machine, or docker_image_from: control")
    if "dlc_shared_storage" in hv and hv["dlc_shared_storage"] not in STORAGES:
        out.append(f"{host}: dlc_shared_storage is '{hv['dlc_shared_storage']}': set nfs (the head "
                   f"exports it) or path (a filesystem you already share)")
    for name in PATHS:
        if name not in hv:
            continue
        if not str(hv[name]).startswith("/"):
            out.append(f"{host}: {name} is '{hv[name]}', not an absolute path: give the full path "
                       f"on the node, such as /srv/dlcluster")
        elif not PATH.fullmatch(str(hv[name])):
            out.append(f"{host}: {name} is {str(hv[name])!r}: it goes into unit files and commands "
                       f"as one word, so use letters, digits and . _ - + @ / only (no spaces)")
    for name, low in NUMBERS.items():
        if name in hv and str(hv[name]).strip() != "":
            n = _whole(hv[name])
            if n is None or n < low:
                out.append(f"{host}: {name} is '{hv[name]}': it must be a whole number of at least "
                           f"{low}{' (or leave it out: Ray counts them)' if low == 0 else ''}")
    for name in port_names():
        if name in hv:
            n = _whole(hv[name])
            if n is None or not 1 <= n <= 65535:
                out.append(f"{host}: {name} is '{hv[name]}': a port is a whole number from 1 to 65535")
    if "firewall_public_tcp_ports" in hv:
        ports = hv["firewall_public_tcp_ports"]
        if not isinstance(ports, list) or any(not 1 <= (_whole(p) or 0) <= 65535 for p in ports):
            out.append(f"{host}: firewall_public_tcp_ports is {ports!r}: give a list of ports from 1 "
                       f"to 65535, such as [22]")
    out.extend(extra_args_problems(host, hv))
    held = hv.get("nvidia_unattended_upgrades_blacklist", [])
    if not isinstance(held, list) or any(not isinstance(p, str) or re.search(r'["\\;{}\n]', p) for p in held):
        out.append(f"{host}: nvidia_unattended_upgrades_blacklist is {held!r}: give a list of package "
                   f"name patterns without quotes, backslashes, ; or braces (they go into an apt setting)")
    out.extend(type_problems(host, hv))
    days, renew = _whole(hv.get("ray_tls_days", 825)), _whole(hv.get("ray_tls_renew_days", 30))
    if days is not None and renew is not None and renew >= days:
        out.append(f"{host}: ray_tls_renew_days {renew} is not below ray_tls_days {days}: every run would "
                   f"make new certificates and restart Ray; renew well before the end, e.g. 30 of 825")
    lo, hi = _whole(hv.get("ray_min_worker_port", 10002)), _whole(hv.get("ray_max_worker_port", 19999))
    if lo is not None and hi is not None and lo >= hi:
        out.append(f"{host}: ray_min_worker_port {lo} is not below ray_max_worker_port {hi}: give "
                   f"Ray a range of worker ports")
    return out


def extra_args_problems(host: str, hv) -> list:
    if "ray_start_extra_args" not in hv:
        return []
    args = hv["ray_start_extra_args"]
    if not isinstance(args, list) or not all(isinstance(a, (str, int)) and not isinstance(a, bool)
                                             for a in args):
        return [f"{host}: ray_start_extra_args is {args!r}: give a list with one item per argument, "
                f"such as [\"--resources\", '{{\"nvme\": 1}}']"]
    bad = [a for a in map(str, args) if not EXTRA_ARG.fullmatch(a)]
    return [f"{host}: ray_start_extra_args item {a!r} holds a quote, $, %, backslash or line break, "
            f"which the unit file or the shell would read: give the value without them" for a in bad]


def cidr_problems(nodes: list, hostvars) -> list:
    """firewall_private_cidr, where set: a network (no host bits), no wider than a private network
    can be (/8), and holding every node's private address (the nodes must reach each other)."""
    out = []
    addresses = {h: private_address(h, hostvars[h]) for h in nodes}
    for host in nodes:
        text = str(hostvars[host].get("firewall_private_cidr", "") or "")
        if not text:
            continue
        try:
            net = ipaddress.IPv4Network(text, strict=False)
        except ValueError:
            out.append(f"{host}: firewall_private_cidr is '{text}', not an IPv4 network: give the "
                       f"private network as address/prefix, such as 10.0.0.0/24")
            continue
        if ipaddress.IPv4Interface(text).ip != net.network_address:
            out.append(f"{host}: firewall_private_cidr is '{text}', an address, not a network: "
                       f"did you mean {net}?")
        elif net.prefixlen < 8:
            out.append(f"{host}: firewall_private_cidr is '{text}': that lets {net.num_addresses:,} "
                       f"addresses reach every port of the nodes; give the nodes' private network, "
                       f"such as 10.0.0.0/24 (or leave it out: the network of the node's `ip`)")
        else:
            outside = [f"{h} ({a})" for h, a in addresses.items()
                       if _ip(a) is not None and _ip(a) not in net]
            if outside:
                out.append(f"{host}: firewall_private_cidr {text} leaves out {', '.join(outside)}, "
                           f"which the firewall would then refuse: give the network that holds "
                           f"every node's `ip`")
    return out


def extra_source_problems(nodes: list, hostvars) -> list:
    """firewall_private_extra_sources, where set: a list of IPv4 addresses (each goes into the
    firewall's rules, a root shell script)."""
    out = []
    for host in nodes:
        sources = hostvars[host].get("firewall_private_extra_sources", []) or []
        if not isinstance(sources, list):
            out.append(f"{host}: firewall_private_extra_sources is '{sources}', not a list: give IPv4 "
                       f"addresses as a YAML list, such as [10.0.0.5]")
            continue
        bad = [str(s) for s in sources if _ip(str(s)) is None]
        if bad:
            out.append(f"{host}: firewall_private_extra_sources holds {', '.join(map(repr, bad))}, not an "
                       f"IPv4 address: give each address alone, such as 10.0.0.5 (no network, no name)")
    return out


def _ip(text: str):
    try:
        return ipaddress.IPv4Address(text)
    except ValueError:
        return None


def merged(lines: list) -> list:
    """The same problem on several hosts (a value set for all of them) as one line naming them."""
    hosts: dict = {}
    for line in lines:
        host, _, what = line.partition(": ")
        hosts.setdefault(what, []).append(host)
    return [f"{', '.join(dict.fromkeys(h))}: {what}" for what, h in hosts.items()]


def tracking_name_problems(name: str, hosts: list) -> list:
    """The run history's name (dlc_tracking_name): a DNS name, and no server's: every node's certificate
    names its server (roles/ray), and a job reads its node's key."""
    if not DNS_NAME.fullmatch(name) or name.rstrip(".").count(".") == 0:
        return [f"all: dlc_tracking_name is {name!r}: the run history's name on the cluster's network "
                f"is a DNS name of two labels or more, such as run-history.dlcluster.internal "
                f"(lower case letters, digits, - and .)"]
    if name in {str(h).lower() for h in hosts}:
        return [f"all: dlc_tracking_name is {name!r}, a server's name: that server's certificate names "
                f"it too, and its key (which jobs read) could pose as the run history: choose a name "
                f"no server has, such as run-history.dlcluster.internal"]
    return []


def inventory_problems(nodes: list, hostvars, bastion: str, cluster: dict | None = None) -> list:
    """Every problem of the nodes (and the bastion's port and address), in inventory order.
    `cluster`: cluster-wide values as the play resolved them (checked once, as `all`)."""
    out = word_problems("all", cluster or {}) if cluster else []
    config = (cluster or {}).get("dlc_config")
    if config is not None and not WORD.fullmatch(str(config)):
        out.append(f"all: DLC_CONFIG is {str(config)!r}: it goes into the ssh config and commands as one "
                   f"word, so it may hold no spaces, quotes, `#` or line breaks: choose another folder")
    name = (cluster or {}).get("dlc_cluster_name")
    if name is not None and not NAME.fullmatch(str(name)):
        out.append(f"all: the cluster's name is {str(name)!r} (dlc_cluster_name, else the inventory's "
                   f"folder): use letters, digits, . _ - (a folder under $DLC_CONFIG/clusters)")
    tracking = (cluster or {}).get("dlc_tracking_name")
    if tracking is not None:
        out.extend(tracking_name_problems(str(tracking), [*nodes, bastion]))
    seen = {}
    for host in [*nodes, bastion]:  # into certificates (a root shell's -subj), /etc/hosts, the ssh config
        if not NAME.fullmatch(str(host)):
            out.append(f"{host!r}: a server's name in the inventory goes into its certificate, /etc/hosts "
                       f"and the ssh config: use letters, digits, . _ - (its address goes in ansible_host)")
    resolved = {k: (cluster or {}).get(k)
                for k in ("dlc_ray_user", "dlc_tracking_user", "dlc_tracking_jobs_user")}
    for host in nodes:
        hv = hostvars[host]
        out.extend(host_problems(host, hv))
        # as the play resolved them (the roles' defaults too), else as the inventory sets them
        ray, admin, jobs = (str(v) if v is not None else _value(hv, k) for k, v in resolved.items())
        if admin is not None and admin == jobs:  # the role would set the administrator's password
            out.append(f"{host}: dlc_tracking_jobs_user is {jobs}, the run history's administrator "
                       f"(dlc_tracking_user): the jobs need an account of their own, which every node "
                       f"holds and which may not administer the run history: set another name")
        if hv.get("ray_tls") is False and hv.get("dlc_tracking") is not False:
            out.append(f"{host}: ray_tls is false, and the run history (dlc_tracking) takes its TLS "
                       f"certificate from the cluster's CA, which ray_tls makes: set ray_tls: true, or "
                       f"dlc_tracking: false")
        if ray is not None and _value(hv, "tracking_service_user") == str(ray):
            out.append(f"{host}: tracking_service_user is {ray}, Ray's account (dlc_ray_user): the run "
                       f"history needs an account of its own, so that jobs cannot read its database "
                       f"password or rewrite its artifacts: set another name")
        addr = private_address(host, hv)
        if addr in seen:
            out.append(f"{host}: its private address {addr} is also {seen[addr]}'s: give each node "
                       f"its own `ip` (and ansible_host)")
        seen.setdefault(addr, host)
    out.extend(cidr_problems(nodes, hostvars))
    out.extend(extra_source_problems(nodes, hostvars))
    bv = hostvars[bastion]
    out.extend(word_problems(bastion, bv, ("ansible_host", "ansible_user")))
    if "ansible_port" in bv and (_whole(bv["ansible_port"]) or 0) not in range(1, 65536):
        out.append(f"{bastion}: ansible_port is '{bv['ansible_port']}': a port is a whole number "
                   f"from 1 to 65535")
    if "ip" in bv:
        try:
            ipaddress.IPv4Address(str(bv["ip"]))
        except ValueError:
            out.append(f"{bastion}: its private address '{bv['ip']}' (`ip`) is not an IPv4 address: "
                       f"set it to the bastion's address on the nodes' network")
    return merged(out)


class FilterModule:
    def filters(self):
        return {"dlc_inventory_problems": inventory_problems, "dlc_private_addresses": private_addresses}
