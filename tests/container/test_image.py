"""The container images (docker/): the CPU image is built the way `make image` builds it (a warm
machine reuses the layer cache: seconds) and checked from inside; the GPU path (docker/Dockerfile with a
CUDA base) is built as far as a machine without a GPU allows: on a stand-in base carrying this
machine's CUDA toolkit, Horovod compiled with NCCL operations for one architecture.

Every container here runs on an --internal Docker network the tests make (no route off the machine):
the image needs nothing from outside at run time. (Not --network none: with only a loopback device
Horovod's gloo crashes.)
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKER = os.environ.get("DOCKER", "/usr/bin/docker")
IMAGE = os.environ.get("IMAGE") or "dlcluster:cpu"  # make exports IMAGE, empty by default
NETWORK = "dlcluster-test"
SHM = "2g"  # Ray and the DataLoader need more than Docker's default 64 MB /dev/shm


def _cannot_run_docker() -> str | None:
    """Why no Docker engine can be had here, or None. Root on Debian/Ubuntu can always get one
    (docker/engine.sh installs docker.io and starts dockerd), so that case is never skipped."""
    if sys.platform != "linux":
        return f"Docker images are built on Linux only (this is {sys.platform})"
    if os.geteuid() == 0 and shutil.which("apt-get"):
        return None
    if Path(DOCKER).exists():
        ok = subprocess.run([DOCKER, "info"], capture_output=True).returncode == 0
        return None if ok else f"not root and {DOCKER} cannot reach a Docker engine"
    return f"not root and no {DOCKER}: cannot install or start a Docker engine"


pytestmark = [
    pytest.mark.skipif(_cannot_run_docker() is not None, reason=str(_cannot_run_docker())),
    pytest.mark.timeout(3600),  # the first test's setup builds the image: 20-30 minutes when cold
]


def sh(*cmd: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), cwd=REPO, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)
    print(proc.stdout[-6000:])
    return proc


def in_image(*cmd: str, volumes: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    args = [DOCKER, "run", "--rm", "--network", NETWORK, f"--shm-size={SHM}"]
    for host, target in (volumes or {}).items():
        args += ["-v", f"{host}:{target}"]
    return sh(*args, IMAGE, *cmd, timeout=timeout)


@pytest.fixture(scope="module")
def image():
    proc = sh("docker/engine.sh", timeout=600)
    assert proc.returncode == 0, f"no Docker engine: {proc.stdout}"
    proc = sh("docker/build.sh", env={"GPU": "0", "IMAGE": IMAGE}, timeout=3600)
    assert proc.returncode == 0, f"docker/build.sh failed:\n{proc.stdout[-4000:]}"
    if sh(DOCKER, "network", "inspect", NETWORK).returncode != 0:
        assert sh(DOCKER, "network", "create", "--internal", NETWORK).returncode == 0
    yield IMAGE
    sh(DOCKER, "network", "rm", NETWORK)


def pins() -> dict[str, str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return {re.sub(r"\[.*\]", "", d.split("==")[0]): d.split("==")[1] for d in deps}


VERSIONS = """
import json, platform, os, sys
import torch, torchvision, tensorflow, horovod.torch, ray, onnxruntime, onnx, tf2onnx, tf_keras, cv2
from importlib import metadata
names = json.loads(sys.argv[1])
print(json.dumps({"python": platform.python_version(), "uid": os.getuid(), "horovod": horovod.__version__,
                  "ray": ray.__version__, "torch": torch.__version__,
                  "dists": {n: metadata.version(n) for n in names}}))
"""


def test_imports_and_pinned_versions(image):
    want = pins()
    proc = in_image("python", "-c", VERSIONS, json.dumps(sorted(want)))
    assert proc.returncode == 0, proc.stdout[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["dists"] == want  # every pin of pyproject.toml, exactly
    assert got["ray"] == metadata.version("ray") == "2.60.0"
    assert got["python"].split(".")[:2] == platform.python_version().split(".")[:2]
    assert got["horovod"] == "0.28.1" and got["torch"].startswith(want["torch"])
    assert got["uid"] != 0, "the image must run as a non-root user"


def test_ray_accepts_the_client(image):
    """Ray's own check (what `ray start --address` and ray.init run against the head's versions),
    with the image's settings, against this client's Ray and Python."""
    code = ("import sys; from ray._private.utils import check_version_info as c; "
            "c({'ray_version': sys.argv[1], 'python_version': sys.argv[2]}, 'the client'); print('accepted')")
    proc = in_image("python", "-c", code, metadata.version("ray"), platform.python_version())
    assert proc.returncode == 0 and "accepted" in proc.stdout, proc.stdout[-3000:]


def test_no_proxy_ca_in_the_image(image):
    """The host's extra CAs (a TLS-intercepting proxy's) reach the build's apt steps as a BuildKit
    secret only: neither the image's trust store nor its apt settings hold them."""
    proc = in_image("bash", "-c", "cat /etc/ssl/certs/ca-certificates.crt; ls /etc/apt/apt.conf.d")
    assert proc.returncode == 0 and "99ca" not in proc.stdout
    bundle = proc.stdout.replace("\n", "")
    for crt in Path("/usr/local/share/ca-certificates").glob("**/*.crt"):
        body = "".join(line for line in crt.read_text().splitlines() if line and "-----" not in line)
        assert body[:200] not in bundle, f"{crt} is in the image"


