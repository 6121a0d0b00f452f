#!/usr/bin/env bash
# make lint: ruff (Python), shellcheck (shell scripts; installed from Debian as root when missing),
# yamllint and ansible-lint with the production profile (ansible/).
set -euo pipefail
cd "$(dirname "$0")/.."

.venv/bin/ruff check .
if ! command -v shellcheck >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "lint: installing Debian's shellcheck"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck; } >/dev/null 2>&1 || true
fi
if command -v shellcheck >/dev/null; then
  shellcheck scripts/*.sh docker/*.sh ray/*.sh tests/emulated/*.sh .ci/run
else
  echo "lint: shellcheck not installed (apt-get install shellcheck); shell scripts not checked"
fi
cd ansible
../.venv-ansible/bin/yamllint -s .
# the emulated inventory gives the syntax check real groups to resolve
PATH="$(cd ../.venv-ansible/bin && pwd):$PATH" ANSIBLE_INVENTORY=inventories/emulated/hosts.yml NO_COLOR=1 \
  ../.venv-ansible/bin/ansible-lint -q --profile production --offline
