#!/usr/bin/env bash
# make submit / make demo: `ray job submit` of jobs/JOB.py to the current cluster: the README's
# line, plus the checkout's commit as data (DLC_SUBMIT_COMMIT), with the job API address and token
# from the cluster record ($DLC_CONFIG/cluster.json, dlcluster/record.py). What travels is what git
# tracks, and the files UPLOAD names, staged in a private folder (dlcluster/upload.py): nothing else.
# Each submission is kept ($DLC_CONFIG/clusters/<cluster>/runs/<run>.json, dlcluster/submissions.py)
# with its run name (--name; one is chosen here when the flags have none), so that
# `make resume RUN=...` submits the same job and flags again after the head lost its driver.
#   usage: [UPLOAD="data/x.csv ..."] ray/submit.sh JOB [job flags...]
#          ray/submit.sh --resume RUN
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "submit: error: $*" >&2; exit 2; }

[ $# -ge 1 ] || die "usage: $0 JOB [flags], or $0 --resume RUN"
if [ "$1" = --resume ]; then
  { [ $# -eq 2 ] && [ -n "$2" ]; } || die "usage: $0 --resume RUN (make resume RUN=<the run's name>)"
  mapfile -d '' -t saved < <(set +e; .venv/bin/python -m dlcluster.submissions resume "$2"; printf '\0%s' "$?")
  [ "${saved[-1]}" = 0 ] || exit 2   # one line said why
  unset 'saved[-1]'
  resumed=$2; job=${saved[0]}; set -- "${saved[@]:1}"
  echo "resume: run $resumed again, from its last checkpoint: jobs/$job.py $*"
else
  job=$1; shift
fi
if [ ! -f "jobs/$job.py" ]; then
  jobs=(jobs/*.py); jobs=("${jobs[@]#jobs/}")
  die "no jobs/$job.py; JOB is one of: ${jobs[*]%.py}"
fi
# the client env: KEY=VALUE lines, read as data (never evaluated)
client_env=$(.venv/bin/python -m dlcluster.record env) || exit 2   # one line on a bad record
while IFS= read -r line; do
  line=${line#export }
  [[ $line =~ ^[A-Z_][A-Z0-9_]*= ]] || continue
  export "${line%%=*}=$(.venv/bin/python -c 'import shlex, sys; print(shlex.split(sys.argv[1])[0] if sys.argv[1] else "")' "${line#*=}")"
done <<<"$client_env"
api=${RAY_ADDRESS#http://}
(exec 3<>"/dev/tcp/${api%:*}/${api##*:}") 2>/dev/null \
  || die "nothing answers on the job API $RAY_ADDRESS of the cluster record; run make cluster-up (for a remote cluster: it reopens the tunnel)"
# The commit travels as data (the upload carries no history): "-dirty" when tracked files changed.
# So does where this operator's browser reaches the run history (the record's tunnel end): the
# links the run prints.
commit=$(git rev-parse HEAD 2>/dev/null) && { [ -z "$(git status --porcelain -uno)" ] || commit+=-dirty; }
env_json=$(DLC_SUBMIT_COMMIT=${commit:-} .venv/bin/python -m dlcluster.record runtime-env) || exit 2
runtime_env=(--runtime-env-json "$env_json")
stage=$(mktemp -d "${TMPDIR:-/tmp}/dlc-upload.XXXXXXXX")   # 0700, a name nobody can guess
trap 'rm -rf "$stage"' EXIT
read -ra named <<<"${UPLOAD:-}"
.venv/bin/python -m dlcluster.upload "$stage" "${named[@]}" || exit 2
# kept under the run's name (--name, added when the flags have none): its submission id and flags
mapfile -d '' -t kept < <(set +e; .venv/bin/python -m dlcluster.submissions keep "${commit:-unknown}" "$job" "$@"
                          printf '\0%s' "$?")
[ "${kept[-1]}" = 0 ] || exit 2   # one line said why
unset 'kept[-1]'
submission=${kept[0]}; set -- "${kept[@]:1}"
RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1 .venv/bin/ray job submit --address "$RAY_ADDRESS" \
  --submission-id "$submission" --working-dir "$stage" "${runtime_env[@]}" -- python "jobs/$job.py" "$@"