def test_horovod_check_build(image):
    proc = in_image("horovodrun", "--check-build")
    assert proc.returncode == 0
    for item in ("PyTorch", "Gloo"):
        assert re.search(rf"\[X\] {item}\s*$", proc.stdout, re.M), f"{item} missing:\n{proc.stdout}"


def test_horovodrun_allreduce_two_processes(image):
    proc = in_image("horovodrun", "-np", "2", "-H", "localhost:2", "--gloo", "python", "/t/hvd_allreduce.py",
                    volumes={Path(__file__).parent: "/t:ro"})
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert proc.stdout.count("allreduce ok (sum [3.0, 3.0, 3.0, 3.0], average [1.5, 1.5, 1.5, 1.5])") == 2


def test_autoencoder_tiny_epoch(image, tmp_path):
    """`--launcher ray` with no cluster: the job starts its own single-node Ray in the container
    and ends with a verified ONNX model and its manifest in the mounted DLC_HOME."""
    home = tmp_path / "dlcluster"
    home.mkdir()
    home.chmod(0o777)  # the image's user is not root
    proc = in_image("python", "jobs/ddp_autoencoder.py", "--launcher", "ray", "--num-workers", "1",
                    "--limit", "64", "--batch-size", "16", "--image-size", "40x60", "--epochs", "1",
                    "--name", "tiny", volumes={home: "/home/dlc/dlcluster"}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    record = json.loads((home / "runs" / "tiny" / "published.json").read_text())
    assert record["model"].startswith("/home/dlc/dlcluster/models/tiny/publications/")
    model = home / "models" / "tiny" / "model.onnx"
    manifest = json.loads((model.parent / "manifest.json").read_text())
    assert model.stat().st_size > 0 and manifest["launcher"] == "ray"
    assert manifest["parity"]["max_abs_diff"] <= 1e-4 and manifest["world_size"] == 1
    assert manifest["git_commit"] != "unknown"  # DLC_GIT_COMMIT, baked in at build time


def test_image_report(image):
    proc = sh(sys.executable, "docker/report.py", env={"IMAGE": IMAGE})
    assert proc.returncode == 0
    assert re.search(r"^torch \+ torchvision.* [0-9.]+ GB", proc.stdout, re.M), proc.stdout
    assert "cold" in proc.stdout and "total" in proc.stdout


def test_gpu_build_without_its_base_says_how_to_get_it():
    proc = sh("docker/build.sh", env={"GPU": "1", "BASE_IMAGE": "dlcluster/no-such-base:0"}, timeout=300)
    assert proc.returncode != 0
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("image: error: base image dlcluster/no-such-base:0 is not in the local engine")
    assert "docker load" in last or "load -i" in last


@pytest.mark.skipif(shutil.which("nvcc") is None,
                    reason="no nvcc (CUDA toolkit) on this machine: the NCCL build cannot be compiled")
def test_gpu_image_path_compiles_horovod_with_nccl(image):
    """docker/Dockerfile's GPU path on a stand-in for the CUDA base (the Debian base + this machine's
    CUDA toolkit, docker/cuda-standin.sh): Horovod compiled with NCCL operations for one architecture
    (CUDA_ARCHS, HOROVOD_BUILD_CUDA_CC_LIST), checked by the build (check-build lists NCCL) and here.
    A broken GPU build fails here even without a GPU; running NCCL needs one."""
    proc = sh("docker/cuda-standin.sh", timeout=600)
    assert proc.returncode == 0, proc.stdout
    base = proc.stdout.strip().splitlines()[-1]
    gpu_image = "dlcluster:gpu-standin"
    proc = sh("docker/build.sh", env={"GPU": "1", "BASE_IMAGE": base, "IMAGE": gpu_image, "CUDA_ARCHS": "90"},
              timeout=3600)
    assert proc.returncode == 0, f"docker/build.sh GPU=1 failed:\n{proc.stdout[-4000:]}"
    code = ("import torch, horovod.torch as hvd; hvd.init(); "
            "print(hvd.nccl_built(), hvd.cuda_built(), hvd.gloo_built())")
    proc = sh(DOCKER, "run", "--rm", "--network", NETWORK, gpu_image, "python", "-c", code)
    assert proc.returncode == 0, proc.stdout[-3000:]
    nccl, cuda, gloo = proc.stdout.strip().splitlines()[-1].split()
    assert int(nccl) > 0 and cuda == "True" and gloo == "True"
