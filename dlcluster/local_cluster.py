"""The embedded default cluster: a Ray head and worker nodes as separate `ray start` processes.

    python -m dlcluster.local_cluster up [--nodes 2] [--cpus-per-node N]   (make cluster-up)
    python -m dlcluster.local_cluster status                                (make cluster-status)
    python -m dlcluster.local_cluster down                                  (make cluster-down)

Each node has its own temp dir (and so its own sockets, logs and object store; 0700); the
dashboard and job API listen on 127.0.0.1 only, and Ray's token auth is on: the token lives in
$DLC_CONFIG/clusters/local/ray_token (mode 0600, outside git). People reach them through the
cluster's gateway (gateway/, as on a cluster's head) at DASHBOARD_PORT, with the cluster's token
(an operator) or their own credential (`dlcluster user add`); Ray's own dashboard listens on a
port of its own, and the gateway's records and logs stay in the cluster's folder across `down`.
`down` stops only the processes this cluster started (found by its temp dirs), never other Ray
clusters on the host (`ray stop` would kill them all).

Where a `prometheus` binary is on PATH (e.g. the distribution's package), `up` also runs one as
this user on 127.0.0.1:METRICS_PORT, scraping every node's Ray metrics (Ray's own and the jobs'
training metrics) through the service-discovery file Ray writes in the head's temp dir; its data
lives in the temp root and goes with `down`. Without one, a line says how to get it.

`up` writes the cluster record (dlcluster/record.py) to $DLC_CONFIG/clusters/local/ and makes it
current ($DLC_CONFIG/cluster.json, ray-client.env): kind "local", ip null for every node (Ray
shows the host's address for all of them), no ssh_config or bastion. `down` removes the current
record only when it is this local cluster's.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NoReturn

from dlcluster import record, services

CONFIG = record.config_dir()
LOCAL = CONFIG / "clusters" / "local"  # laid out like every other cluster's folder
RAY = str(Path(sys.executable).parent / "ray")
HOST = "127.0.0.1"
TRACKING_USER = "dlc"
TRACKING_AUTH_INI = """[mlflow]
default_permission = NO_PERMISSIONS
database_uri = sqlite:///{db}
admin_username = {user}
admin_password = {password}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
auth_cache_ttl_seconds = 60
"""
# auth_cache_ttl_seconds: how long the server trusts a password it has checked (MLflow's own cache;
# roles/tracking's tracking_auth_cache_seconds): without it every request pays a scrypt check, 0.3 s
# of CPU on a 2-core machine. Its one worker forgets a password changed through it at once, and one
# changed here (serve-tracking) comes with a new server.


def fail(msg: str) -> NoReturn:
    print(f"local_cluster: error: {msg}", file=sys.stderr)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    """Bad flags: one line that names the fix (its subcommands' parsers are of this class too)."""

    def error(self, message: str) -> NoReturn:
        fail(message.split(": ", 1)[-1] + "; see make help")


def secret(name: str, make=lambda: secrets.token_hex(32)) -> Path:
    """A secret of the cluster's: made once (mode 0600) in its private folder, never printed."""
    LOCAL.mkdir(parents=True, exist_ok=True)
    LOCAL.chmod(0o700)
    path = LOCAL / name
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(make())
    path.chmod(0o600)
    return path


def token() -> Path:
    """The cluster's Ray token."""
    return secret("ray_token")


def tracking_auth() -> Path:
    """The tracking server's one account, `user:password` (MLflow's basic auth)."""
    return secret("tracking_auth", lambda: f"{TRACKING_USER}:{secrets.token_hex(24)}")


def state_file() -> Path:
    """What `up` started (kept before anything starts, so `down` cleans up a failed start)."""
    old = CONFIG / "local-cluster.json"  # where clusters started before clusters/local/ keep it
    return old if old.exists() else LOCAL / "state.json"


def the_record(st: dict) -> record.ClusterRecord:
    """The record of the local cluster in `st` (the state file's content)."""
    nodes = [record.Node(name="head" if i == 0 else f"node{i}", ip=None,
                         role="head" if i == 0 else "worker", cpus=st["cpus_per_node"], gpus=0)
             for i in range(st["nodes"])]
    return record.ClusterRecord(name="local", kind="local", job_api=st["dashboard"],
                                metrics_url=st.get("metrics"), token_path=str(token()), nodes=nodes,
                                tracking_url=st.get("tracking"),
                                tracking_auth_path=str(tracking_auth()) if st.get("tracking") else None)


def forget(st: dict) -> None:
    """Remove the current record if it is this local cluster's (not one an Ansible run wrote)."""
    for folder in (CONFIG, LOCAL):
        try:
            current = json.loads((folder / record.RECORD).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(current, dict) and current.get("kind") == "local" and \
                current.get("job_api") == st["dashboard"]:
            (folder / record.RECORD).unlink(missing_ok=True)
            (folder / record.CLIENT_ENV).unlink(missing_ok=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


def cluster_pids(temp_root: str, gcs_port: int | None = None) -> list[int]:
    """This cluster's processes: those whose command line names its temp root (GCS, raylets,
    dashboard, monitors), the head's Ray Client server (it names only the GCS address and is
    re-parented to init), and all their descendants (workers, agents, job drivers)."""
    children: dict[int, list[int]] = {}
    found: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
        client_server = gcs_port and "ray.util.client.server" in cmd and any(
            arg.startswith("--address=") and arg.endswith(f":{gcs_port}") for arg in cmd.split())
        if (temp_root in cmd or client_server) and int(entry.name) != os.getpid():
            found.append(int(entry.name))
    todo, seen = list(found), set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo += children.get(pid, [])
    return sorted(seen)


def own_hostname(name: str, temp_dir: str) -> list[str]:
    """A command prefix that gives a node its own hostname, as separate machines have.

    Horovod on Ray groups workers by hostname and refuses two Ray nodes with one name, so each
    worker node runs in its own UTS namespace with its own name, and a mount namespace whose
    /etc/hosts resolves that name to loopback (gloo looks its own hostname up). The network is
    shared. Needs root; without it the nodes share the host's name and Horovod jobs must fit
    on one node.
    """
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return []
    hosts = Path(temp_dir) / "etc-hosts"
    hosts.parent.mkdir(parents=True, exist_ok=True)
    hosts.write_text(Path("/etc/hosts").read_text() + f"\n{HOST} {name}\n")
    script = 'hostname "$0" && mount --bind "$1" /etc/hosts && shift && exec "$@"'
    return ["unshare", "--uts", "--mount", "sh", "-c", script, name, str(hosts)]


def run_ray(args: list[str], env: dict[str, str], prefix: list[str] | None = None) -> None:
    proc = subprocess.run([*(prefix or []), RAY, *args], env={**os.environ, **env},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        fail(f"`ray {args[0]} {args[1]}` failed: {' | '.join(tail)}; `make cluster-down` cleans up")


def wait_for_nodes(gcs: str, expected: int, env: dict[str, str], logs: str,
                   timeout: float = 120) -> list[dict]:
    os.environ.update(env)
    import ray

    ray.init(address=gcs, logging_level="ERROR", log_to_driver=False)
    try:
        from ray._private.ray_constants import KV_NAMESPACE_DASHBOARD
        from ray.dashboard.consts import DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX
        from ray.experimental.internal_kv import _internal_kv_get

        deadline = time.time() + timeout
        while True:
            nodes = [n for n in ray.nodes() if n["Alive"]]
            # A node takes jobs once its dashboard agent has registered (else the job API
            # answers "No available agent to submit job").
            # An agent whose HTTP port is taken stays alive but never registers: its
            # dashboard_agent.log says "Failed to start HTTP server".
            missing = [n["NodeManagerHostname"] for n in nodes if not _internal_kv_get(
                DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX + n["NodeID"], namespace=KV_NAMESPACE_DASHBOARD)]
            if len(nodes) >= expected and not missing:
                return nodes
            if time.time() > deadline:
                fail(f"{len(nodes)} of {expected} nodes joined within {timeout:.0f} s, and the "
                     f"dashboard agent of {', '.join(missing) or 'none'} did not register; see "
                     f"dashboard_agent.log under {logs}/*/session_latest/logs, then "
                     f"`make cluster-down`")
            time.sleep(1)
    finally:
        ray.shutdown()


PROMETHEUS_CONFIG = """\
# written by dlcluster/local_cluster.py: every node's Ray metrics, from the file Ray keeps on the head
global:
  scrape_interval: 5s
scrape_configs:
  - job_name: ray
    file_sd_configs:
      - files: [{sd}]
"""


def start_prometheus(temp_root: str, port: int) -> str | None:
    """Prometheus over this cluster's nodes, as this user, on 127.0.0.1:port; its URL, or None
    (with one line saying why). Its command line names the temp root: `down` stops it with the rest."""
    binary = shutil.which("prometheus")
    if binary is None:
        print("metrics: no prometheus on PATH, so no Prometheus for the local cluster (apt-get install "
              "prometheus, or put its binary on PATH, then make cluster-down cluster-up); an Ansible "
              "cluster's head runs one (docs/metrics.md)")
        return None
    if port_in_use(port):
        print(f"metrics: port {port} (METRICS_PORT) is in use on {HOST}: no Prometheus for the local "
              f"cluster; set METRICS_PORT to a free port")
        return None
    folder = Path(temp_root) / "prometheus"
    folder.mkdir()
    config = folder / "prometheus.yml"
    config.write_text(PROMETHEUS_CONFIG.format(
        sd=json.dumps(f"{temp_root}/head/prom_metrics_service_discovery.json")))
    with open(folder / "prometheus.log", "wb") as log:
        subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={folder}/data",
                          f"--web.listen-address={HOST}:{port}"], stdout=log, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://{HOST}:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    print(f"metrics: Prometheus at {url} (its graph, /targets), over every node's "
                          "Ray metrics")
                    return url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    print(f"metrics: Prometheus did not start within 30 s (see {folder}/prometheus.log); the cluster "
          f"runs without it")
    return None


def start_tracking(port: int) -> subprocess.Popen | None:
    """MLflow's tracking server (basic auth on) as this user on 127.0.0.1:port, its runs in SQLite
    and its artifacts in this cluster's folder (both kept across `down`); started, not yet
    answering (`tracking_ready`). None, with one line, where the port is taken."""
    if port_in_use(port):
        print(f"tracking: port {port} (TRACKING_PORT) is in use on {HOST}: no run history for the "
              f"local cluster; set TRACKING_PORT to a free port")
        return None
    user, password = tracking_auth().read_text().strip().split(":", 1)  # (makes the cluster's folder)
    folder = LOCAL / "mlflow"
    folder.mkdir(mode=0o700, exist_ok=True)
    ini = folder / "basic_auth.ini"  # the admin's password is read when the server first starts
    fd = os.open(ini, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(TRACKING_AUTH_INI.format(db=folder / "basic_auth.db", user=user, password=password))
    env = {**os.environ, "MLFLOW_AUTH_CONFIG_PATH": str(ini),
           "MLFLOW_FLASK_SERVER_SECRET_KEY": secret("tracking_flask_key").read_text(),
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # its job runner: 7 processes, unused here
    log = open(folder / "server.log", "ab")  # noqa: SIM115  (the server's, for its whole life)
    # through `serve-tracking`: the auth database's password made the file's first, then the server
    return subprocess.Popen(
        [sys.executable, "-m", "dlcluster.local_cluster", "serve-tracking", "--",
         str(Path(sys.executable).parent / "mlflow"), "server", "--app-name", "basic-auth",
         "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
         "--artifacts-destination", str(folder / "artifacts"),
         "--host", HOST, "--port", str(port), "--workers", "1"],
        cwd=Path(__file__).resolve().parents[1],  # the checkout: where `-m` finds this module
        env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def serve_tracking(a: argparse.Namespace) -> None:
    """The tracking server's process: its account's password in the auth database made the one in
    the cluster's password file (MLflow sets it only when it first makes the account, so a password
    file made anew, e.g. after it was deleted, left every job refused: 401), then the server itself
    (exec: the same process, so `down` stops it as before)."""
    user, password = tracking_auth().read_text().strip().split(":", 1)
    db = LOCAL / "mlflow" / "basic_auth.db"
    if db.exists():
        from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

        store = SqlAlchemyStore()
        store.init_db(f"sqlite:///{db}")
        if store.has_user(user, use_primary=True) and not store.authenticate_user(user, password,
                                                                                  use_primary=True):
            store.update_user(user, password=password)
            print(f"tracking: {user}'s password in {db} set to the cluster's ({tracking_auth()})", flush=True)
    os.execv(a.server[0], a.server)


def tracking_ready(proc: subprocess.Popen, port: int, timeout: float = 90) -> str | None:
    """The tracking server's URL once it answers; None (one line) if it does not in time."""
    url = f"http://{HOST}:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    print(f"tracking: MLflow at {url} (sign in: make tracking-password), runs in "
                          f"{LOCAL / 'mlflow'}")
                    return url
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    print(f"tracking: MLflow did not start within {timeout:.0f} s (see {LOCAL / 'mlflow' / 'server.log'}); "
          "the cluster runs without run history")
    stop_group(proc.pid)
    return None


def start_gateway(port: int, ray_dashboard: str) -> subprocess.Popen:
    """The cluster's gateway (gateway/, as on a cluster's head) on 127.0.0.1:port, the one door to
    Ray's dashboard at `ray_dashboard`; its database and the jobs' logs in this cluster's folder
    (kept across `down`, as a head's disk keeps them)."""
    folder = LOCAL / "gateway"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    log = open(folder / "server.log", "ab")  # noqa: SIM115  (the server's, for its whole life)
    return subprocess.Popen(
        [sys.executable, "-m", "gateway", "--listen", f"{HOST}:{port}", "--upstream", ray_dashboard,
         "--token-file", str(token()), "--data", str(folder)],
        cwd=Path(__file__).resolve().parents[1], stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True)


def gateway_ready(proc: subprocess.Popen, port: int, timeout: float = 30) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if port_in_use(port):
            return
        time.sleep(0.2)
    fail(f"the gateway did not start on {HOST}:{port} (see {LOCAL / 'gateway' / 'server.log'}); "
         f"`make cluster-down`, then `make cluster-up`")


def gateway_alive(st: dict) -> bool:
    try:
        os.killpg(st["gateway_pid"], 0)
    except (KeyError, TypeError, ProcessLookupError, PermissionError):
        return False
    return port_in_use(int(st["dashboard"].rsplit(":", 1)[1]))


def stop_group(pid: int | None) -> None:
    """Stop a process started in a session of its own, and every process of that session."""
    if not pid:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def tracking_alive(st: dict) -> bool:
    try:
        with urllib.request.urlopen(f"{st['tracking']}/health", timeout=2) as r:
            return r.status == 200
    except (KeyError, TypeError, urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def up(a: argparse.Namespace) -> None:
    if state_file().exists():
        st = json.loads(state_file().read_text())
        if cluster_pids(st["temp_root"]):
            if st.get("ray_dashboard") and not gateway_alive(st):  # a gateway that died: again
                stop_group(st.get("gateway_pid"))
                port = int(st["dashboard"].rsplit(":", 1)[1])
                gateway = start_gateway(port, st["ray_dashboard"])
                st["gateway_pid"] = gateway.pid
                state_file().write_text(json.dumps(st, indent=2) + "\n")
                gateway_ready(gateway, port)
            if st.get("tracking_port") and not tracking_alive(st):  # a server that died: again
                stop_group(st.get("tracking_pid"))
                if proc := start_tracking(st["tracking_port"]):
                    st.update(tracking=tracking_ready(proc, st["tracking_port"]), tracking_pid=proc.pid)
                state_file().write_text(json.dumps(st, indent=2) + "\n")
            the_record(st).write(CONFIG)
            print(f"local cluster already running: {st['dashboard']} ({st['nodes']} nodes); "
                  f"`make cluster-down` first to change it")
            return
        state_file().unlink()
    for port, what in ((a.port, "GCS (RAY_PORT)"), (a.dashboard_port, "dashboard (DASHBOARD_PORT)")):
        if port_in_use(port):
            fail(f"port {port} for the {what} is in use on {HOST}; stop what holds it or pick "
                 f"another port")
    cpus = a.cpus_per_node or max(1, (os.cpu_count() or 1) // a.nodes)
    gcs = f"{HOST}:{a.port}"
    # The nodes run this virtualenv's Python, and so does a job's `python` entrypoint.
    # RAY_ADDRESS pins every process of this cluster to it: with two clusters on one host, Ray's
    # own helpers (e.g. Train's PlacementGroupCleaner) otherwise find both and give up.
    # Ray's log monitor looks for new log files every 0.5 s, not on each 0.1 s pass (as on servers:
    # roles/ray's ray.env)
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token()),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "RAY_ADDRESS": gcs,
           "DLC_CLUSTER_NAME": "local", "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0"}
    # sockets, logs and object store: this user's only (0700), under a name no one can guess or
    # make first; the state file records it for `down` and `status`
    temp_root = tempfile.mkdtemp(prefix=f"dlc-{a.port}-", dir="/tmp")
    common = ["--node-ip-address", HOST, "--num-cpus", str(cpus), "--disable-usage-stats",
              "--object-store-memory", str(a.object_store_mb * 1024 * 1024)]
    # Recorded before anything starts, so `down` can clean up after a start that failed half-way.
    # People reach Ray through the gateway at DASHBOARD_PORT; Ray's own dashboard listens on a port
    # of its own, its token the gateway's and the operator's alone
    ray_dashboard_port = free_port()
    state = {"gcs": gcs, "dashboard": f"http://{HOST}:{a.dashboard_port}", "nodes": a.nodes,
             "cpus_per_node": cpus, "temp_root": temp_root, "tracking_port": a.tracking_port,
             "ray_dashboard": f"http://{HOST}:{ray_dashboard_port}"}
    tracking = start_tracking(a.tracking_port)  # it starts while Ray does
    state["tracking_pid"] = tracking.pid if tracking else None
    state_file().write_text(json.dumps(state, indent=2) + "\n")
    # every Ray process of the cluster (job drivers and workers inherit it) finds the run history
    env.update({"DLC_TRACKING_URL": f"http://{HOST}:{a.tracking_port}",
                "DLC_TRACKING_AUTH": str(tracking_auth())} if tracking else {})
    print(f"starting head node on {gcs} ({cpus} CPUs)", flush=True)
    run_ray(["start", "--head", "--port", str(a.port), "--dashboard-host", HOST,
             "--dashboard-port", str(ray_dashboard_port), "--include-dashboard", "true",
             "--ray-client-server-port", str(free_port()),
             "--dashboard-agent-listen-port", "0",
             "--temp-dir", f"{temp_root}/head",
             *common], env)
    gateway = start_gateway(a.dashboard_port, state["ray_dashboard"])
    state["gateway_pid"] = gateway.pid
    state_file().write_text(json.dumps(state, indent=2) + "\n")
    for i in range(1, a.nodes):
        print(f"starting worker node {i} ({cpus} CPUs, no GPUs)", flush=True)
        run_ray(["start", "--address", gcs, "--temp-dir", f"{temp_root}/node{i}",
                 "--dashboard-agent-listen-port", "0", "--num-gpus", "0",
                 *common], env,
                prefix=own_hostname(f"{socket.gethostname()}-node{i}", f"{temp_root}/node{i}"))
    nodes = wait_for_nodes(gcs, a.nodes, env, temp_root)
    gateway_ready(gateway, a.dashboard_port)
    state["metrics"] = start_prometheus(temp_root, a.metrics_port)
    state["tracking"] = tracking_ready(tracking, a.tracking_port) if tracking else None
    state_file().write_text(json.dumps(state, indent=2) + "\n")
    written = the_record(state).write(CONFIG)
    total = sum(n["Resources"].get("CPU", 0) for n in nodes)
    print(f"local Ray cluster up: {len(nodes)} nodes, {total:g} CPUs; dashboard and job API at "
          f"{state['dashboard']} (the gateway: the cluster's token or a person's credential, "
          f"dlcluster user add)")
    print(f"client env: source {CONFIG / record.CLIENT_ENV}")
    print(f"cluster record: {written}, current as {CONFIG / record.RECORD}")


def down(_: argparse.Namespace) -> None:
    if not state_file().exists():
        print("no local cluster recorded; nothing to stop")
        return
    st = json.loads(state_file().read_text())
    port = int(st["gcs"].rsplit(":", 1)[1])
    stop_group(st.get("tracking_pid"))
    stop_group(st.get("gateway_pid"))
    pids = cluster_pids(st["temp_root"], port)
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait
        while time.time() < deadline and (pids := cluster_pids(st["temp_root"], port)):
            time.sleep(0.3)
        if not pids:
            break
    if pids:
        fail(f"processes {pids} of the local cluster would not stop")
    shutil.rmtree(st["temp_root"], ignore_errors=True)
    forget(st)
    state_file().unlink()
    print(f"local Ray cluster at {st['gcs']} stopped")


def status(_: argparse.Namespace) -> None:
    if not state_file().exists():
        fail("no local cluster is running; start one with `make cluster-up`")
    st = json.loads(state_file().read_text())
    if not cluster_pids(st["temp_root"]):
        fail(f"the local cluster at {st['gcs']} is recorded but not running; "
             f"`make cluster-down` then `make cluster-up`")
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token())}
    print(f"dashboard / job API: {st['dashboard']}   GCS: {st['gcs']}   auth: token "
          f"({CONFIG / record.CLIENT_ENV})")
    sys.stdout.flush()
    proc = subprocess.run([RAY, "status", "--address", st["gcs"]], env={**os.environ, **env})
    sys.exit(proc.returncode)


def make_var(name: str, default: int, low: int, high: int | None = None):
    """A Make variable's argparse type and default: a bad value is one line naming the variable."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}={text} is not a whole number") from None
        if n < low or (high is not None and n > high):
            where = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{name}={n} must be {where}")
        return n

    return {"type": parse, "default": os.environ.get(name) or str(default)}


def main(argv: list[str] | None = None) -> None:
    p = _Parser(prog="local_cluster", description=(__doc__ or "").split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="start the head and worker nodes")
    u.add_argument("--nodes", **make_var("NODES", 2, 1, 64))
    u.add_argument("--cpus-per-node", help="default: this machine's cores / nodes, at least 1",
                   **make_var("CPUS_PER_NODE", 0, 0, 4096))
    u.add_argument("--object-store-mb", **make_var("OBJECT_STORE_MB", 512, 78))
    u.add_argument("--port", **make_var("RAY_PORT", 6379, 1024, 65535))
    port = {s.make_var: s.default for s in services.services()}  # the tunnel's defaults, the same ports
    u.add_argument("--dashboard-port", **make_var("DASHBOARD_PORT", port["DASHBOARD_PORT"], 1024, 65535))
    u.add_argument("--metrics-port", **make_var("METRICS_PORT", port["METRICS_PORT"], 1024, 65535))
    u.add_argument("--tracking-port", **make_var("TRACKING_PORT", port["TRACKING_PORT"], 1024, 65535))
    sub.add_parser("down", help="stop the nodes `up` started")
    sub.add_parser("status", help="nodes and resources")
    t = sub.add_parser("serve-tracking", help="(up starts it) the tracking server, its password in step")
    t.add_argument("server", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.cmd == "serve-tracking":
        a.server = a.server[1:] if a.server[:1] == ["--"] else a.server
        if not a.server:
            fail("serve-tracking needs the server's command after --, e.g. serve-tracking -- "
                 ".venv/bin/mlflow server ... (make cluster-up runs it so)")
    if a.cmd == "up" and a.port == a.dashboard_port:
        fail(f"RAY_PORT and DASHBOARD_PORT are both {a.port}; give them different ports")
    {"up": up, "down": down, "status": status, "serve-tracking": serve_tracking}[a.cmd](a)


if __name__ == "__main__":
    main()
