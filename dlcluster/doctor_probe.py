"""What `make doctor` asks one node: run there as root (`sudo python3 -`, the system's Python, the
standard library only), one JSON object on stdout. dlcluster/doctor.py compares the nodes' answers.

    python3 - '{"do": "check", "runtime": "host", "ip": "10.0.0.11", "name": "node-1",
                "storage": "/srv/dlcluster/runs", "marker": ".dlc-doctor-<id>", "gpus": 0}' < doctor_probe.py

"do" is one of
    check       read everything the doctor compares (it writes and removes one file of its own on
                the shared storage, as Ray's account)
    mark        the head's marker on the shared storage: written ("text") or removed ("text": "")
    drain       on the head: Ray's GCS told to drain "node_id" ("reason")
    quarantine  the quarantine file written ("reason"): Ray's unit will not start
    stop        Ray's service stopped, once the drained raylet has gone
    release     the quarantine file removed and Ray restarted
"""

import grp
import json
import os
import pwd
import re
import shutil
import ssl
import subprocess
import sys
import time

RAY_ENV = "/etc/dlcluster/ray.env"
TOKEN = "/etc/dlcluster/ray_token"
QUARANTINE = "/etc/dlcluster/quarantine"  # make doctor QUARANTINE=1: Ray's unit will not start
COLLECTIVE = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
PACKAGES = ("ray", "torch", "horovod", "tensorflow", "tensorflow-cpu")
VERSIONS = f"""
import json, platform
from importlib import metadata
out = {{"python": platform.python_version()}}
for p in {PACKAGES!r}:
    try:
        out[p] = metadata.version(p)
    except metadata.PackageNotFoundError:
        pass
print(json.dumps(out))
"""


def run(*cmd, timeout=30):
    """(exit code, stdout + stderr stripped); 127 when the command is missing, 124 on timeout. A
    process stuck past its time (a hung NFS mount) is killed and left, never waited for."""
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except OSError as e:
        return 127, str(e)
    try:
        out = p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        p.kill()
        return 124, f"no answer in {timeout} s"
    return p.returncode, out.strip()


def as_user(uid, gid):
    """The command prefix that runs the rest as uid:gid (nothing for root)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"] if uid else []


def env_file(path):
    out = {}
    try:
        with open(path) as f:
            for line in f:
                k, sep, v = line.strip().partition("=")
                if sep and not k.startswith("#"):
                    out[k] = v
    except OSError:
        pass
    return out


def raylet():
    """(pid, uid, gid, environ) of the node's raylet (also one inside Ray's container), else None."""
    rc, out = run("pgrep", "-x", "raylet")
    if rc != 0 or not out:
        return None
    pid = out.split()[0]
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(e.decode(errors="replace").partition("=")[::2] for e in f.read().split(b"\0") if e)
    except OSError:
        return None
    return int(pid), int(status["Uid"].split()[0]), int(status["Gid"].split()[0]), environ


def versions(runtime, settings):
    """The Python and packages Ray's processes use (a docker node: inside Ray's container)."""
    if runtime == "docker":
        rc, image = run("docker", "inspect", "-f", "{{.Image}}", "dlc-ray")
        out = {"image": image if rc == 0 else None}
        rc, tf_python = run("docker", "exec", "dlc-ray", "sh", "-c", "echo ${DLC_TF_PYTHON:-}")
        pythons = [["docker", "exec", "dlc-ray", "python"]]
        if rc == 0 and tf_python:
            pythons.append(["docker", "exec", "dlc-ray", tf_python])
    else:
        out = {}
        pythons = [[os.path.join(venv_bin(settings), "python")]]
        if settings.get("DLC_TF_PYTHON"):
            pythons.append([settings["DLC_TF_PYTHON"]])
    for i, python in enumerate(pythons):
        rc, text = run(*python, "-c", VERSIONS, timeout=60)
        try:
            found = json.loads(text.splitlines()[-1])
        except (ValueError, IndexError):
            out.setdefault("error", f"{' '.join(python)}: {text[-300:]}")
            continue
        if i == 0:
            out.update(found)
        else:  # the TensorFlow environment: its TensorFlow only
            out.update({k: v for k, v in found.items() if k.startswith("tensorflow")})
    if "tensorflow-cpu" in out:
        out.setdefault("tensorflow", out.pop("tensorflow-cpu"))
    return out


def interfaces(ip):
    rc, text = run("ip", "-j", "addr", "show")
    try:
        links = json.loads(text) if rc == 0 else []
    except ValueError:
        links = []
    for link in links:
        for a in link.get("addr_info", []):
            if a.get("local") == ip:
                return {"name": link["ifname"], "mtu": link.get("mtu")}
    return None


STORAGE = r"""
import json, os, sys
path, marker, name = sys.argv[1:4]
try:
    with open(os.path.join(path, marker)) as f:
        seen = f.read()
except OSError as e:
    seen = None
