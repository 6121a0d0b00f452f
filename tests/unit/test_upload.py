"""What `ray job submit --working-dir .` uploads, through Ray's own packaging code on a clone of
this checkout with secrets dropped into it, and how a job on the cluster names its commit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

from ray._private.runtime_env.packaging import _zip_files

from trainkit import onnx_export, record

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def test_the_upload_leaves_keys_inventories_venvs_and_git_history_behind(tmp_path):
    clone = tmp_path / "checkout"
    _git("clone", "-q", str(REPO), str(clone), cwd=tmp_path)
    # the working tree's files over the commit's, committed or not (symlinks stay symlinks)
    for name in _git("ls-files", "-co", "--exclude-standard", cwd=REPO).splitlines():
        src, dst = REPO / name, clone / name
        if src.is_file() and not src.is_symlink():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
    secret = f"s3cret-{uuid.uuid4().hex}"  # made here: no file of the repo can hold it
    _git("config", "remote.origin.url", f"https://user:{secret}@git.example.org/team/dlc.git", cwd=clone)
    dropped = ["id_ed25519", "jobs/id_rsa.pub", "deploy.pem", "ansible/inventories/mylab/hosts.yml",
               "ansible/inventories/mylab/group_vars/all.yml", "clusters/lab/ray_token",
               "myvenv/pyvenv.cfg", ".venv-test/bin/python",
               # Ray's own default excludes are off (ray-client.env): the ignore files name them
               *[f"{folder}/left-behind" for folder in record.EXCLUDES],
               *[f"jobs/{folder}/left-behind" for folder in record.EXCLUDES]]
    for name in dropped:
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        (clone / name).write_text(secret + "\n")
    _zip_files(str(clone), [], str(tmp_path / "pkg.zip"), include_gitignore=True)
    names = set(zipfile.ZipFile(tmp_path / "pkg.zip").namelist())
    for name in dropped:
        assert name not in names, name
    assert not [n for n in names if (clone / n).is_file()
                and secret in (clone / n).read_text(errors="ignore")]
    git = {n for n in names if n.startswith(".git/")}
    assert ".git/config" not in git and not any(n.startswith((".git/objects", ".git/logs")) for n in git)
    assert ".git/HEAD" in git
    # what the jobs need still travels
    for name in ["jobs/ddp_autoencoder.py", "trainkit/job.py", "ansible/inventories/example/hosts.yml",
                 "ansible/inventories/emulated/hosts.yml", "README.md"]:
        assert name in names, name
    # the uploaded refs name the commit without git or its objects
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(tmp_path / "pkg.zip").extractall(unpacked)
    head = _git("rev-parse", "HEAD", cwd=clone).strip()
    assert onnx_export.uploaded_commit(unpacked / ".git") == head
    # as a job on the cluster sees it: jobs/trainkit arrives as a folder (Ray copies symlinks)
    assert (unpacked / "jobs/trainkit").is_dir() and not (unpacked / "jobs/trainkit").is_symlink()
    env = {k: v for k, v in os.environ.items() if k not in ("DLC_SUBMIT_COMMIT", "DLC_GIT_COMMIT")}
    probe = "from trainkit import onnx_export as o; print(o.git_commit())"
    seen = subprocess.run([sys.executable, "-c", probe], cwd=unpacked / "jobs", env=env,
                          capture_output=True, text=True, check=True)
    assert seen.stdout.strip() == head


def test_commit_from_packed_refs_a_detached_head_or_nothing(tmp_path):
    sha = "0123456789abcdef0123456789abcdef01234567"
    (tmp_path / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / "packed-refs").write_text(f"# pack-refs with: peeled\n{sha} refs/heads/main\n")
    assert onnx_export.uploaded_commit(tmp_path) == sha
    (tmp_path / "HEAD").write_text(sha + "\n")
    assert onnx_export.uploaded_commit(tmp_path) == sha
    (tmp_path / "HEAD").write_text("ref: refs/heads/gone\n")
    assert onnx_export.uploaded_commit(tmp_path) is None
    assert onnx_export.uploaded_commit(tmp_path / "missing") is None


def test_the_package_a_job_ran_is_named_from_its_job_config(monkeypatch):
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps(
        {"runtime_env": {"working_dir": "gcs://_ray_pkg_0f1e2d3c4b5a6978.zip"}, "metadata": {}}))
    assert onnx_export.working_dir_package() == "gcs://_ray_pkg_0f1e2d3c4b5a6978.zip"
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    assert onnx_export.working_dir_package() is None
