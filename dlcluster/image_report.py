"""make image-report: an image's size per layer group, and its build times, cold and warm.

Sizes come from `docker history` (each layer's own bytes); the groups follow docker/Dockerfile's
steps. Build times come from $DLC_CACHE/image-builds.tsv, which docker/build.sh appends to: a build
with no cached step is cold, one that reused the cache is warm. Environment: IMAGE (dlcluster:cpu),
DOCKER (/usr/bin/docker), DLC_CACHE (versions.env's default).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from trainkit.versions import cache_dir

DOCKER = os.environ.get("DOCKER", "/usr/bin/docker")
IMAGE = os.environ.get("IMAGE") or "dlcluster:cpu"
CACHE = cache_dir()

GROUPS = [  # (name, text of the step that made the layer), in build order
    ("OS packages + Python venv", "apt-get"),
    ("torch + torchvision (+ CUDA wheels)", "slim_cuda.sh"),
    ("rest of the stack (tensorflow, ray, onnx...)", "pip check"),
    ("horovod + user", "horovod-*.whl"),
]


def fail(msg: str) -> None:
    sys.exit(f"image-report: error: {msg}")


def docker(*args: str) -> str:
    proc = subprocess.run([DOCKER, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        fail(f"docker {' '.join(args[:2])}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def layers(image: str) -> list[tuple[int, str]]:
    """(bytes, step) of each layer, oldest first."""
    out = docker("history", "--no-trunc", "--human=false", "--format", "{{.Size}}\t{{.CreatedBy}}", image)
    rows = [line.split("\t", 1) for line in out.splitlines() if line]
    return [(int(size), step) for size, step in reversed(rows)]


def gb(n: float) -> str:
    return f"{n / 1e9:6.2f} GB" if n >= 1e8 else f"{n / 1e6:6.2f} MB"


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(prog="dlcluster image-report", description=(__doc__ or "").split("\n\n")[0]
                            ).parse_args(argv)
    if subprocess.run([DOCKER, "image", "inspect", IMAGE], capture_output=True).returncode != 0:
        fail(f"no image {IMAGE} (make image first, or set IMAGE=)")
    base = docker("image", "inspect", "-f", '{{index .Config.Labels "dlcluster.base"}}', IMAGE).strip()
    own = layers(IMAGE)
    n_base = len(layers(base)) if base and base != "<no value>" else 0
    sizes = {f"base image ({base or 'unknown'})": sum(s for s, _ in own[:n_base])}
    for name, _ in GROUPS:
        sizes[name] = 0
    sizes["project (trainkit, jobs) + settings"] = 0
    for size, step in own[n_base:]:
        name = next((n for n, text in GROUPS if text in step), "project (trainkit, jobs) + settings")
        sizes[name] += size
    print(f"{IMAGE}: size per layer group")
    for name, size in sizes.items():
        print(f"{name:48s} {gb(size)}")
    print(f"{'total':48s} {gb(sum(sizes.values()))}")

    log = CACHE / "image-builds.tsv"
    rows = [r.split("\t") for r in log.read_text().splitlines()] if log.exists() else []
    rows = [r for r in rows if len(r) == 9 and r[1] == IMAGE]
    print(f"\n{IMAGE}: build times (docker/build.sh, from {log})")
    for label, pick in (("cold", lambda r: r[8] == "0"), ("warm", lambda r: r[8] != "0")):
        match = [r for r in rows if pick(r)]
        if not match:
            print(f"{label}: no such build recorded")
            continue
        when, _, _, total, t_base, t_wheels, t_build, steps, cached = match[-1]
        print(f"{label}: {total} s on {when} (base image {t_base} s, wheelhouse {t_wheels} s, "
              f"docker build {t_build} s; {cached} of {steps} steps cached)")


if __name__ == "__main__":
    main()