mine = os.path.join(path, marker + "." + name)
try:
    with open(mine, "w") as f:
        f.write(name)
    os.remove(mine)
    written = ""
except OSError as e:
    written = str(e)
st = os.statvfs(path)
print(json.dumps([seen, written, st.f_bavail * st.f_frsize]))
"""


def storage(path, marker, node, user):
    """The shared storage as Ray's account sees it: the head's marker, a file written, free bytes.
    In a child process with a time limit: a stale NFS mount hangs whoever touches it."""
    out = {"path": path, "exists": None}
    target = path
    while not os.path.exists(target) and target not in ("/", ""):
        target = os.path.dirname(target)  # what holds the missing folder
    rc, mount = run("findmnt", "-n", "-o", "TARGET,FSTYPE,SOURCE", "--target", target, timeout=10)
    out["mount"] = mount if rc == 0 else None
    rc, text = run(*as_user(*user), sys.executable, "-c", STORAGE, path, marker, node, timeout=15)
    if rc == 124:
        out["stale"] = text
        return out
    try:
        seen, written, free = json.loads(text.splitlines()[-1])
    except (ValueError, IndexError):  # the path is missing, or the child failed: say what it said
        out["exists"] = os.path.isdir(path)
        out["error"] = (text.splitlines() or [""])[-1][-300:]
        return out
    out.update(exists=True, marker=seen, write_error=written, free=free)
    return out


def free(path):
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def clock():
    rc, virt = run("systemd-detect-virt", "--container")
    rc_sync, synced = run("timedatectl", "show", "-p", "NTPSynchronized", "--value")
    return {"container": virt if rc == 0 and virt != "none" else None,
            "synchronized": synced if rc_sync == 0 else None}


def module_version(text):
    """The loaded NVIDIA kernel module's version from /proc/driver/nvidia/version."""
    m = re.search(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else None


def gpu(runtime, image):
    try:
        with open("/proc/driver/nvidia/version") as f:
            out = {"module": module_version(f.read())}
    except OSError:
        out = {"module": None}
    libs = [n for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib/aarch64-linux-gnu")
            if os.path.isdir(d) for n in os.listdir(d) if re.match(r"libnvidia-ml\.so\.\d+\.", n)]
    out["library"] = sorted(n.split(".so.", 1)[1] for n in libs)[-1] if libs else None
    rc, text = run("nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader", timeout=30)
    out["nvml"] = {"rc": rc, "out": text[-300:]}
    if runtime == "docker" and image:
        rc, text = run("docker", "run", "--rm", "--gpus", "all", "--network", "none", "--entrypoint",
                       "nvidia-smi", image, "-L", timeout=120)
        out["container"] = {"rc": rc, "out": text[-300:]}
    return out


def ray_user(proc, path):
    """(uid, gid) of Ray's processes: the raylet's, else the shared storage's owner."""
    if proc:
        return proc[1:3]
    try:
        st = os.stat(path)
        return st.st_uid, st.st_gid
    except (OSError, TypeError):
        return 0, 0


MARK = r"""
import os, sys
path, text = sys.argv[1:3]
if text:
    with open(path + ".new", "w") as f:
        f.write(text)
    os.replace(path + ".new", path)
elif os.path.exists(path):
    os.remove(path)
"""


def mark(ask):
    """The head's marker on the shared storage, written (ask["text"]) or removed (""), as Ray's account."""
    user = ray_user(raylet(), ask["storage"])
    rc, text = run(*as_user(*user), sys.executable, "-c", MARK,
                   os.path.join(ask["storage"], ask["marker"]), ask["text"], timeout=15)
    return {"rc": rc, "out": text[-300:]}


def venv_bin(settings):
    """A host-runtime node's virtualenv: the first folder of PATH in Ray's environment (roles/ray)."""
    return settings.get("PATH", "").split(":")[0]


def ray_command(runtime, settings):
    """The Ray command line Ray's own processes use on this node."""
    if runtime == "docker":
        return ["docker", "exec", "dlc-ray", "ray"]
    return [os.path.join(venv_bin(settings), "ray")]


def drain(ask):
    """On the head: Ray's GCS told to drain a node (no new work there; what runs there finishes,
    then its raylet exits and, quarantined, stays down), with the token Ray's processes have."""
    proc = raylet()
    cmdline = ""
    if proc:
        with open(f"/proc/{proc[0]}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace").replace("\0", " ")
    m = re.search(r"--gcs-address=(\S+)", cmdline)
    if not m:
        return {"rc": 1, "out": "no raylet with a --gcs-address on the head"}
    settings = env_file(RAY_ENV)
    os.environ.update({k: v for k, v in settings.items() if k.startswith("RAY_")})
    rc, out = run(*ray_command(ask["runtime"], settings), "drain-node", "--address", m.group(1),
                  "--node-id", ask["node_id"], "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                  "--reason-message", ask["reason"], timeout=60)
    return {"rc": rc, "out": out[-300:]}


def quarantine(ask):
    """The quarantine file written: Ray's unit will not start here."""
    with open(QUARANTINE + ".new", "w") as f:
        f.write(ask["reason"] + "\n")
    os.replace(QUARANTINE + ".new", QUARANTINE)
    return {"rc": 0, "out": ""}


def stop_or_release(ask):
    """Ray's service stopped (a drained raylet exits, `ray start --block` stays) or, releasing,
    the quarantine file removed and Ray restarted. Only on a quarantined node whose raylet has
    gone: 3 while the raylet still runs the work it was drained of, 4 when not quarantined."""
    if not os.path.exists(QUARANTINE):
        return {"rc": 4, "out": "it is not quarantined"}
    if raylet():
        return {"rc": 3, "out": "Ray still runs there: the work it was drained of has not ended"}
    if ask["do"] == "release":
        os.remove(QUARANTINE)
    rc, out = run("systemctl", "stop" if ask["do"] == "stop" else "restart", "dlc-ray", timeout=120)
    return {"rc": rc, "out": out[-300:]}


def tls(settings, ip):
    """Ray's TLS certificate on this node (RAY_USE_TLS in Ray's environment; roles/ray tls.yml):
    whether it is the cluster CA's, for this node's address, and the days until it ends."""
    if settings.get("RAY_USE_TLS") != "1":
        return None
    cert, ca = settings.get("RAY_TLS_SERVER_CERT", ""), settings.get("RAY_TLS_CA_CERT", "")
    rc, text = run("openssl", "verify", "-CAfile", ca, cert)
    # openssl's reason is its "error N at D depth lookup: ..." line; its last line only names the file
    why = [ln for ln in text.splitlines() if "depth lookup" in ln] or text.splitlines()[-1:] or [f"rc {rc}"]
    out = {"verified": rc == 0, "problem": "" if rc == 0 else why[0][-200:]}
    rc, end = run("openssl", "x509", "-in", cert, "-noout", "-enddate")
    out["days_left"] = ((ssl.cert_time_to_seconds(end.split("=", 1)[1]) - time.time()) / 86400
                        if rc == 0 and end.startswith("notAfter=") else None)
    rc, san = run("openssl", "x509", "-in", cert, "-noout", "-ext", "subjectAltName")
    out["for_address"] = rc == 0 and re.search(rf"IP Address:{re.escape(ip)}(,|$)", san, re.M) is not None
    return out


def main():
    ask = json.loads(sys.argv[1])
    act = {"mark": mark, "drain": drain, "quarantine": quarantine, "stop": stop_or_release,
           "release": stop_or_release, "check": check}[ask["do"]]
    print(json.dumps(act(ask)))


def check(ask):
    """Everything the doctor compares, as this node sees it."""
    settings = env_file(RAY_ENV)
    proc = raylet()
    rc, service = run("systemctl", "is-active", "dlc-ray")
    rc, fw = run("systemctl", "show", "-p", "LoadState", "-p", "ActiveState", "dlc-firewall")
    fw = dict(line.split("=", 1) for line in fw.splitlines() if "=" in line)
    rc, rules = run("iptables", "-S", "INPUT")
    try:
        st = os.stat(TOKEN)
        token = {"owner": pwd.getpwuid(st.st_uid).pw_name, "group": grp.getgrgid(st.st_gid).gr_name,
                 "mode": "%04o" % (st.st_mode & 0o7777)}
    except (OSError, KeyError) as e:
        token = {"error": str(e)}
    user = ray_user(proc, ask.get("storage"))
    docker_root = None
    if ask["runtime"] == "docker":
        rc, text = run("docker", "info", "-f", "{{.DockerRootDir}}")
        docker_root = text if rc == 0 else None
    try:
        with open(QUARANTINE) as f:
            quarantined = f.read().strip() or "no reason given"
    except OSError:
        quarantined = None
    out = {
        "quarantine": quarantined,
        "service": service,
        "raylet": proc is not None,
        "firewall": {"load": fw.get("LoadState"), "active": fw.get("ActiveState"),
                     "chain": "-j DLC-INPUT" in rules},
        "token": token,
        "tls": tls(settings, ask["ip"]),
        "interface": interfaces(ask["ip"]),
        "collective": {"file": {k: settings.get(k) for k in COLLECTIVE},
                       "running": {k: proc[3].get(k) for k in COLLECTIVE} if proc else None},
        "versions": versions(ask["runtime"], settings),
        "storage": storage(ask["storage"], ask["marker"], ask["name"], user) if ask.get("storage") else None,
        "free": {"tmp": free("/tmp"), "docker": free(docker_root) if docker_root else None},
        "clock": clock(),
    }
    if ask.get("gpus"):
        out["gpu"] = gpu(ask["runtime"], out["versions"].get("image"))
    return out


if __name__ == "__main__":
    main()
