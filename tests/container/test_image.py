"""The container images (docker/): the CPU image is built the way `make image` builds it (a warm
machine reuses the layer cache: seconds) and checked from inside; the GPU path (docker/Dockerfile with a
CUDA base) is built as far as a machine without a GPU allows: on a stand-in base carrying this
machine's CUDA toolkit, Horovod compiled with NCCL operations for one architecture.

Every container here runs on an --internal Docker network the tests make (no route off the machine):
the image needs nothing from outside at run time. (Not --network none: with only a loopback device
Horovod's gloo crashes.)
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import zipfile
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from trainkit import versions

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


def utc_now() -> str:
    """The time as docker/build.sh stamps a build in image-builds.tsv (`date -u +%FT%TZ`)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture(scope="module")
def image_build() -> dict:
    """This module's docker/build.sh run: its output and the UTC seconds it ran between."""
    proc = sh("docker/engine.sh", timeout=600)
    assert proc.returncode == 0, f"no Docker engine: {proc.stdout}"
    started = utc_now()
    # built even when the image's inputs are those of the one there (the tier proves the build; the
    # emulated tier's `make image` after it is the one that skips)
    proc = sh("docker/build.sh", env={"GPU": "0", "IMAGE": IMAGE, "IMAGE_REBUILD": "1"}, timeout=3600)
    assert proc.returncode == 0, f"docker/build.sh failed:\n{proc.stdout[-4000:]}"
    return {"output": proc.stdout, "started": started, "ended": utc_now()}


@pytest.fixture(scope="module")
def image(image_build):
    if sh(DOCKER, "network", "inspect", NETWORK).returncode != 0:
        assert sh(DOCKER, "network", "create", "--internal", NETWORK).returncode == 0
    yield IMAGE
    sh(DOCKER, "network", "rm", NETWORK)


