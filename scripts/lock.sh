#!/usr/bin/env bash
# make lock: requirements.lock, the one lock the virtualenv, the wheelhouse and the images install
# from (dlcluster/envkey.py prints each one's part), and docker/tf-cuda.lock, the GPU image's
# TensorFlow environment (CUDA 12 wheels where torch brings CUDA 13), constrained to the same
# versions. uv (versions.env's PIN_UV, in a small cached environment of its own) compiles
# pyproject.toml's pins for the nodes' platform, every file with its sha256. Run it after changing
# a pin in pyproject.toml, and commit both files.
set -euo pipefail
cd "$(dirname "$0")/.."
. ./versions.env  # DEFAULT_PYTHON, PIN_UV, ... (the one place for each)
PYTHON=${PYTHON:-$DEFAULT_PYTHON}
CACHE=${DLC_CACHE:-$HOME/$DEFAULT_CACHE_IN_HOME}
die() { echo "lock: error: $*" >&2; exit 1; }
command -v "$PYTHON" >/dev/null || die "$PYTHON not found; install $DEFAULT_PYTHON (versions.env) or set PYTHON=/path/to/$DEFAULT_PYTHON"

tool=$CACHE/uv-$PIN_UV
if [ ! -x "$tool/bin/uv" ]; then
  rm -rf "$tool"
  "$PYTHON" -m venv "$tool"
  "$tool/bin/python" -m pip install -q --progress-bar off "uv==$PIN_UV" || die "pip install uv==$PIN_UV failed"
fi
pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
compile() {
  "$tool/bin/uv" pip compile --quiet --generate-hashes --python-version "$pyver" \
    --python-platform x86_64-manylinux_2_28 --custom-compile-command "make lock" "$@"
}
compile pyproject.toml --extra dev --extra horovod-deps -o requirements.lock
"$PYTHON" -m dlcluster.envkey --tf-cuda-in | compile - -c requirements.lock -o docker/tf-cuda.lock
echo "lock: requirements.lock ($(grep -c '^[a-z0-9]' requirements.lock) packages), docker/tf-cuda.lock ($(grep -c '^[a-z0-9]' docker/tf-cuda.lock)); commit both"
