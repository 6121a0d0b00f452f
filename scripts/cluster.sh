#!/usr/bin/env bash
# make cluster-up / cluster-status / cluster-down / attach / rotate-token / remove-node / upgrade.
#
#   usage: scripts/cluster.sh up|status|down|attach|rotate-token|remove-node (NODE=...)|upgrade
#
# INVENTORY empty: the embedded local cluster on this machine (dlcluster/local_cluster.py).
# INVENTORY set:   real (or emulated) servers through their bastion: the playbook
#                  ansible/cluster-<action>.yml. Ansible's output goes to the terminal and to
#                  $DLC_CONFIG/clusters/<inventory folder>/<action>.log; a failure ends with one
#                  line naming the host and the problem.
set -euo pipefail
cd "$(dirname "$0")/.."

action=${1:-}
case "$action" in up|status|down) what=cluster-$action ;; attach|rotate-token|remove-node|upgrade) what=$action ;; *) what=cluster ;; esac
die() { echo "$what: error: $*" >&2; exit 2; }
[ "$what" != cluster ] || die "usage: $0 up|status|down|attach|rotate-token|remove-node|upgrade"

# One cluster-up/down per cluster at a time: a second one is one line naming the holder. Bash
# holds the lock (fd 9) until it exits; what it starts runs with fd 9 closed (ansible-playbook:
# 9>&-; Python closes it for Ray's daemons), so nothing left running (the tunnel) keeps it.
lock_cluster() {  # $1 cluster name
  [ "$action" != status ] || return 0
  local dir=${DLC_CONFIG:?DLC_CONFIG is not set: run this through make, which sets it}/clusters/$1
  mkdir -p "$dir" && chmod 700 "$dir"
  exec 9>>"$dir/lock"
  flock -n 9 || die "another run (cluster-up, cluster-down, rotate-token, attach) of cluster $1 is running ($(cat "$dir/lock" 2>/dev/null)); wait for it to end, or stop that process"
  echo "pid $$: cluster-$action since $(date '+%F %T')" >"$dir/lock"
}

if [ -z "${INVENTORY:-}" ]; then
  [ "$what" = "cluster-$action" ] || die "$action is for servers: set INVENTORY=ansible/inventories/<name>/hosts.yml (the local cluster has its token here already)"
  lock_cluster local
  exec .venv/bin/python -m dlcluster.local_cluster "$action"
fi

[ -e "$INVENTORY" ] || die "no inventory $INVENTORY: copy ansible/inventories/example to ansible/inventories/<name> and edit it"
inventory=$(realpath "$INVENTORY")
[ -x .venv-ansible/bin/ansible-playbook ] || die "no .venv-ansible: run make setup"
[ -x .venv/bin/python ] || die "no .venv: run make setup"
# The tunnel's local ends on this machine, one per service of roles/cluster_defaults's dlc_services (its Make
# variable, else its default): ports, one each (ssh would stop only at the end of the run)
tunnel=()
ends=$(.venv/bin/python -m dlcluster.services tunnel-args 2>&1) || die "$ends"
while read -r end; do tunnel+=(-e "$end"); done <<<"$ends"

# The cluster's name is its inventory's folder (as roles/cluster_defaults works it out).
if [ -d "$inventory" ]; then name=$(basename "$inventory"); else name=$(basename "$(dirname "$inventory")"); fi
[[ $name =~ ^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$ ]] \
  || die "the cluster's name is its inventory's folder, '$name': rename the folder to letters, digits, . _ - (it names the cluster's files and goes into the ssh config)"
config=${DLC_CONFIG:?DLC_CONFIG is not set: run this through make, which sets it}
[[ $config =~ ^[A-Za-z0-9._~/@:+%=,-]+$ ]] \
  || die "DLC_CONFIG is '$config': it goes into the ssh config and commands as one word, so it may hold no spaces or quotes: choose another folder"
