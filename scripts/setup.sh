#!/usr/bin/env bash
# make setup: the project's virtualenv at .venv, a link to a cached venv keyed by what it holds
# (Python version, pip's pin and requirements.lock; Horovod's wheel is cached by its own key). The
# first run builds it from the lock, every file checked against its hash (minutes: torch alone is
# 5.5 GB); every later run with the same key takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
. ./versions.env  # DEFAULT_PYTHON, PIN_PIP, PIN_HOROVOD, ... (the one place for each)

PYTHON=${PYTHON:-$DEFAULT_PYTHON}
CACHE=${DLC_CACHE:-$HOME/$DEFAULT_CACHE_IN_HOME}
command -v "$PYTHON" >/dev/null || { echo "setup: $PYTHON not found; install $DEFAULT_PYTHON (versions.env) or set PYTHON=/path/to/$DEFAULT_PYTHON" >&2; exit 1; }

key=$("$PYTHON" -m dlcluster.envkey)
venv="$CACHE/venv-$key"

# One setup at a time per cache (two checkouts, or a test run beside a shell): a second one that
# found an environment half built would remove it under the first. It waits for the first instead.
mkdir -p "$CACHE"
exec 8>>"$CACHE/.setup.lock"
flock -n 8 || { echo "setup: another make setup is building in $CACHE; waiting for it to end"; flock 8; }

if [ ! -f "$venv/.complete" ]; then
  echo "setup: building the environment $venv (first time for this set of pins; several minutes)"
  rm -rf "$venv"
  mkdir -p "$CACHE"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade "pip==$PIN_PIP"
  # the whole lock, with its hashes: pip checks every file it installs (hash-checking mode)
  "$PYTHON" -m dlcluster.envkey --requirements >"$venv/requirements.txt"
  # The wheelhouse of this lock (`make wheels`, also what the image installs from), when there
  # is one: pip takes its wheels from there first (an air-gapped host can carry it over).
  house="$CACHE/wheelhouse/$("$PYTHON" -m dlcluster.envkey --runtime-key)"
  links=()
  if [ -f "$house/.complete" ]; then links=(--find-links "$house"); fi
  "$venv/bin/python" -m pip install --progress-bar off --require-hashes --no-deps "${links[@]}" \
    -r "$venv/requirements.txt"
  "$venv/bin/python" -m pip check
  touch "$venv/.complete"
  ln -sfn "$venv" .venv
  for old in "$CACHE"/venv-*; do  # environments of earlier pins: 9 GB each
    if [ "$old" != "$venv" ]; then echo "setup: removing the outdated environment $old"; rm -rf "$old"; fi
  done
fi
ln -sfn "$venv" .venv
# Horovod is compiled once per (horovod, torch, patch) and cached as a wheel (scripts/build_horovod.sh).
if [ -x scripts/build_horovod.sh ]; then scripts/build_horovod.sh .venv; fi
# Ansible and its linters, in a small environment of their own (.venv-ansible).
scripts/setup_ansible.sh
echo "setup: .venv -> $venv ready"
