"""requirements.lock (make lock) is what every environment installs: the virtualenv all of it, the
wheelhouse and the images its runtime part, the images' first layer torch's part, the GPU image's
TensorFlow environment docker/tf-cuda.lock. dlcluster/envkey.py prints each part and its cache key."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def envkey(*flags: str, root: Path = REPO, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dlcluster.envkey", *flags], cwd=root, check=check,
                          capture_output=True, text=True)


def entries(text: str) -> dict[str, str]:
    """name -> version of pip requirement lines with hashes; each line checked to carry a sha256."""
    found = {}
    for block in re.split(r"\n(?=\S)", text.strip()):
        first = block.splitlines()[0]
        m = re.match(r"([A-Za-z0-9._-]+)==(\S+) \\$", first)
        assert m, first
        assert re.search(r"--hash=sha256:[0-9a-f]{64}", block), f"{first}: no hash"
        found[canonicalize_name(m.group(1))] = m.group(2)
    return found


LOCKED = entries(envkey("--requirements").stdout)
RUNTIME = entries(envkey("--runtime").stdout)
TORCH = entries(envkey("--torch").stdout)
TF_CUDA = entries("\n".join(ln for ln in (REPO / "docker/tf-cuda.lock").read_text().splitlines()
                            if not ln.lstrip().startswith("#")))
DEV = [canonicalize_name(Requirement(r).name) for r in PROJECT["optional-dependencies"]["dev"]]


def test_the_lock_holds_every_pin_of_pyproject_at_its_version():
    for r in PROJECT["dependencies"] + PROJECT["optional-dependencies"]["dev"]:
        req = Requirement(r)
        assert LOCKED[canonicalize_name(req.name)] in req.specifier, r
    for r in PROJECT["optional-dependencies"]["horovod-deps"]:
        assert canonicalize_name(r) in RUNTIME, r


def test_the_virtualenv_is_the_lock():
    """What make setup installed is what the lock says, package for package (pip's own aside; the
    checkout's .venv adds this project's own, over the cached environment)."""
    base = Path(sys.prefix) / "base"  # .venv/base: the cached environment
    paths = sysconfig.get_paths(vars={"base": str(base), "platbase": str(base)})
    site = sorted({sysconfig.get_paths()["purelib"], paths["purelib"], paths["platlib"]})  # not what ray
    # adds to sys.path (its vendored thirdparty_files)
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=site)}
    assert {n: installed.get(n) for n in LOCKED} == LOCKED
    extra = set(installed) - set(LOCKED) - {"pip", "horovod", "dlcluster"}
    assert extra == set(), "installed but not locked"


def test_the_runtime_part_holds_every_dependency_of_its_packages_and_no_test_tool():
    """Read from the installed packages' own metadata, not from the lock's comments that envkey.py
    follows: every runtime package's requirements (Ray's with the extras pinned) are in it."""
    extras = {canonicalize_name(Requirement(r).name): Requirement(r).extras for r in PROJECT["dependencies"]}
    for name in RUNTIME:
        for spec in metadata.requires(name) or []:
            req = Requirement(spec)
            wanted = req.marker is None or any(req.marker.evaluate({"extra": e})
                                               for e in extras.get(name, set()) | {""})
            if wanted:
                assert canonicalize_name(req.name) in RUNTIME, f"{name} needs {spec}"
    assert not {*DEV, "iniconfig", "pluggy", "execnet"} & set(RUNTIME)
    assert {"torch", "ray", "tensorflow", "cloudpickle", "cffi"} <= set(RUNTIME)
    assert set(RUNTIME) < set(LOCKED) and all(RUNTIME[n] == LOCKED[n] for n in RUNTIME)


def test_torchs_part_is_torch_and_what_it_pulls_in():
    assert {"torch", "torchvision", "numpy", "pillow", "setuptools", "wheel"} <= set(TORCH)
    assert not {"tensorflow", "ray", "onnx"} & set(TORCH)
    assert set(TORCH) < set(RUNTIME)


def test_tensorflows_cuda_environment_has_the_locked_versions_and_no_torch():
    assert not {"torch", "torchvision", "onnxscript"} & set(TF_CUDA)
    assert {"tensorflow", "nvidia-cudnn-cu12", "ray", "cloudpickle"} <= set(TF_CUDA)
    assert {n: v for n, v in TF_CUDA.items() if n in LOCKED} == {n: LOCKED[n] for n in TF_CUDA if n in LOCKED}


@pytest.fixture
def copy(tmp_path) -> Path:
    """envkey.py with what it reads, in a folder of its own."""
    for name in ("dlcluster/__init__.py", "dlcluster/envkey.py", "trainkit/__init__.py",
                 "trainkit/versions.py", "pyproject.toml", "versions.env", "requirements.lock",
                 "docker/tf-cuda.lock"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        shutil.copy(REPO / name, tmp_path / name)
    return tmp_path


def keys(root: Path) -> tuple[str, str]:
    return envkey(root=root).stdout.strip(), envkey("--runtime-key", root=root).stdout.strip()


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new, 1))


def test_the_keys_follow_the_lock_the_wheelhouse_only_its_runtime_part(copy):
    venv, house = keys(copy)
    assert re.fullmatch(r"[0-9a-f]{16}", venv) and keys(copy) == (venv, house)
    lock = copy / "requirements.lock"
    edit(lock, "    # via pytest\n", "    # via pytest\n    # a comment\n")  # comments change no key
    assert keys(copy) == (venv, house)
    ruff = re.search(r"^ruff==\S+ \\\n    --hash=sha256:([0-9a-f]{64})", lock.read_text(), re.M).group(1)
    edit(lock, ruff, "0" * 64)  # a test tool's file: the virtualenv's, not the images'
    tool = keys(copy)
    assert tool[0] != venv and tool[1] == house
    tqdm = re.search(r"^tqdm==\S+ \\\n    --hash=sha256:([0-9a-f]{64})", lock.read_text(), re.M).group(1)
    edit(lock, tqdm, "1" * 64)  # a runtime file: both
    runtime = keys(copy)
    assert runtime[0] != tool[0] and runtime[1] != house
    edit(copy / "docker/tf-cuda.lock", "--hash=sha256:", "--hash=sha256:2")  # the GPU image's TF: the images'
    assert keys(copy)[0] == runtime[0] and keys(copy)[1] != runtime[1]
    pip = re.search(r"^PIN_PIP=(\S+)", (copy / "versions.env").read_text(), re.M).group(1)
    edit(copy / "versions.env", f"PIN_PIP={pip}", "PIN_PIP=1.0")
    assert keys(copy)[0] != runtime[0]


def test_a_pin_the_lock_does_not_have_is_one_line_naming_make_lock(copy):
    pyproject = copy / "pyproject.toml"
    tqdm = next(r for r in PROJECT["dependencies"] if r.startswith("tqdm=="))
    edit(pyproject, f'"{tqdm}"', '"tqdm==0.0.1"')
    proc = envkey("--runtime", root=copy, check=False)
    assert proc.returncode != 0 and proc.stdout == ""
    assert proc.stderr.strip() == ("envkey: error: pyproject.toml pins tqdm==0.0.1 but requirements.lock "
                                   f"has {tqdm}: run make lock")
    edit(pyproject, '"tqdm==0.0.1"', f'"{tqdm}",\n    "left-pad==1.0"')
    proc = envkey(root=copy, check=False)
    assert proc.returncode != 0 and proc.stderr.strip() == \
        "envkey: error: left-pad not in requirements.lock: run make lock"
