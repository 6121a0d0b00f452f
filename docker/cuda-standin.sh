#!/usr/bin/env bash
# A stand-in for the CUDA devel base where no registry can be reached (this project's tests): the
# Debian base (docker/mkbase.sh) plus this machine's CUDA toolkit, the one nvcc belongs to, at
# /usr/local/cuda as in NVIDIA's images. Enough for docker/Dockerfile's GPU path to compile Horovod's
# NCCL operations; not a replacement for nvidia/cuda (no cuDNN, no driver libraries).
#
# usage: docker/cuda-standin.sh [NAME]   default dlcluster/cuda-standin:<CUDA version>; an existing
#                                        one is kept. Prints the image's name.
set -euo pipefail
cd "$(dirname "$0")/.."
. ./versions.env  # PIN_CPU_BASE_IMAGE (the one place for each)

DOCKER=${DOCKER:-/usr/bin/docker}
die() { echo "cuda-standin: error: $*" >&2; exit 1; }

nvcc=$(command -v nvcc) || die "no nvcc on PATH: this machine has no CUDA toolkit to copy"
# nvcc may be a wrapper script: ask it where it lives (as scripts/build_horovod.sh does)
bin=$("$nvcc" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -n 1)
if [ -z "$bin" ] || [ ! -f "$bin/../include/cuda_runtime.h" ]; then die "cannot locate the CUDA toolkit of $nvcc"; fi
toolkit=$(cd "$bin/.." && pwd -P)
version=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
name=${1:-dlcluster/cuda-standin:$version}

if "$DOCKER" image inspect "$name" >/dev/null 2>&1; then echo "$name"; exit 0; fi
docker/mkbase.sh >&2

ctx=$(mktemp -d /var/tmp/dlcluster-cuda.XXXXXX)
trap 'rm -rf "$ctx"' EXIT
cp -al "$toolkit" "$ctx/cuda" 2>/dev/null || cp -a "$toolkit" "$ctx/cuda"
cat >"$ctx/Dockerfile" <<EOF
FROM $PIN_CPU_BASE_IMAGE
COPY cuda /usr/local/cuda-$version
RUN ln -s cuda-$version /usr/local/cuda
ENV PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
EOF
echo "cuda-standin: making $name from $toolkit" >&2
DOCKER_BUILDKIT=1 "$DOCKER" build -q -t "$name" "$ctx" >/dev/null || die "docker build of $name failed"
echo "$name"
