#!/usr/bin/env bash
# make lint: ruff and mypy (Python), shellcheck (shell scripts; installed from Debian as root when missing),
# yamllint and ansible-lint with the production profile (ansible/). Every linter runs; the exit
# code is non-zero if any failed. LINT_JUNIT=FILE: also a JUnit XML report, a case per linter
# (make test counts it like the other tiers).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
. ./versions.env  # DEFAULT_CACHE_IN_HOME

cases=() failures=0 skipped=0
step() {  # step NAME COMMAND...: run one linter, record its result
  local name=$1 start=$SECONDS; shift
  if "$@"; then cases+=("<testcase classname=\"lint\" name=\"$name\" time=\"$((SECONDS - start))\"/>")
  else
    failures=$((failures + 1))
    cases+=("<testcase classname=\"lint\" name=\"$name\" time=\"$((SECONDS - start))\"><failure message=\"$name failed\"/></testcase>")
  fi
}
ansible_lint() {
  # the emulated inventory gives the syntax check real groups to resolve
  (cd ansible && PATH="$(cd ../.venv-ansible/bin && pwd):$PATH" \
    ANSIBLE_INVENTORY=inventories/emulated/hosts.yml NO_COLOR=1 \
    ../.venv-ansible/bin/ansible-lint -q --profile production --offline)
}

step ruff .venv/bin/ruff check .
# pyproject.toml's [tool.mypy] says what it checks; its cache is kept out of the checkout (whose
# files travel with every job)
step mypy .venv-ansible/bin/mypy --python-executable .venv/bin/python \
  --cache-dir "${DLC_CACHE:-$HOME/$DEFAULT_CACHE_IN_HOME}/mypy"
# one apt-get at a time: make test's lanes install what they lack side by side (on a fresh machine
# lint's install of its shell linter lost dpkg's lock to the emulated lane's docker.io and that
# linter was skipped, 2026-12-02); tests/browser.py takes the same lock for Chromium
apt=(flock -w 900 /var/lock/dlcluster-apt.lock apt-get)
if ! command -v shellcheck >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "lint: installing Debian's shellcheck"
  { "${apt[@]}" update -qq && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq shellcheck; } >/dev/null 2>&1 || true
fi
if command -v shellcheck >/dev/null; then
  step shellcheck shellcheck scripts/*.sh docker/*.sh tests/emulated/*.sh .ci/run
else
  echo "lint: shellcheck not installed (apt-get install shellcheck); shell scripts not checked"
  skipped=1
  cases+=('<testcase classname="lint" name="shellcheck"><skipped message="shellcheck not installed (apt-get install shellcheck)"/></testcase>')
fi
step yamllint bash -c "cd ansible && ../.venv-ansible/bin/yamllint -s ."
step role-docs .venv/bin/python scripts/role_docs.py --check  # spec descriptions = defaults' comments
step ansible-lint ansible_lint

if [ -n "${LINT_JUNIT:-}" ]; then
  { echo "<testsuite name=\"lint\" tests=\"${#cases[@]}\" failures=\"$failures\" errors=\"0\" skipped=\"$skipped\">"
    printf '%s\n' "${cases[@]}"
    echo "</testsuite>"; } >"$LINT_JUNIT"
fi
[ "$failures" = 0 ] || { echo "lint: $failures linter(s) failed" >&2; exit 1; }
