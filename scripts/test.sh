#!/usr/bin/env bash
# make test: `make setup`, and beside it what the image and emulated tiers need before their first
# test and no Python environment does: the Docker engine (docker/engine.sh), the base image
# (docker/mkbase.sh) and the wheelhouse (scripts/wheelhouse.sh). On a fresh machine that is about
# 5 minutes the emulated lane would otherwise spend after setup, on the run's longest path; setup
# installs from files on disk and compiles Horovod meanwhile. Where they are there already (a second
# run) each step returns in a second. Then the lanes: scripts/test_suite.py with these arguments.
#
#   usage: scripts/test.sh [test_suite.py's options] LANE [LANE...]
#
# A step that fails here is not the run's failure: the tier that needs it runs the same script
# again and fails with its own line. Its output: $DLC_CACHE/test-prepare.log.
set -euo pipefail
cd "$(dirname "$0")/.."
. ./versions.env  # DEFAULT_CACHE_IN_HOME, DEFAULT_PYTHON
CACHE=${DLC_CACHE:-$HOME/$DEFAULT_CACHE_IN_HOME}

# bad lanes (TEST_LANES) are one line before anything is installed or built
"${PYTHON:-$DEFAULT_PYTHON}" scripts/test_suite.py --check-lanes "$@" || exit

prepare=0
for arg in "$@"; do  # a lane is TIER[,TIER...]; only root installs and runs an engine
  if [[ ,$arg, =~ ,(image|emulated), ]] && [ "$(id -u)" = 0 ]; then prepare=1; fi
done

pid='' log=$CACHE/test-prepare.log
if [ "$prepare" = 1 ]; then
  mkdir -p "$CACHE"
  start=$SECONDS
  { docker/engine.sh && docker/mkbase.sh && scripts/wheelhouse.sh >/dev/null; } >"$log" 2>&1 &
  pid=$!
fi
scripts/setup.sh
if [ -n "$pid" ]; then
  if wait "$pid"; then
    echo "test: beside setup, the Docker engine, the base image and the wheelhouse ready ($((SECONDS - start)) s from the start; log: $log)"
  else
    echo "test: preparing the Docker engine, the base image or the wheelhouse failed (log: $log); the tier that needs them says why"
  fi
fi
exec .venv/bin/python scripts/test_suite.py "$@"
