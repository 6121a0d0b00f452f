#!/usr/bin/env bash
# make submit / make demo: `ray job submit` of jobs/JOB.py to the current cluster: the README's
# line, plus the checkout's commit as data (DLC_SUBMIT_COMMIT), with the job API address and token
# from the cluster record ($DLC_CONFIG/cluster.json, trainkit/record.py).
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
client_env=$(.venv/bin/python -m trainkit.record env) || exit 2   # one line on a bad record
eval "$client_env"
api=${RAY_ADDRESS#http://}
(exec 3<>"/dev/tcp/${api%:*}/${api##*:}") 2>/dev/null \
  || die "nothing answers on the job API $RAY_ADDRESS of the cluster record; run make cluster-up (for a remote cluster: it reopens the tunnel)"
# The commit travels as data (the upload carries no history): "-dirty" when tracked files changed.
runtime_env=()
if commit=$(git rev-parse HEAD 2>/dev/null); then
  [ -z "$(git status --porcelain -uno)" ] || commit+=-dirty
  runtime_env=(--runtime-env-json "{\"env_vars\": {\"DLC_SUBMIT_COMMIT\": \"$commit\"}}")
fi
exec .venv/bin/ray job submit --address "$RAY_ADDRESS" --working-dir . "${runtime_env[@]}" \
  -- python "jobs/$job.py" "$@"
