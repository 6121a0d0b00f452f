#!/usr/bin/env bash
# make stage-gpu: put what a bare, offline GPU machine lacks for the GPU tier (tests/gpu) into one
# folder, to be carried there with the checkout (scripts/gpu_tier.sh runs the tier from it):
#   - Ray's wheel for that machine's Python, without ray/jars/ (Ray for Java: 32 of its 79 MB;
#     Python jobs never load it), its RECORD rewritten to match;
#   - the small packages Ray and Ray Train need that such a machine lacks (jsonschema and its
#     family, pydantic and its family, tensorboardX) and cffi for Horovod's build;
#   - the Horovod sdist (the patch is in the checkout: patches/).
# The language model's test takes Transformers from the GPU machine (the lent machines' image holds
# it, with tokenizers and safetensors): its 13 MiB do not fit beside Ray's 51 (scripts/gpu_tier.sh
# names the version it found, or that the test will be skipped).
# Versions are this project's environment's, for the Python of the GPU machine.
#
#   usage: scripts/stage_gpu.sh [DIR]     DIR: default .gpu-stage (git-ignored)
#   GPU_PYTHON_VERSION=3.12               the GPU machine's Python (major.minor)
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "stage-gpu: error: $*" >&2; exit 2; }

dir=${1:-.gpu-stage}
pyver=${GPU_PYTHON_VERSION:-3.12}
[[ $pyver =~ ^3\.[0-9]+$ ]] || die "GPU_PYTHON_VERSION=$pyver is not major.minor, e.g. 3.12"
py=.venv/bin/python
[ -x "$py" ] || die "no .venv: run make setup first"
limit=$((60 * 1024 * 1024))

packages=(ray jsonschema referencing rpds-py jsonschema-specifications pydantic pydantic-core
          annotated-types typing-inspection tensorboardX cffi pycparser)
pins=$("$py" - "${packages[@]}" <<'PY'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
PY
)
rm -rf "$dir" && mkdir -p "$dir"
echo "stage-gpu: downloading for CPython $pyver: $pins"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
# shellcheck disable=SC2086  # one pin a word
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${platforms[@]}" -d "$dir" $pins || die "pip download failed (is the package index reachable?)"

echo "stage-gpu: repacking Ray's wheel without ray/jars/"
"$py" - "$dir" <<'PY'
import sys, zipfile
from pathlib import Path
(wheel,) = Path(sys.argv[1]).glob("ray-*.whl")
slim = wheel.with_suffix(".slim")
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if item.filename.startswith("ray/jars/"):
            continue
        data = src.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if not l.startswith(b"ray/jars/"))
        dst.writestr(item, data)
slim.replace(wheel)
PY

. ./versions.env
sdist=${DLC_CACHE:-$HOME/$DEFAULT_CACHE_IN_HOME}/wheels/src/horovod-$PIN_HOROVOD.tar.gz
[ -f "$sdist" ] || die "no $sdist: make setup downloads it (scripts/build_horovod.sh)"
cp "$sdist" "$dir/"

size=$(du -sb "$dir" | cut -f1)
[ "$size" -le "$limit" ] || die "$dir holds $((size / 1024 / 1024)) MiB, over the 60 MiB that may travel with the checkout"
echo "stage-gpu: $dir ready, $((size / 1024 / 1024)) MiB ($(find "$dir" -type f | wc -l) files); on the GPU machine: scripts/gpu_tier.sh $dir"
