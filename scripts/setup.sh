#!/usr/bin/env bash
# make setup: the project's virtualenv at .venv, over a cached venv keyed by what it holds (Python
# version, pip's pin and requirements.lock; Horovod's wheel is cached by its own key). The first run
# builds that from the lock, every file checked against its hash (minutes: torch alone is 5.5 GB);
# every later run with the same key takes seconds.
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
  for old in "$CACHE"/venv-*; do  # environments of earlier pins: 9 GB each
    if [ "$old" != "$venv" ]; then echo "setup: removing the outdated environment $old"; rm -rf "$old"; fi
  done
fi
# Horovod is compiled once per (horovod, torch, patch) and cached as a wheel (scripts/build_horovod.sh).
if [ -x scripts/build_horovod.sh ]; then scripts/build_horovod.sh "$venv"; fi

# The checkout's own environment, .venv: a thin virtualenv over the cached one (its packages through a
# .pth, .venv/base a link to it), with this checkout's packages (trainkit, dlcluster) installed editable
# and the operator's command, .venv/bin/dlcluster. The cached environment's commands (ray, pytest,
# torchrun, ...) are written again to run under .venv's Python. Seconds; nothing when nothing changed.
stamp="$venv $(sha256sum pyproject.toml | cut -c1-16) $PWD"
if [ "$(cat .venv/.overlay 2>/dev/null)" != "$stamp" ] || [ ! -x .venv/bin/dlcluster ]; then
  rm -rf .venv  # a link (setups before the overlay) or an overlay of other pins
  "$venv/bin/python" -m venv --without-pip .venv
  ln -s "$venv" .venv/base
  purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'; }
  printf 'import site; site.addsitedir(%s)\n' "'$(purelib "$venv/bin/python")'" \
    >"$(purelib .venv/bin/python)/_dlc_base.pth"
  for cmd in "$venv"/bin/*; do  # a script of the cached Python again under .venv's; a program linked
    name=${cmd##*/}
    case $name in activate*|Activate*|python*) continue ;; esac
    if head -n 3 "$cmd" | grep -q "$venv/bin/python"; then
      sed "1,3s|$venv/bin/python[0-9.]*|$PWD/.venv/bin/python|" "$cmd" >".venv/bin/$name"
      chmod 755 ".venv/bin/$name"
    else
      ln -s "$cmd" ".venv/bin/$name"
    fi
  done
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation --no-index -e .
  echo "$stamp" >.venv/.overlay
fi
# Ansible and its linters, in a small environment of their own (.venv-ansible).
scripts/setup_ansible.sh
echo "setup: .venv (over $venv) ready"
