"""What a job takes to the cluster through `make submit`: the files git tracks, as they are in the
working tree, the commit's name, and the files the user names (UPLOAD=...); nothing else. Keys,
`.env`, `.netrc`, cloud credentials and scripts that were never added stay on this machine
whatever their names, where an ignore file can only list the names it thought of.

    stage(repo, STAGE, paths)    # fills the empty folder STAGE; say(...) prints a summary

dlcluster/submit.py then runs `ray job submit --working-dir STAGE` with Ray's own ignore rules off
(RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1, no .rayignore in STAGE): the folder is what travels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from trainkit.errors import UserError

# Ray's ignore file for a plain `ray job submit --working-dir .`; here the folder is already the
# upload, and its rules would drop tracked files whose names they match.
NOT_STAGED = {".rayignore"}


def _git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout


def gitlinks(repo: Path) -> list[str]:
    """Tracked paths that are another repository's commit (a submodule, an embedded clone: git's
    mode 160000): git holds no file of theirs, and their folders may hold a `.git` with
    credentials in its config."""
    entries = _git(repo, "ls-files", "-z", "--stage").split(b"\0")
    return sorted(e.split(b"\t", 1)[1].decode() for e in entries if e.startswith(b"160000 "))


def tracked(repo: Path) -> list[str]:
    """Tracked files that exist in the working tree (a deleted one is not uploaded), without the
    submodules (gitlinks)."""
    names = [n.decode() for n in _git(repo, "ls-files", "-z", "--cached").split(b"\0") if n]
    links = set(gitlinks(repo))
    return [n for n in names if os.path.lexists(repo / n) and n not in NOT_STAGED and n not in links]


def link_target(repo: Path, name: str, staged: set[str]) -> str:
    """Where the symlink `name` points, relative to the checkout; one line when that is outside
    it or not among what travels (Ray's packaging follows links: the target would be uploaded)."""
    src = repo / name
    target = src.resolve()
    if target != repo and repo not in target.parents:
        raise UserError(f"{name} is a link to {os.readlink(src)}, outside the checkout {repo}: what it "
                        "points to would travel with the job; copy what the job needs into the "
                        "checkout, or put it on the cluster's shared storage")
    rel = target.relative_to(repo).as_posix()
    if rel not in staged and not any(f.startswith(rel + "/") for f in staged):
        raise UserError(f"{name} is a link to {rel}, which git does not track and UPLOAD does not "
                        "name: it would travel with the job; git add it, name it in UPLOAD=..., "
                        "or remove the link")
    return rel


def stage(repo: Path, into: Path, named: Sequence[str] = ()) -> list[str]:
    """Copy the tracked files, the named ones and `.git/HEAD` (the commit, detached: no branch
    names, no config, no objects) into the empty folder `into`. A symlink is copied as a link to
    the same file of the upload, and only when that file travels too; no `.git` folder of a
    named folder (an embedded clone's) travels, nor a submodule."""
    repo, into = repo.resolve(), into.resolve()
    if any(into.iterdir()):
        raise UserError(f"{into} is not empty: give an empty folder to stage the upload in")
    extra = []
    for name in named:
        path = (repo / name).resolve()
        if not path.exists():
            raise UserError(f"UPLOAD names {name}, which does not exist: name files or folders in "
                            f"the checkout")
        if repo not in path.parents:
            raise UserError(f"UPLOAD names {name}, which is outside the checkout {repo}: copy it in, "
                             f"or put it on the cluster's shared storage")
        extra += [str(p.relative_to(repo)) for p in ([path] if path.is_file() else sorted(path.rglob("*")))
                  if p.is_file() and ".git" not in p.relative_to(repo).parts]
    files = sorted(set(tracked(repo)) | set(extra))
    staged = set(files)
    targets = {name: link_target(repo, name, staged) for name in files if (repo / name).is_symlink()}
    for name in files:  # (every link checked above: nothing is staged when one is refused)
        src, dst = repo / name, into / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if name in targets:
            os.symlink(os.path.relpath(into / targets[name], dst.parent), dst)
        else:
            shutil.copy2(src, dst)
    commit = _git(repo, "rev-parse", "HEAD").decode().strip()
    (into / ".git").mkdir()
    (into / ".git/HEAD").write_text(commit + "\n")
    return files


def say(repo: Path, into: Path, files: list[str], named: list[str]) -> None:
    """What the upload holds, in a line (and the submodules it leaves out)."""
    size = sum((into / f).lstat().st_size for f in files)
    if left := gitlinks(repo):
        print(f"submit: left out {', '.join(left)}: a submodule (git tracks only its commit); what a job "
              "needs from it goes in the checkout or on the cluster's shared storage", file=sys.stderr)
    print(f"submit: uploading {len(files)} files git tracks{' and UPLOAD' if named else ''} "
          f"({size / 1e6:.1f} MB); nothing else leaves this machine", file=sys.stderr, flush=True)
