#!/usr/bin/env bash
# make submit / make demo: `ray job submit` of jobs/JOB.py to the running local cluster, exactly
# the README's line, with the token from $DLC_CONFIG/ray-client.env.
#   usage: ray/submit.sh JOB [job flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "submit: error: $*" >&2; exit 2; }

[ $# -ge 1 ] || die "usage: $0 JOB [flags]"
job=$1; shift
if [ ! -f "jobs/$job.py" ]; then
  jobs=(jobs/*.py); jobs=("${jobs[@]#jobs/}")
  die "no jobs/$job.py; JOB is one of: ${jobs[*]%.py}"
fi
env_file=${DLC_CONFIG:-$HOME/.config/dlcluster}/ray-client.env
[ -f "$env_file" ] || die "no $env_file: no cluster was started here; run make cluster-up first"
port=${DASHBOARD_PORT:-8265}
(exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null \
  || die "nothing answers on the job API http://127.0.0.1:$port; run make cluster-up (or set DASHBOARD_PORT)"
# shellcheck source=/dev/null
. "$env_file"
exec .venv/bin/ray job submit --address "http://127.0.0.1:$port" --working-dir . -- python "jobs/$job.py" "$@"
