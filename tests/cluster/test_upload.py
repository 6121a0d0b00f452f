"""Nothing secret or local travels with a job: untracked keys, inventories and credentials dropped
into the checkout are absent where the job runs (the driver and a task on each node), so is git's
config; `make submit` uploads only what git tracks (an untracked script stays behind too);
the commit travels as data (`make submit`: DLC_SUBMIT_COMMIT) and the manifest names both it and
the content-addressed package of the code that ran. `make submit` finds the cluster through its
record (the fixture's job API is not on the default port)."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from pathlib import Path

from conftest import BIN, REPO, read_manifest

# keys and inventories (which the plain `--working-dir .` leaves behind too, by name), credentials
# by their usual names, and a script never added to git (only `make submit` leaves that behind)
DROPPED = ["id_ed25519", "ansible/inventories/mylab/hosts.yml", ".env", ".netrc", "credentials.json",
           ".aws/config", "jobs/untracked_script.py"]
PROBE = """
import json, os, ray
names = ["id_ed25519", "ansible/inventories/mylab/hosts.yml", ".env", ".netrc", "credentials.json",
         ".aws/config", ".git/config", ".git/HEAD", "jobs/ddp_autoencoder.py"]
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On
seen = lambda: (ray.get_runtime_context().get_node_id(), {n: os.path.exists(n) for n in names})
ray.init()
# one task pinned to each alive node (SPREAD is best effort: a CI run got both on one node)
nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
probes = [ray.remote(num_cpus=0, scheduling_strategy=On(n, soft=False))(seen).remote() for n in nodes]
print("SEEN " + json.dumps([seen(), *ray.get(probes)]))
"""


# what this test writes, and only it: a comment in every language the checkout's linters read (Python,
# YAML, an inventory), so a file a killed run left behind fails no lint before this test removes it
SECRET = "# a secret that must not leave this machine\n"


def test_untracked_secrets_stay_on_the_client_and_the_commit_travels_as_data(cluster, tmp_path):
    for name in DROPPED:
        if (REPO / name).is_file() and (REPO / name).read_text() == SECRET:
            (REPO / name).unlink()  # a killed earlier run's (its finally did not run)
        assert not (REPO / name).exists(), f"{name} is in the checkout: this test would remove it"
    try:
        for name in DROPPED:
            (REPO / name).parent.mkdir(parents=True, exist_ok=True)
            (REPO / name).write_text(SECRET)
        cmd = [str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{cluster.dashboard_port}",
               "--working-dir", ".", "--", "python", "-c", PROBE]
        proc = subprocess.run(cmd, cwd=REPO, env=cluster.client_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:]
        seen = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("SEEN "))[5:])
        assert len({node for node, _ in seen}) == 2, seen  # the driver's node and the other one
        for _, files in seen:
            assert files == {"id_ed25519": False, "ansible/inventories/mylab/hosts.yml": False, ".env": False,
                             ".netrc": False, "credentials.json": False, ".aws/config": False,
                             ".git/config": False, ".git/HEAD": True, "jobs/ddp_autoencoder.py": True}

        # make submit as the README shows it, DASHBOARD_PORT and RAY_PORT unset: the fixture
        # cluster's job API is on 8290, not the default, and the record says so
        out = tmp_path / "model"
        env = {k: v for k, v in cluster.env.items() if k not in ("DASHBOARD_PORT", "RAY_PORT")}
        sub = subprocess.run(["make", "--no-print-directory", "submit", "JOB=ddp_autoencoder",
                              "ARGS=--image-size 40x60 --limit 96 --batch-size 16 --epochs 1 "
                              f"--output {out} --storage-path {tmp_path / 'runs'}"],
                             cwd=REPO, env={**env, "PATH": f"{BIN}:/usr/bin:/bin"},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
        assert sub.returncode == 0, sub.stdout[-3000:]
        assert (out / "model.onnx").exists()
    finally:
        for name in DROPPED:
            (REPO / name).unlink(missing_ok=True)
        shutil.rmtree(REPO / "ansible/inventories/mylab", ignore_errors=True)
        shutil.rmtree(REPO / ".aws", ignore_errors=True)
    m = read_manifest(out)
    # make submit's upload, as every node unpacked it for the job's workers: what git tracks
    package = m["working_dir"].removeprefix("gcs://").removesuffix(".zip")
    temp_root = json.loads((cluster.config / "clusters/local/state.json").read_text())["temp_root"]
    unpacked = sorted(Path(temp_root).glob(f"*/session_*/runtime_resources/working_dir_files/{package}"))
    assert len({p.relative_to(temp_root).parts[0] for p in unpacked}) == 2, unpacked  # head and node1
    for folder in unpacked:
        assert (folder / "jobs/ddp_autoencoder.py").is_file() and (folder / ".git/HEAD").is_file()
        assert [name for name in DROPPED if (folder / name).exists()] == [], folder
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    assert m["git_commit"] in (head, f"{head}-dirty"), m["git_commit"]
    # the commit came as data, DLC_SUBMIT_COMMIT in the job's runtime env (not only from the
    # uploaded .git/HEAD, which git_commit() would fall back to)
    req = urllib.request.Request(f"http://127.0.0.1:{cluster.dashboard_port}/api/jobs/")
    token = Path(cluster.client_env()["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=30) as r:
        jobs = json.loads(r.read())
    job = next(j for j in jobs if f"--output {out}" in j["entrypoint"])
    assert job["runtime_env"]["env_vars"]["DLC_SUBMIT_COMMIT"] == m["git_commit"], job["runtime_env"]
    assert m["working_dir"].startswith("gcs://_ray_pkg_") and m["working_dir"].endswith(".zip")
