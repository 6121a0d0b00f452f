#!/usr/bin/env bash
# make wheels: a wheelhouse holding every wheel of the lock's runtime part, so that the image build
# installs it with no index (pip --no-index) and fetches nothing the machine already has.
#
# usage: scripts/wheelhouse.sh [--tf-cuda] [--link DIR]
#   prints the wheelhouse's path: $DLC_CACHE/wheelhouse/<key>, where the key is the runtime's
#   (dlcluster/envkey.py --runtime-key: Python version, the lock's runtime and TensorFlow-CUDA lines,
#   versions.env's pip and Horovod sdist; the test tools are not in it). It holds
#     *.whl               the lock's runtime part (dlcluster/envkey.py --runtime: what the runtime pins
#                         and Horovod's needs pull in), each file checked against its hash, and pip;
#     requirements.txt    what the image installs: those packages with their hashes;
#     horovod-<PIN_HOROVOD>.tar.gz  the sdist scripts/build_horovod.sh compiles (checked by its sha256);
#     torch/              hard links to torch, torchvision, what they pull in, setuptools, wheel and
#                         pip, with requirements.txt (envkey.py --torch, hashed): the image's first layer.
#     tf/                 with --tf-cuda only: TensorFlow's own environment for the GPU image,
#                         docker/tf-cuda.lock as tf/requirements.txt (the runtime part without
#                         torch, torchvision and onnxscript, with tensorflow[and-cuda]: its CUDA 12
#                         libraries, about 3 GB, which torch's CUDA 13 wheels would shadow in one
#                         environment); collected once (tf/.complete).
#   --link DIR  also mirror it into DIR (hard links, so no second copy on the same file system):
#               make image links it into .whl/ in the repository, the docker build context;
#               DIR/tf/ is empty unless --tf-cuda is given too (a CPU build's context stays small).
# pip download takes its files from pip's configuration (find-links, extra indexes, its cache); the
# first run takes minutes (about 7 GB), later ones return at once (a .complete marker).
set -euo pipefail
cd "$(dirname "$0")/.."

. ./versions.env  # DEFAULT_PYTHON, PIN_PIP, PIN_HOROVOD, ... (the one place for each)
PYTHON=${PYTHON:-$DEFAULT_PYTHON}
CACHE=${DLC_CACHE:-$HOME/$DEFAULT_CACHE_IN_HOME}
HVD_SDIST=horovod-$PIN_HOROVOD.tar.gz
die() { echo "wheelhouse: error: $*" >&2; exit 1; }

usage="usage: $0 [--tf-cuda] [--link DIR]"
link='' tf_cuda=0
while [ $# -gt 0 ]; do
  case $1 in
    --tf-cuda) tf_cuda=1; shift ;;
    --link) [ $# -ge 2 ] || die "$usage"; link=$2; shift 2 ;;
    *) die "$usage" ;;
  esac
done
command -v "$PYTHON" >/dev/null || die "$PYTHON not found; install $DEFAULT_PYTHON (versions.env) or set PYTHON=/path/to/$DEFAULT_PYTHON"

key=$("$PYTHON" -m dlcluster.envkey --runtime-key)
house=$CACHE/wheelhouse/$key
# pip download of files, without their dependencies (the lock lists every one), logged in the house
get() { "$PYTHON" -m pip download --progress-bar off -q --no-deps "$@" >>"$house/pip.log" 2>&1; }
# a collection that runs out of disk leaves pip's log cut short: say so first, before anything
need_gb() {
  mkdir -p "$CACHE"
  local free; free=$(df -Pk "$CACHE" | awk 'NR == 2 {print int($4 / 1048576)}')
  [ "$free" -ge "$1" ] || die "$free GB free under $CACHE, $2 needs about $1 GB: free some (docker builder prune, docker image prune, an older wheelhouse) and run it again"
}

if [ ! -f "$house/.complete" ]; then
  need_gb 5 "collecting the wheelhouse"
  echo "wheelhouse: collecting the locked stack into $house (first time for this lock; minutes)" >&2
  rm -rf "$house"
  mkdir -p "$house"
  # what the image installs: the lock's runtime part with its hashes; pip download checks every
  # file against them, wheels only (a package without a wheel for this platform stops here)
  "$PYTHON" -m dlcluster.envkey --runtime >"$house/requirements.txt"
  get --require-hashes --only-binary :all: -d "$house" -r "$house/requirements.txt" \
    || die "pip download of the locked runtime failed; log: $house/pip.log"
  get -d "$house" "pip==$PIN_PIP" || die "pip download pip==$PIN_PIP failed; log: $house/pip.log"
  # the Horovod sdist: build_horovod.sh's cached copy, else the package index
  src=$CACHE/wheels/src/$HVD_SDIST
  if [ -f "$src" ]; then cp "$src" "$house/"; else
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$house" "horovod==$PIN_HOROVOD" >>"$house/pip.log" 2>&1 \
      || die "pip download horovod==$PIN_HOROVOD failed; log: $house/pip.log"
  fi
  # torch/: torch + torchvision, what they pull in and the packaging tools, from the lock. The image
  # installs this first and compiles Horovod against it alone, so changing any other pin reuses
  # both layers. (pip download copies from the house; the copies are then swapped for hard links.)
  mkdir "$house/torch"
  "$PYTHON" -m dlcluster.envkey --torch >"$house/torch/requirements.txt"
  get --require-hashes --no-index --find-links "$house" -d "$house/torch" -r "$house/torch/requirements.txt" \
    || die "pip download of the torch subset failed; log: $house/pip.log"
  for f in "$house"/torch/*.whl; do ln -f "$house/${f##*/}" "$f"; done
  ln -f "$house"/pip-"$PIN_PIP"-*.whl "$house/torch/"
  touch "$house/.complete"
  for old in "$CACHE"/wheelhouse/*; do  # wheelhouses of earlier pins: 4 GB each
    if [ "$old" != "$house" ]; then echo "wheelhouse: removing the outdated $old" >&2; rm -rf "$old"; fi
  done
fi

if [ "$tf_cuda" = 1 ] && [ ! -f "$house/tf/.complete" ]; then
  need_gb 4 "TensorFlow's CUDA 12 environment"
  echo "wheelhouse: collecting TensorFlow's CUDA 12 environment into $house/tf (first time; about 3 GB)" >&2
  rm -rf "$house/tf"
  mkdir -p "$house/tf"
  cp docker/tf-cuda.lock "$house/tf/requirements.txt"
  # the CUDA 12 wheels come from the package index; the rest are the house's own files
  get --require-hashes --only-binary :all: --find-links "$house" -d "$house/tf" -r "$house/tf/requirements.txt" \
    || die "pip download of TensorFlow's CUDA 12 environment failed; log: $house/pip.log"
  for f in "$house"/tf/*.whl; do
    if [ -f "$house/${f##*/}" ]; then ln -f "$house/${f##*/}" "$f"; fi
  done
  ln -f "$house"/pip-"$PIN_PIP"-*.whl "$house/tf/"
  if grep -qiE '^torch(vision)?==' "$house/tf/requirements.txt"; then die "TensorFlow's environment pulled in torch"; fi
  touch "$house/tf/.complete"
fi

if [ -n "$link" ]; then
  rm -rf "$link"
  mkdir -p "$link"
  # hard links where the file system allows, a copy where it does not
  cp -al "$house"/. "$link"/ 2>/dev/null || { rm -rf "$link"; cp -a "$house" "$link"; }
  if [ "$tf_cuda" = 0 ]; then rm -rf "$link/tf"; mkdir "$link/tf"; fi
fi
echo "$house"
