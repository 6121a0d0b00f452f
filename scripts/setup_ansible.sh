#!/usr/bin/env bash
# The control host's Ansible and its linters (ansible/requirements.txt) in a small environment of
# their own at .venv-ansible: a link to $DLC_CACHE/ansible-<hash of Python + that file>, so a rerun
# takes milliseconds and a changed pin builds a new one. Called by scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

. ./versions.env  # DEFAULT_PYTHON, PIN_PIP, PIN_HOROVOD, ... (the one place for each)
PYTHON=${PYTHON:-$DEFAULT_PYTHON}
CACHE=${DLC_CACHE:-$HOME/$DEFAULT_CACHE_IN_HOME}
key=$({ "$PYTHON" --version; cat ansible/requirements.txt; } | sha256sum | cut -c1-16)
venv="$CACHE/ansible-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "setup: building the Ansible environment $venv"
  rm -rf "$venv"
  mkdir -p "$CACHE"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --progress-bar off -r ansible/requirements.txt
  touch "$venv/.complete"
  for old in "$CACHE"/ansible-*; do
    [ "$old" = "$venv" ] || rm -rf "$old"
  done
fi
ln -sfn "$venv" .venv-ansible
