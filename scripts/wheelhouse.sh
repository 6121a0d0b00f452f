#!/usr/bin/env bash
# make wheels: a wheelhouse holding every wheel of the project's pinned stack, so that the image
# build installs it with no index (pip --no-index) and fetches nothing the machine already has.
#
# usage: scripts/wheelhouse.sh [--link DIR]
#   prints the wheelhouse's path: $DLC_CACHE/wheelhouse/<key>, where the key
#   is the runtime's (scripts/envkey.py --runtime-key: Python version, the runtime pins and
#   versions.env's pip and Horovod sdist; the test tools' pins are not in it). It holds
#     *.whl               the pins in pyproject.toml and everything they pull in, plus pip,
#                         setuptools and wheel (pip wheel: an sdist-only package becomes a wheel);
#     requirements.txt    what the image installs: the runtime pins, one a line;
#     constraints.txt     every version of the project's virtualenv (pip freeze), when it exists,
#                         so the image resolves to exactly the packages the client has;
#     horovod-<PIN_HOROVOD>.tar.gz  the sdist scripts/build_horovod.sh compiles (checked by its sha256);
#     torch/              hard links to torch, torchvision, their dependencies, pip, setuptools and
#                         wheel, with a requirements.txt pinning each (the image's first layer).
#     tf/                 with --tf-cuda only: TensorFlow's own environment for the GPU image, the
#                         runtime pins without torch, torchvision and onnxscript, with
#                         tensorflow[and-cuda] (its CUDA 12 libraries: nvidia-*-cu12, about 3 GB,
#                         which torch's CUDA 13 wheels would shadow in one environment), fully
#                         pinned in tf/requirements.txt; collected once (tf/.complete).
#   --link DIR  also mirror it into DIR (hard links, so no second copy on the same file system):
#               make image links it into .whl/ in the repository, the docker build context;
#               DIR/tf/ is empty unless --tf-cuda is given too (a CPU build's context stays small).
# pip wheel takes its files from pip's configuration (find-links, extra indexes, its cache); the
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

key=$("$PYTHON" scripts/envkey.py --runtime-key)
house=$CACHE/wheelhouse/$key

if [ ! -f "$house/.complete" ]; then
  echo "wheelhouse: collecting the pinned stack into $house (first time for these pins; minutes)" >&2
  rm -rf "$house"
  mkdir -p "$house"
  # The image's runtime requirements: the project's pins (dev tools stay out of images).
  "$PYTHON" - >"$house/requirements.txt" <<'EOF'
import tomllib
for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    print(r)
EOF
  # Horovod's own run-time needs (it is compiled, not in the pins) and the build tools.
  printf '%s\n' cloudpickle psutil pyyaml packaging cffi >>"$house/requirements.txt"
  venv=$CACHE/venv-$("$PYTHON" scripts/envkey.py)  # the client's virtualenv, when it is built
  if [ -f "$venv/.complete" ]; then
    "$venv/bin/python" -m pip freeze --exclude-editable | grep -E '^[A-Za-z0-9_.-]+==' >"$house/constraints.txt"
  else
    : >"$house/constraints.txt"
  fi
  "$PYTHON" -m pip wheel --progress-bar off -q -w "$house" -r "$house/requirements.txt" \
    -c "$house/constraints.txt" "pip==$PIN_PIP" "setuptools>=68" wheel >"$house/pip.log" 2>&1 \
    || die "pip wheel failed; log: $house/pip.log"
  # the Horovod sdist: build_horovod.sh's cached copy, else the package index
  src=$CACHE/wheels/src/$HVD_SDIST
  if [ -f "$src" ]; then cp "$src" "$house/"; else
    "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$house" "horovod==$PIN_HOROVOD" >>"$house/pip.log" 2>&1 \
      || die "pip download horovod==$PIN_HOROVOD failed; log: $house/pip.log"
  fi
  # torch/: torch + torchvision, what they pull in and the packaging tools, fully pinned. The image
  # installs this first and compiles Horovod against it alone, so changing any other pin reuses
  # both layers. (pip download copies; the copies are then swapped for hard links.)
  grep -E '^(torch|torchvision)==' "$house/requirements.txt" >"$house/torch.in"
  "$PYTHON" -m pip download -q --no-index --find-links "$house" -c "$house/constraints.txt" -d "$house/torch" \
    -r "$house/torch.in" "pip==$PIN_PIP" "setuptools>=68" wheel >>"$house/pip.log" 2>&1 \
    || die "pip download of the torch subset failed; log: $house/pip.log"
  for f in "$house"/torch/*.whl; do
    ln -f "$house/${f##*/}" "$f"
    n=${f##*/}; echo "${n%%-*}==$(cut -d- -f2 <<<"$n")"
  done >"$house/torch/requirements.txt"
  rm "$house/torch.in"
  touch "$house/.complete"
  for old in "$CACHE"/wheelhouse/*; do  # wheelhouses of earlier pins: 4 GB each
    if [ "$old" != "$house" ]; then echo "wheelhouse: removing the outdated $old" >&2; rm -rf "$old"; fi
  done
fi

if [ "$tf_cuda" = 1 ] && [ ! -f "$house/tf/.complete" ]; then
  echo "wheelhouse: collecting TensorFlow's CUDA 12 environment into $house/tf (first time; about 3 GB)" >&2
  rm -rf "$house/tf"
  mkdir -p "$house/tf"
  { grep -vE '^(torch|torchvision|onnxscript|tensorflow)==' "$house/requirements.txt"
    sed -n 's/^tensorflow==/tensorflow[and-cuda]==/p' "$house/requirements.txt"; } >"$house/tf/requirements.in"
  # the CUDA 12 wheels come from the package index; the rest are the house's own files
  "$PYTHON" -m pip download -q --find-links "$house" -c "$house/constraints.txt" -d "$house/tf" \
    -r "$house/tf/requirements.in" "pip==$PIN_PIP" "setuptools>=68" wheel >>"$house/pip.log" 2>&1 \
    || die "pip download of TensorFlow's CUDA 12 environment failed; log: $house/pip.log"
  for f in "$house"/tf/*.whl; do
    n=${f##*/}
    if [ -f "$house/$n" ]; then ln -f "$house/$n" "$f"; fi
    echo "${n%%-*}==$(cut -d- -f2 <<<"$n")"
  done >"$house/tf/requirements.txt"
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
