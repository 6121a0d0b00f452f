"""What `ray job submit --working-dir .` uploads, through Ray's own packaging code on a clone of
this checkout with secrets dropped into it, and how a job on the cluster names its commit."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest
from ray._private.runtime_env.packaging import _zip_files

from dlcluster import record
from trainkit import onnx_export

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
               "myvenv/pyvenv.cfg", ".venv-test/bin/python", ".env", "jobs/.env.local", ".netrc",
               "credentials.json", ".aws/config", "id_dsa", "deploy.ppk",
               # a nested clone's git folder, and the credentials the project itself writes
               "vendor/clone/.git/config", "jobs/nested/.git/config", "clusters/lab/tracking_auth",
               "clusters/lab/tracking_jobs_auth", "clusters/lab/.tracking_auth.new",
               "clusters/lab/grafana_password", "clusters/lab/registry_password",
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
    # as a job on the cluster sees it: its working dir first on PYTHONPATH (Ray sets it), so the
    # uploaded harness wins over the one make setup installed, and it finds the commit in the upload
    env = {k: v for k, v in os.environ.items() if k not in ("DLC_SUBMIT_COMMIT", "DLC_GIT_COMMIT")}
    probe = "from trainkit import onnx_export as o; print(o.__file__); print(o.git_commit())"
    seen = subprocess.run([sys.executable, "-c", probe], cwd=unpacked, capture_output=True, text=True,
                          env={**env, "PYTHONPATH": str(unpacked)}, check=True)
    assert seen.stdout.split() == [str(unpacked / "trainkit/onnx_export.py"), head]


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


def test_make_submit_stages_only_what_git_tracks_and_what_upload_names(tmp_path):
    """`make submit`'s upload (dlcluster/upload.py, then Ray's packaging of that folder with the
    ignore rules off, as dlcluster submit runs it): the tracked files as they are in the working
    tree, the named ones, the commit; no secret whatever its name, no file never added."""
    from dlcluster import upload

    clone = tmp_path / "checkout"
    _git("clone", "-q", str(REPO), str(clone), cwd=tmp_path)
    secret = f"s3cret-{uuid.uuid4().hex}"
    dropped = [".env", ".netrc", "credentials.json", ".aws/config", ".aws/credentials", "id_dsa",
               "deploy.ppk", "jobs/untracked_script.py", "trainkit/.env.local", "data/big.csv"]
    for name in dropped:
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        (clone / name).write_text(secret + "\n")
    job = clone / "jobs/ddp_autoencoder.py"
    job.write_text(job.read_text() + "# edited\n")
    (clone / "notes").mkdir()
    (clone / "notes/small.csv").write_text("a,b\n1,2\n")
    (clone / "jobs/harness").symlink_to("../trainkit")  # a tracked link to a folder that travels
    _git("add", "jobs/harness", cwd=clone)

    stage = tmp_path / "stage"
    stage.mkdir()
    files = upload.stage(clone, stage, ["notes"])
    tracked = set(_git("ls-files", cwd=clone).splitlines()) - {".rayignore"}
    assert set(files) == tracked | {"notes/small.csv"}
    # an edit not yet committed travels (the commit's name then says -dirty: make submit)
    assert (stage / "jobs/ddp_autoencoder.py").read_text().endswith("# edited\n")
    assert (stage / "jobs/harness").is_symlink()
    _zip_files(str(stage), [], str(tmp_path / "pkg.zip"), include_gitignore=False)
    names = {n.rstrip("/") for n in zipfile.ZipFile(tmp_path / "pkg.zip").namelist()}
    for name in dropped:
        assert name not in names, name
    assert {"jobs/ddp_autoencoder.py", "trainkit/job.py", "notes/small.csv", ".git/HEAD"} <= names
    assert not [n for n in names if n.startswith(".git/") and n not in (".git", ".git/HEAD")]
    head = _git("rev-parse", "HEAD", cwd=clone).strip()
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(tmp_path / "pkg.zip").extractall(unpacked)
    assert onnx_export.uploaded_commit(unpacked / ".git") == head
    assert not [n for n in names
                if (unpacked / n).is_file() and secret in (unpacked / n).read_text(errors="ignore")]


@pytest.mark.parametrize("named,expect", [
    (["no/such/file"], "UPLOAD names no/such/file, which does not exist"),
    (["/etc/hostname"], "UPLOAD names /etc/hostname, which is outside the checkout"),
])
def test_upload_of_a_missing_or_outside_file_is_one_line_and_stages_nothing(tmp_path, named, expect):
    from dlcluster import upload
    from trainkit.errors import UserError

    stage = tmp_path / "stage"
    stage.mkdir()
    with pytest.raises(UserError, match="^" + re.escape(expect)):
        upload.stage(REPO, stage, named)
    assert not any(stage.iterdir())


def _small_repo(tmp_path: Path) -> Path:
    """A checkout of a few tracked files (job.py, lib/util.py) and a link to its folder lib."""
    repo = tmp_path / "checkout"
    (repo / "lib").mkdir(parents=True)
    (repo / "job.py").write_text("print('job')\n")
    (repo / "lib/util.py").write_text("X = 1\n")
    (repo / "jobs").mkdir()
    (repo / "jobs/lib").symlink_to("../lib")
    _git("init", "-q", cwd=repo)
    _git("add", ".", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@example.org", "commit", "-qm", "files", cwd=repo)
    return repo


@pytest.mark.parametrize("link,expect", [
    ("jobs/creds", "jobs/creds is a link to {outside}, outside the checkout "),
    ("data/inner", "data/inner is a link to {outside}, outside the checkout "),
    ("jobs/env", "jobs/env is a link to .env, which git does not track and UPLOAD does not name"),
])
def test_a_tracked_link_out_of_what_travels_is_one_line_and_stages_nothing(tmp_path, link, expect):
    """Ray's packaging follows links: a tracked link to a file outside the checkout, or to one git
    does not track, would upload that file (security review N3)."""
    from dlcluster import upload
    from trainkit.errors import UserError

    repo = _small_repo(tmp_path)
    secret = tmp_path / "outside-creds"
    secret.write_text("token\n")
    (repo / ".env").write_text("token\n")
    target = secret if link != "jobs/env" else Path("../.env")
    (repo / link).parent.mkdir(exist_ok=True)
    (repo / link).symlink_to(target)
    _git("add", "-f", link, cwd=repo)
    stage = tmp_path / "stage"
    stage.mkdir()
    with pytest.raises(UserError, match="^" + re.escape(expect.format(outside=secret))):
        upload.stage(repo, stage)
    assert not any(stage.iterdir())


def test_links_inside_travel_as_links_and_no_git_folder_or_submodule_travels(tmp_path):
    """A link to a tracked folder travels as a link within the upload; a submodule (its files are
    not git's) and an embedded clone's .git in a folder UPLOAD names stay here (N11, N2)."""
    from dlcluster import upload

    repo = _small_repo(tmp_path)
    sub = tmp_path / "sub"
    (sub / "x").mkdir(parents=True)
    (sub / "x/a.py").write_text("A = 1\n")
    _git("init", "-q", cwd=sub)
    _git("add", ".", cwd=sub)
    _git("-c", "user.name=t", "-c", "user.email=t@example.org", "commit", "-qm", "sub", cwd=sub)
    _git("-c", "protocol.file.allow=always", "submodule", "add", "-q", str(sub), "vendor/sub", cwd=repo)
    _git("-c", "user.name=t", "-c", "user.email=t@example.org", "commit", "-qm", "submodule", cwd=repo)
    shutil.copytree(sub, repo / "notes")  # an embedded clone, named in UPLOAD
    _git("config", "remote.origin.url", "https://user:TOKEN@git.example.org/x.git", cwd=repo / "notes")
    assert upload.gitlinks(repo) == ["vendor/sub"]
    stage = tmp_path / "stage"
    stage.mkdir()
    files = upload.stage(repo, stage, ["notes"])
    assert "vendor/sub" not in files and not (stage / "vendor/sub").exists()
    assert "notes/x/a.py" in files and not [f for f in files if "/.git" in f or f.startswith(".git/")]
    assert not (stage / "notes/.git").exists()
    assert (stage / "jobs/lib").is_symlink() and os.readlink(stage / "jobs/lib") == "../lib"
    assert (stage / "jobs/lib/util.py").read_text() == "X = 1\n"