def pins() -> dict[str, str]:
    """The lock's runtime part (dlcluster/envkey.py --runtime-pins): every package the image installs."""
    out = subprocess.run([sys.executable, "-m", "dlcluster.envkey", "--runtime-pins"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout.split()
    return dict(pin.split("==") for pin in out)


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
    assert got["dists"] == want  # every package of the lock's runtime part, exactly
    assert got["ray"] == metadata.version("ray") == "2.60.0"
    assert got["python"].split(".")[:2] == platform.python_version().split(".")[:2]
    assert got["horovod"] == versions.values()["PIN_HOROVOD"] and got["torch"].startswith(want["torch"])
    assert got["uid"] != 0, "the image must run as a non-root user"


def test_ray_accepts_the_client(image):
    """Ray's own check (what `ray start --address` and ray.init run against the head's versions),
    with the image's settings, against this client's Ray and Python."""
    code = ("import sys; from ray._private.utils import check_version_info as c; "
            "c({'ray_version': sys.argv[1], 'python_version': sys.argv[2]}, 'the client'); print('accepted')")
    proc = in_image("python", "-c", code, metadata.version("ray"), platform.python_version())
    assert proc.returncode == 0 and "accepted" in proc.stdout, proc.stdout[-3000:]


# The image's trust store, read inside it: the certificates (sha256 of each one's DER) of its CA
# bundle, of the ca-certificates package's own files (dpkg -L), and of those /etc/ca-certificates.conf
# enables (what update-ca-certificates makes the bundle from, with /usr/local/share/ca-certificates);
# dpkg's check of the package's files against the digests it installed them with; the local CA folder
# and apt's settings.
TRUST_STORE = r"""
import base64, hashlib, json, os, re, subprocess
PEM = re.compile(r"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", re.S)
def certs(path):
    text = open(path).read()
    return {hashlib.sha256(base64.b64decode("".join(b.split()))).hexdigest() for b in PEM.findall(text)}
files = subprocess.run(["dpkg", "-L", "ca-certificates"], capture_output=True, text=True, check=True).stdout
package = set().union(*(certs(f) for f in files.splitlines() if f.endswith(".crt") and os.path.isfile(f)))
conf = [line.strip() for line in open("/etc/ca-certificates.conf") if line.strip()[:1] not in ("", "#", "!")]
enabled = set().union(*(certs(f"/usr/share/ca-certificates/{c}") for c in conf
                        if os.path.isfile(f"/usr/share/ca-certificates/{c}")))
bundle = certs("/etc/ssl/certs/ca-certificates.crt")
verify = subprocess.run(["dpkg", "--verify", "ca-certificates"], capture_output=True, text=True)
print(json.dumps({"bundle": sorted(bundle), "package": len(package),
                  "not_the_package_s": sorted(bundle - package), "not_enabled": sorted(bundle ^ enabled),
                  "verify": [verify.returncode, verify.stdout + verify.stderr],
                  "local": sorted(os.listdir("/usr/local/share/ca-certificates")),
                  "apt": sorted(os.listdir("/etc/apt/apt.conf.d"))}))
"""
PEM = re.compile(r"-----BEGIN CERTIFICATE-----(.*?)-----END CERTIFICATE-----", re.S)


def test_no_proxy_ca_in_the_image(image):
    """The host's extra CAs (a TLS-intercepting proxy's) reach the build's apt steps as a BuildKit
    secret only: the image's CA bundle is exactly what update-ca-certificates makes from the
    ca-certificates package's own certificates (none of another origin, whatever this host trusts),
    its local CA folder is empty, apt's settings hold no CA. And none of the host's extra CAs, where
    it has some, is in the bundle."""
    proc = in_image("python", "-c", TRUST_STORE)
    assert proc.returncode == 0, proc.stdout[-3000:]
    store = json.loads(proc.stdout.strip().splitlines()[-1])
    bundle = set(store["bundle"])
    assert len(bundle) > 100 and store["package"] >= len(bundle), (len(bundle), store["package"])
    assert store["not_the_package_s"] == [], f"CAs in the image's bundle that Debian does not ship: {store}"
    assert store["not_enabled"] == [], f"the bundle is not what update-ca-certificates makes: {store}"
    assert store["verify"] == [0, ""], f"the ca-certificates package's files were changed: {store['verify']}"
    assert store["local"] == [] and "99ca" not in store["apt"], (store["local"], store["apt"])
    for crt in Path("/usr/local/share/ca-certificates").glob("**/*.crt"):
        blocks = PEM.findall(crt.read_text())
        assert blocks, f"{crt}: no PEM certificate in it (update-ca-certificates reads PEM only)"
        for block in blocks:
            fingerprint = hashlib.sha256(base64.b64decode("".join(block.split()))).hexdigest()
            assert fingerprint not in bundle, f"{crt} is in the image"


def test_horovod_check_build(image):
    proc = in_image("horovodrun", "--check-build")
    assert proc.returncode == 0
    for item in ("PyTorch", "Gloo"):
        assert re.search(rf"\[X\] {item}\s*$", proc.stdout, re.M), f"{item} missing:\n{proc.stdout}"


def release(os_release: str) -> str:
    """'debian 12' from an /etc/os-release text: what docker/build.sh compares."""
    fields = dict(line.split("=", 1) for line in os_release.splitlines() if "=" in line)
    return " ".join(fields.get(k, "").strip('"') for k in ("ID", "VERSION_ID"))


def skip_unless_the_host_runs_the_bases_release() -> None:
    base = sh(DOCKER, "run", "--rm", "--network", "none", "--entrypoint", "cat",
              versions.values()["PIN_CPU_BASE_IMAGE"], "/etc/os-release")
    assert base.returncode == 0, base.stdout
    here = release(Path("/etc/os-release").read_text())
    if release(base.stdout) != here:
        pytest.skip(f"this host runs {here}, the CPU base {release(base.stdout)}: the image compiles its own")


HOROVOD_LIB = f"horovod/torch/mpi_lib_v2.{sys.implementation.cache_tag}-x86_64-linux-gnu.so"
SITE = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"


def test_the_cpu_image_uses_the_horovod_compiled_here(image):
    """The host runs the CPU base's release: the builder stage took the wheel build_horovod.sh
    compiled for this host's virtualenv (docker/build.sh's .prebuilt/) instead of compiling its own,
    byte for byte, and the checks above and below run it."""
    skip_unless_the_host_runs_the_bases_release()
    ours = hashlib.sha256((REPO / ".venv/base" / SITE / HOROVOD_LIB).read_bytes()).hexdigest()
    proc = in_image("sha256sum", f"/opt/venv/{SITE}/{HOROVOD_LIB}")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert proc.stdout.split()[0] == ours


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
    # DLC_GIT_COMMIT, baked in at build time: this checkout's commit ("-dirty" after it when the
    # tree had changes)
    head = sh("git", "rev-parse", "HEAD").stdout.strip()
    assert manifest["git_commit"].startswith(head), (manifest["git_commit"], head)


def test_grafana_gets_rays_dashboards_from_the_image_not_from_a_session_folder(image):
    """The grafana role's task, as the head runs it (its argv, its code): Ray's own generators in
    the image, no network, a read-only root, not root, make every dashboard Ray's dashboard writes
    into its session folder (which jobs can write, and root would install from)."""
    tasks = yaml.safe_load((REPO / "ansible/roles/grafana/tasks/install.yml").read_text())
    task = next(t for t in tasks if t["name"].startswith("Make Ray's dashboards"))
    role_vars = yaml.safe_load((REPO / "ansible/roles/grafana/vars/main.yml").read_text())
    code = role_vars["grafana_ray_dashboards_code"]
    argv = [{"{{ dlc_image }}": IMAGE, "{{ grafana_ray_dashboards_code }}": code}.get(a, a)
            for a in task["ansible.builtin.command"]["argv"]]
    assert argv[:2] == ["docker", "run"] and {"--network", "none", "--read-only"} <= set(argv), argv
    proc = subprocess.run([DOCKER, *argv[1:]], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = json.loads(proc.stdout)
    import ray.dashboard.modules.metrics.metrics_head as head  # what Ray writes per session
    written = set(re.findall(r'"(\w+_grafana_dashboard\.json)"', Path(head.__file__).read_text()))
    assert written and written <= set(made), (sorted(written), sorted(made))
    default = json.loads(made["default_grafana_dashboard.json"])
    assert default["uid"] == "rayDefaultDashboard" and default["panels"], default.get("uid")


def test_image_report(image, image_build):
    proc = sh(sys.executable, "-m", "dlcluster", "image-report", env={"IMAGE": IMAGE})
    assert proc.returncode == 0
    sizes = dict(re.findall(r"^(.+?)\s+([0-9.]+ [MG]B)$", proc.stdout, re.M))
    groups = ["OS packages + Python venv", "torch + torchvision (+ CUDA wheels)",
              "rest of the stack (tensorflow, ray, onnx...)", "horovod + user"]
    for group in groups:  # every layer group found in the image, none empty
        assert group in sizes and float(sizes[group].split()[0]) > 0, (group, proc.stdout)
    assert sizes["torch + torchvision (+ CUDA wheels)"].endswith("GB")
    # the fixture's own build is the report's latest of its kind (cold: no step cached, on a new
    # machine; warm: some), with the seconds and step counts docker/build.sh printed for it, stamped
    # within the seconds it ran
    done = re.search(rf"^image: {re.escape(IMAGE)} built in (\d+) s \(base (\d+) s, wheelhouse (\d+) s, "
                     r"docker build (\d+) s; (\d+) of (\d+) steps cached\)", image_build["output"], re.M)
    assert done, image_build["output"][-3000:]
    total, t_base, t_wheels, t_build, cached, steps = done.groups()
    kind = "cold" if cached == "0" else "warm"
    line = re.search(rf"^{kind}: {total} s on (\S+) \(base image {t_base} s, wheelhouse {t_wheels} s, "
                     rf"docker build {t_build} s; {cached} of {steps} steps cached\)$", proc.stdout, re.M)
    assert line, (done.group(0), proc.stdout)
    when = (image_build["started"], line.group(1), image_build["ended"])
    assert when[0] <= when[1] <= when[2], when


def test_gpu_build_without_its_base_says_how_to_get_it():
    proc = sh("docker/build.sh", env={"GPU": "1", "BASE_IMAGE": "dlcluster/no-such-base:0"}, timeout=300)
    assert proc.returncode != 0
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("image: error: base image dlcluster/no-such-base:0 is not in the local engine")
    assert "docker load" in last or "load -i" in last


def test_a_base_whose_packages_are_not_signed_by_the_keyring_is_refused():
    """docker/mkbase.sh checks every package against the keyring (debootstrap --force-check-gpg):
    with a keyring that did not sign the release (Debian's removed keys) it stops at the Release
    file, in one line, and no image is made."""
    name = "dlcluster/base-unsigned:bookworm"
    sh("docker", "image", "rm", "-f", name)
    proc = sh("docker/mkbase.sh", "--force", name,
              env={"KEYRING": "/usr/share/keyrings/debian-archive-removed-keys.gpg"}, timeout=300)
    assert proc.returncode != 0
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("mkbase: error: debootstrap failed; log: "), last
    log_file = Path(last.split("log: ", 1)[1])
    log = log_file.read_text()
    log_file.unlink()
    assert "E: Release signed by unknown key" in log, log
    assert sh("docker", "image", "inspect", name).returncode != 0


NO_NVCC = "no nvcc (CUDA toolkit) on this machine: the GPU image's stand-in base cannot be made"


@pytest.fixture(scope="module")
def gpu_image(image):
    """docker/Dockerfile's GPU path on a stand-in for the CUDA base (the Debian base + this machine's
    CUDA toolkit, docker/cuda-standin.sh), Horovod's NCCL operations for one architecture
    (CUDA_ARCHS=90): everything the GPU image holds but the driver and NVIDIA's cuDNN package,
    which no job uses (torch and TensorFlow bring their own cuDNN wheels)."""
    if shutil.which("nvcc") is None:
        pytest.skip(NO_NVCC)
    proc = sh("docker/cuda-standin.sh", timeout=600)
    assert proc.returncode == 0, proc.stdout
    base = proc.stdout.strip().splitlines()[-1]
    gpu = "dlcluster:gpu-standin"
    proc = sh("docker/build.sh", env={"GPU": "1", "BASE_IMAGE": base, "IMAGE": gpu, "CUDA_ARCHS": "90"},
              timeout=3600)
    assert proc.returncode == 0, f"docker/build.sh GPU=1 failed:\n{proc.stdout[-4000:]}"
    return gpu


def in_gpu_image(gpu_image: str, *cmd: str, volumes: dict | None = None, timeout: int = 600):
    args = [DOCKER, "run", "--rm", "--network", NETWORK, f"--shm-size={SHM}"]
    for host, target in (volumes or {}).items():
        args += ["-v", f"{host}:{target}"]
    return sh(*args, gpu_image, *cmd, timeout=timeout)


def test_gpu_image_path_compiles_horovod_with_nccl(gpu_image):
    """Horovod compiled with NCCL operations, checked by the build (check-build lists NCCL) and
    here. A broken GPU build fails here even without a GPU; running NCCL needs one."""
    code = ("import torch, horovod.torch as hvd; hvd.init(); "
            "print(hvd.nccl_built(), hvd.cuda_built(), hvd.gloo_built())")
    proc = in_gpu_image(gpu_image, "python", "-c", code)
    assert proc.returncode == 0, proc.stdout[-3000:]
    nccl, cuda, gloo = proc.stdout.strip().splitlines()[-1].split()
    assert int(nccl) > 0 and cuda == "True" and gloo == "True"


def test_the_gpu_standin_uses_the_nccl_horovod_compiled_here(gpu_image):
    """The stand-in base carries this host's CUDA toolkit: docker/build.sh compiled the NCCL flavour
    on the host, once per key (a purged image store does not compile it again), and the builder
    stage took that wheel, byte for byte; the test above runs it."""
    skip_unless_the_host_runs_the_bases_release()
    # the key of this checkout's patch (scripts/build_horovod.sh): older patches' wheels stay cached
    patch = next((REPO / "patches").glob("horovod-*.patch"))
    sha = hashlib.sha256(patch.read_bytes()).hexdigest()[:16]
    wheels = sorted(versions.cache_dir().glob(f"wheels/horovod-*-patch{sha}-nccl-cc90/horovod-*.whl"))
    assert len(wheels) == 1, wheels
    ours = hashlib.sha256(zipfile.ZipFile(wheels[0]).read(HOROVOD_LIB)).hexdigest()
    proc = in_gpu_image(gpu_image, "sha256sum", f"/opt/venv/{SITE}/{HOROVOD_LIB}")
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert proc.stdout.split()[0] == ours


# Which CUDA libraries an environment's nvidia-* wheels hold, loaded the way the framework's loader
# does (dlopen by file name from its own package folders, dependencies first), and their versions
# as the libraries themselves report them. No GPU or driver is needed to load them.
CUDA_LIBS = r"""
import ctypes, json, site, sys
from pathlib import Path
roots = [Path(p) / "nvidia" for p in site.getsitepackages()]
found = {}
for root in roots:
    for lib in sorted(root.glob("**/lib/lib*.so*")):
        found.setdefault(lib.name, str(lib))
want = json.loads(sys.argv[1])
loaded, failed = {}, {}
for _ in range(3):  # the libraries need each other: retry what failed once the rest are in
    for name in want:
        if name in loaded or name not in found:
            continue
        try:
            ctypes.CDLL(found[name], mode=ctypes.RTLD_GLOBAL)
            loaded[name] = found[name]
            failed.pop(name, None)
        except OSError as e:
            failed[name] = str(e)
def call(name, fn, *out):
    v = ctypes.c_int()
    getattr(ctypes.CDLL(found[name]), fn)(*([ctypes.byref(v)] if not out else out))
    return v.value
versions = {}
if "libcudart.so.12" in loaded or "libcudart.so.13" in loaded:
    versions["cudart"] = call(next(n for n in loaded if n.startswith("libcudart")), "cudaRuntimeGetVersion")
if "libcudnn.so.9" in loaded:
    lib = ctypes.CDLL(found["libcudnn.so.9"]); lib.cudnnGetVersion.restype = ctypes.c_size_t
    versions["cudnn"] = lib.cudnnGetVersion()
if "libnccl.so.2" in loaded:
    versions["nccl"] = call("libnccl.so.2", "ncclGetVersion")
print(json.dumps({"missing": sorted(set(want) - set(found)), "failed": failed,
                  "where": loaded, "versions": versions}))
"""
TF_LIBS = ["libcudart.so.12", "libcublasLt.so.12", "libcublas.so.12", "libcufft.so.11", "libcurand.so.10",
           "libnvJitLink.so.12", "libcusparse.so.12", "libcusolver.so.11", "libcudnn.so.9", "libnccl.so.2"]
TORCH_LIBS = ["libcudart.so.13", "libcublasLt.so.13", "libcublas.so.13", "libcudnn.so.9", "libnccl.so.2"]


def load_report(gpu_image: str, python: str, libs: list[str]) -> dict:
    proc = in_gpu_image(gpu_image, python, "-c", CUDA_LIBS, json.dumps(libs))
    assert proc.returncode == 0, proc.stdout[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["missing"] == [] and report["failed"] == {}, report
    return report


def test_gpu_image_tensorflow_has_its_cuda_12_libraries(gpu_image):
    """TensorFlow's virtualenv (DLC_TF_PYTHON) holds the CUDA 12 libraries TF was built for, they
    load, and they are the versions TF's build names; it holds no torch (whose CUDA 13 libraries
    share the file names)."""
    code = ("import json, os, sys, importlib.util as u, tensorflow as tf; b = tf.sysconfig.get_build_info(); "
            "print(json.dumps({'python': sys.executable, 'env': os.environ['DLC_TF_PYTHON'], "
            "'cuda': b['cuda_version'], 'cudnn': b['cudnn_version'], "
            "'torch': u.find_spec('torch') is not None}))")
    proc = in_gpu_image(gpu_image, "/opt/tf-venv/bin/python", "-c", code)
    assert proc.returncode == 0, proc.stdout[-3000:]
    build = json.loads(proc.stdout.strip().splitlines()[-1])
    assert build["env"] == build["python"] == "/opt/tf-venv/bin/python" and not build["torch"], build
    assert build["cuda"].startswith("12.") and build["cudnn"].split(".")[0] == "9", build
    report = load_report(gpu_image, "/opt/tf-venv/bin/python", TF_LIBS)
    assert all(p.startswith("/opt/tf-venv/") for p in report["where"].values()), report["where"]
    v = report["versions"]
    assert v["cudart"] // 1000 == 12 and v["cudart"] >= int(build["cuda"].replace(".", "")[:2]) * 1000, v
    assert v["cudnn"] // 10000 == int(build["cudnn"].split(".")[0]) and v["nccl"] // 10000 == 2, v


def test_gpu_image_torch_has_its_cuda_13_libraries(gpu_image):
    """The main environment's torch: CUDA 13 libraries, the cuDNN and NCCL torch was built with."""
    code = ("import json, torch; print(json.dumps({'cuda': torch.version.cuda, "
            "'cudnn': torch.backends.cudnn.version(), 'nccl': list(torch.cuda.nccl.version())}))")
    proc = in_gpu_image(gpu_image, "python", "-c", code)
    assert proc.returncode == 0, proc.stdout[-3000:]
    build = json.loads(proc.stdout.strip().splitlines()[-1])
    assert build["cuda"].startswith("13."), build
    report = load_report(gpu_image, "python", TORCH_LIBS)
    assert all(p.startswith("/opt/venv/") for p in report["where"].values()), report["where"]
    v = report["versions"]
    assert v["cudart"] // 1000 == 13 and v["cudnn"] == build["cudnn"], (v, build)
    major, minor, patch = build["nccl"]
    assert v["nccl"] == major * 10000 + minor * 100 + patch, (v, build)


def test_gpu_image_tf_job_on_ray_runs_its_workers_in_tensorflow_s_environment(gpu_image, tmp_path):
    """The TF job through Ray in the GPU image: the driver in /opt/venv, its workers in
    /opt/tf-venv (the runtime env's py_executable, from the node's DLC_TF_PYTHON); trains, exports,
    verifies. `--use-gpu true` where TensorFlow sees no GPU is one line, not a CPU run."""
    home = tmp_path / "dlcluster"
    home.mkdir()
    home.chmod(0o777)  # the image's user is not root
    proc = in_gpu_image(gpu_image, "python", "jobs/tf_cnn.py", "--launcher", "ray", "--num-workers", "1",
                        "--per-class", "8", "--batch-size", "4", "--epochs", "1", "--name", "tfvenv",
                        volumes={home: "/home/dlc/dlcluster"}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    manifest = json.loads((home / "models" / "tfvenv" / "manifest.json").read_text())
    assert manifest["metrics"]["worker_python"] == "/opt/tf-venv/bin/python", manifest["metrics"]
    assert manifest["launcher"] == "ray" and manifest["parity"]["max_abs_diff"] <= 1e-4
    proc = in_gpu_image(gpu_image, "/opt/tf-venv/bin/python", "jobs/tf_cnn.py", "--launcher", "local",
                        "--use-gpu", "true", "--per-class", "8", "--epochs", "1", "--name", "nogpu",
                        volumes={home: "/home/dlc/dlcluster"})
    assert proc.returncode != 0
    last = proc.stdout.strip().splitlines()[-1]
    assert "--use-gpu true but TensorFlow 2.21.0 sees no GPU (built for CUDA 12." in last, last
    assert not (home / "runs" / "nogpu").exists()
