"""What a job takes to the cluster through `make submit`: the files git tracks, as they are in the
working tree, the commit's name, and the files the user names (UPLOAD=...); nothing else. Keys,
`.env`, `.netrc`, cloud credentials and scripts that were never added stay on this machine
whatever their names, where an ignore file can only list the names it thought of.

    python -m trainkit.upload STAGE [PATH...]   # fills the empty folder STAGE, prints a summary

ray/submit.sh then runs `ray job submit --working-dir STAGE` with Ray's own ignore rules off
(RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1, no .rayignore in STAGE): the folder is what travels.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from trainkit.errors import UserError

# Ray's ignore file for a plain `ray job submit --working-dir .`; here the folder is already the
# upload, and its rules would drop tracked files whose names they match.
NOT_STAGED = {".rayignore"}


def _git(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout


def tracked(repo: Path) -> list[str]:
    """Tracked paths that exist in the working tree (a deleted one is not uploaded)."""
    names = [n.decode() for n in _git(repo, "ls-files", "-z", "--cached").split(b"\0") if n]
    return [n for n in names if os.path.lexists(repo / n) and n not in NOT_STAGED]


def stage(repo: Path, into: Path, named: list[str] = ()) -> list[str]:
    """Copy the tracked files (symlinks as symlinks), the named ones and `.git/HEAD` (the commit,
    detached: no branch names, no config, no objects) into the empty folder `into`."""
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
                  if p.is_file()]
    files = sorted(set(tracked(repo)) | set(extra))
    for name in files:
        src, dst = repo / name, into / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)
    commit = _git(repo, "rev-parse", "HEAD").decode().strip()
    (into / ".git").mkdir()
    (into / ".git/HEAD").write_text(commit + "\n")
    return files


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m trainkit.upload STAGE [PATH...]", file=sys.stderr)
        return 2
    repo = Path(__file__).resolve().parents[1]
    try:
        files = stage(repo, Path(argv[0]), argv[1:])
    except UserError as e:
        print(f"submit: error: {e}", file=sys.stderr)
        return 2
    size = sum((Path(argv[0]) / f).lstat().st_size for f in files)
    print(f"submit: uploading {len(files)} files git tracks{' and UPLOAD' if argv[1:] else ''} "
          f"({size / 1e6:.1f} MB); nothing else leaves this machine", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