mkdir -p "$config/clusters/$name" && chmod 700 "$config/clusters/$name"
log="$config/clusters/$name/$action.log"

lock_cluster "$name"

# a playbook per action (ansible/cluster-<action>.yml); remove-node: the worker NODE names
# (dlc_remove_node: drained, its Ray stopped, out of every list and the record)
playbook=cluster-$action.yml removal=()
if [ "$action" = remove-node ]; then
  [[ ${NODE:-} =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] \
    || die "NODE='${NODE:-}': name the worker to take out, as the inventory does: make remove-node NODE=node-2 INVENTORY=$INVENTORY"
  removal=(-e "dlc_remove_node=$NODE")
fi

export ANSIBLE_CONFIG="$PWD/ansible/ansible.cfg"
# Ansible's own connection sockets, per cluster and config folder: an old connection can never
# stand in for the generated ssh config (ControlPersist hides a broken config otherwise). In
# ~/.ssh under a short hash, like the tunnel's socket: a unix socket's path must stay under 108
# bytes, whatever the config folder's path.
ANSIBLE_SSH_CONTROL_PATH_DIR="$HOME/.ssh/dlc-cp-$(printf %s "$config/clusters/$name" | sha1sum | cut -c1-12)"
mkdir -p "$ANSIBLE_SSH_CONTROL_PATH_DIR" && chmod 700 "$HOME/.ssh" "$ANSIBLE_SSH_CONTROL_PATH_DIR"
export ANSIBLE_SSH_CONTROL_PATH_DIR
export DLC_PROGRESS_DIR="$config/clusters/$name/progress"  # image shipping progress (callback_plugins/dlc_progress.py)
export ANSIBLE_FORCE_COLOR=${ANSIBLE_FORCE_COLOR:-0} PYTHONUNBUFFERED=1

token_before=$(cksum 2>/dev/null <"$config/clusters/$name/ray_token" || true)  # remove-node: re-keyed?
read -r -a extra <<<"${ANSIBLE_ARGS:-}"  # e.g. "--limit node-2 -v": words, no globbing
set +e
(cd ansible && ../.venv-ansible/bin/ansible-playbook -i "$inventory" \
   "${tunnel[@]}" "${removal[@]}" "${extra[@]}" "$playbook") 9>&- 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
set -e
if [ "$rc" -ne 0 ]; then
  .venv-ansible/bin/python scripts/ansible_failure.py "$log" "$what" >&2 || true
  exit "$rc"
fi

if [ "$action" = upgrade ]; then
  echo "upgrade: cluster $name runs what $INVENTORY and this checkout say, every node checked after its restart (the log: $log)"
fi
if [ "$action" = remove-node ]; then
  if [ "$(cksum <"$config/clusters/$name/ray_token" 2>/dev/null || true)" != "$token_before" ]; then
    keys="the cluster re-keyed (a new token, run-history credentials and CA; Ray restarted on every node): its token and certificate, or copies of them, are refused"
  else
    keys="its secrets are gone from it, and make rotate-token (a new token and CA, Ray restarted, no job running) refuses copies of them (dlc_remove_node_rekey: false kept the others running)"
  fi
  echo "remove-node: $NODE is out of cluster $name: drained, its Ray stopped and disabled, left out of every node list and the cluster record; $keys; now delete it from $INVENTORY (a cluster-up that still lists it provisions it again and it rejoins)"
fi

# The first cluster-up of new servers records their performance baseline (make baseline) while they
# are idle; a failure there leaves the cluster up, and the note for the next run.
due="$config/clusters/$name/baseline-due"
if [ "$action" = up ] && [ -e "$due" ]; then
  echo "cluster-up: new servers: recording their performance baseline (make baseline, about a minute)"
  if .venv/bin/python -m dlcluster baseline; then rm -f "$due"
  else echo "cluster-up: warning: the cluster is up, but no performance baseline was recorded (above): make baseline once that is fixed" >&2
  fi
fi
