"""What each of the project's Python environments installs, from the lock, and its cache key.

requirements.lock (`make lock`: uv compiles pyproject.toml's pins, every package with its sha256
hashes) is the one lock the virtualenv, the wheelhouse and the images install from; each prints
here as pip requirement lines with their hashes, so pip installs in hash-checking mode:

    envkey.py                 the virtualenv's cache key
    envkey.py --requirements  the virtualenv: the whole lock (runtime, test tools, Horovod's needs)
    envkey.py --runtime       what a cluster node runs: the packages the runtime pins and Horovod's
                              needs pull in (the lock's `# via` graph), no test tool
    envkey.py --runtime-pins  the same as name==version words (a node's probe of its environment)
    envkey.py --torch         torch, torchvision, what they pull in, setuptools and wheel: the
                              images' first layer, all Horovod is compiled against
    envkey.py --tf-cuda-in    the GPU image's TensorFlow environment's inputs (`make lock` compiles
                              them into docker/tf-cuda.lock, constrained by requirements.lock)
    envkey.py --runtime-key   the wheelhouse's key (the images install from it)

Each key changes exactly when what it names changes: the virtualenv's, the Python version, pip's
pin and the whole lock; the wheelhouse's, the Python version, the runtime's and the TensorFlow
environment's locked lines and what versions.env pins of its other files (pip, the Horovod sdist),
so a new test tool neither collects the wheelhouse again nor rebuilds an image. Comments in the
lock (uv's `# via` lines) change no key.
"""

from __future__ import annotations

import hashlib
import re
import sys
import tomllib
from pathlib import Path

from trainkit import versions  # the standard library only: this runs before any venv exists

root = Path(__file__).resolve().parents[1]

LOCK = root / "requirements.lock"
TF_CUDA_LOCK = root / "docker/tf-cuda.lock"
# versions.env's lines for the wheelhouse's other files
WHEELHOUSE_PINS = ("PIN_PIP", "PIN_HOROVOD", "PIN_HOROVOD_SDIST_SHA256")
# the images' first layer: torch and torchvision, and the tools Horovod's compile needs beside them
TORCH_ROOTS = ("torch", "torchvision", "setuptools", "wheel")
# not in TensorFlow's own environment (the GPU image's: CUDA 12 where torch brings CUDA 13)
NOT_IN_TF = ("torch", "torchvision", "onnxscript", "transformers")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def name_of(requirement: str) -> str:
    found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    if found is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return norm(found.group(0))


def parse(path: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (its requirement lines with hashes, the packages it is `# via`), in the lock's order."""
    entries: dict[str, tuple[list[str], list[str]]] = {}
    name = None
    in_via = False
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if not line.startswith((" ", "#")):
            name, in_via = name_of(line), False
            entries[name] = ([line], [])
        elif name is None:
            continue  # the header
        elif line.strip().startswith("--hash="):
            entries[name][0].append(line)
        elif (m := re.match(r"\s+# via(?: (.+))?$", line)) is not None:
            in_via = True
            if m.group(1):
                entries[name][1].append(m.group(1))
        elif in_via and (m := re.match(r"\s+#\s+(\S.*)$", line)) is not None:
            entries[name][1].append(m.group(1))
    # `dlcluster (pyproject.toml)` and `-r file` mark a root, not a package
    return {n: ("\n".join(lines), [norm(v) for v in via if not v.startswith("-") and "(" not in v])
            for n, (lines, via) in entries.items()}


def closure(lock: dict[str, tuple[str, list[str]]], roots: list[str]) -> list[str]:
    """The roots and everything they pull in, in the lock's order; a root missing from the lock is
    an error (run make lock)."""
    missing = [r for r in roots if r not in lock]
    if missing:
        sys.exit(f"envkey: error: {', '.join(missing)} not in {LOCK.name}: run make lock")
    pulls: dict[str, set[str]] = {}
    for name, (_, via) in lock.items():
        for parent in via:
            pulls.setdefault(parent, set()).add(name)
    seen, todo = set(roots), list(roots)
    while todo:
        for child in pulls.get(todo.pop(), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return [n for n in lock if n in seen]


def requirements(lock: dict[str, tuple[str, list[str]]], names: list[str]) -> str:
    return "\n".join(lock[n][0] for n in names) + "\n"


def key(*parts: str) -> str:
    return hashlib.sha256("\n".join([sys.version.split()[0], *parts]).encode()).hexdigest()[:16]


def main() -> None:
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    runtime_roots = [name_of(r) for r in project["dependencies"] + extras["horovod-deps"]]
    if "--tf-cuda-in" in sys.argv:  # inputs, not locked lines: pyproject's own pins, as written
        for r in project["dependencies"] + extras["horovod-deps"]:
            if name_of(r) not in NOT_IN_TF:
                print(re.sub(r"^tensorflow==", "tensorflow[and-cuda]==", r))
        return
    lock = parse(LOCK)
    locked = {n: lines.split()[0] for n, (lines, _) in lock.items()}  # name -> its name==version
    stale = [f"pyproject.toml pins {r} but {LOCK.name} has {locked[name_of(r)]}"
             for r in project["dependencies"] + extras["dev"]
             if name_of(r) in locked and r.split("==")[-1] != locked[name_of(r)].split("==")[1]]
    if stale:
        sys.exit(f"envkey: error: {stale[0]}: run make lock")
    pins = versions.values(root / "versions.env")
    closure(lock, [name_of(r) for r in extras["dev"]])  # every pin locked (else: one line, exit)
    runtime = requirements(lock, closure(lock, runtime_roots))
    if "--requirements" in sys.argv:
        print(requirements(lock, list(lock)), end="")
    elif "--runtime" in sys.argv:
        print(runtime, end="")
    elif "--runtime-pins" in sys.argv:
        print(" ".join(locked[n] for n in closure(lock, runtime_roots)))
    elif "--torch" in sys.argv:
        print(requirements(lock, closure(lock, list(TORCH_ROOTS))), end="")
    elif "--runtime-key" in sys.argv:
        tf = parse(TF_CUDA_LOCK)
        print(key(runtime, requirements(tf, list(tf)),
                  *sorted(f"{name}={pins[name]}" for name in WHEELHOUSE_PINS)))
    else:
        print(key(f"PIN_PIP={pins['PIN_PIP']}", requirements(lock, list(lock))))


if __name__ == "__main__":
    main()
