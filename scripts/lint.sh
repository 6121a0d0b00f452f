#!/usr/bin/env bash
# make lint: ruff (Python), shellcheck (shell scripts, when installed), yamllint and ansible-lint
# with the production profile (ansible/).
set -euo pipefail
cd "$(dirname "$0")/.."

.venv/bin/ruff check .
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
