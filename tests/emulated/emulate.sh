#!/usr/bin/env bash
# The emulated cluster: real servers as containers on this machine, for `make emulate-up` and CI.
#
#   usage: tests/emulated/emulate.sh up|down|purge|status
#
#   up      a bastion on a public and a private docker network, three nodes on the private one
#           only (systemd, sshd, an `ops` sudo account; node-3 may also run a Docker engine, for
#           the docker runtime: the cgroup tree writable and its own disk for /var/lib/docker, so
#           the engine the docker_engine role installs runs containers), a docker volume mounted at
#           /srv/dlcluster on every node as the operator-named shared storage, and the host
#           blocked from the private network (iptables), so the only way in is ssh through the
#           bastion. The ssh key is made here at run time ($DLC_CONFIG/emulated/id_ed25519) and
#           only its public half is put into the containers. Then provision it like real servers:
#           make cluster-up INVENTORY=ansible/inventories/emulated/hosts.yml
#   down    remove the containers (a fourth node's too), networks, shared volume and the iptables
#           rules (the tier's jump-host test's too); the key and the servers' data disks stay (the
#           bastion's registry storage, node-3's /var/lib/docker), as a real site's disks outlive a
#           reinstall: images are then cached by content, and the next run moves only the layers
#           that changed
#   purge   down, and the data disks too
#   status  what is running
#
# Addresses are fixed because ansible/inventories/emulated/hosts.yml names them:
# public 172.31.250.0/24 (bastion .10), private 172.31.251.0/24 (bastion .10, node-N .1N).
# node-1 also has a "public" interface, 172.31.252.11 and fd00:dc:252::11 on a third network
# (internal: no way out; IPv4 and IPv6), as real servers often do, and an outsider (172.31.252.99,
# fd00:dc:252::99, not part of the cluster) sits there.
# The bastion answers ssh on 22 (ops, with sudo: it runs the package proxy) and on 2222 (jump,
# no sudo: a jump host only). A gateway (public .20, same logins) stands in for an outer hop.
set -euo pipefail
cd "$(dirname "$0")/../.."
. ./versions.env  # PIN_CPU_BASE_IMAGE (the one place for each)

DOCKER=${DOCKER:-/usr/bin/docker}
export DOCKER_BUILDKIT=1
CONFIG=${DLC_CONFIG:?DLC_CONFIG is not set: run this through make, which sets it}
KEYDIR=$CONFIG/emulated
# EMULATE_NODES="node-1 node-2 node-3 node-4": a fourth node (the tier's added node), up to node-9
read -r -a NODES <<<"${EMULATE_NODES:-node-1 node-2 node-3}"
ALL_NODES=(node-1 node-2 node-3 node-4 node-5 node-6 node-7 node-8 node-9)
PUB_NET=dlc-emu-public PUB_BRIDGE=dlc-emu-pub PUB_SUBNET=172.31.250.0/24
PRIV_NET=dlc-emu-private PRIV_BRIDGE=dlc-emu-priv PRIV_SUBNET=172.31.251.0/24
OUT_NET=dlc-emu-outside OUT_BRIDGE=dlc-emu-out OUT_SUBNET=172.31.252.0/24 OUT_SUBNET6=fd00:dc:252::/64
NODE1_OUT=172.31.252.11 OUTSIDER=172.31.252.99 NODE1_OUT6=fd00:dc:252::11 OUTSIDER6=fd00:dc:252::99
BASTION_PUB=172.31.250.10 BASTION_PRIV=172.31.251.10 GATEWAY_PUB=172.31.250.20
VOLUME=dlc-emu-shared
DIND_NODES=" node-3 " DISK_PREFIX=dlc-emu-disk-
NODE_IMAGE=dlcluster/emu-node BASTION_IMAGE=dlcluster/emu-bastion

say() { echo "emulate: $*"; }
die() { echo "emulate: error: $*" >&2; exit 2; }
node_ip() { echo "172.31.251.1${1#node-}"; }
exists() { "$DOCKER" inspect "$1" >/dev/null 2>&1; }

# Systemd as PID 1 in a container: its own /run, the capabilities this VM grants (--privileged
# fails on some VMs: 'unable to apply caps'), and the cgroup tree read-only (CGROUP_RO) except on a node
# with its own Docker engine.
SYSTEMD_OPTS=(--tmpfs /run --tmpfs /run/lock --cap-add ALL --cap-drop SYS_RESOURCE
              --security-opt seccomp=unconfined --security-opt systempaths=unconfined
              --restart unless-stopped)
CGROUP_RO=(-v /sys/fs/cgroup:/sys/fs/cgroup:ro)

# The rule the tier's jump-host test adds while it runs (test_40_operators.py: its `block`): this machine
# cannot open a connection to the bastion itself. A run killed in that test leaves it; down removes it.
JUMP_TEST_BLOCK=(OUTPUT -d "$BASTION_PUB" -p tcp -m conntrack --ctstate NEW -j REJECT)

block_host() {  # the host reaches the private network only through the bastion (the outside one: never)
  for bridge in "$PRIV_BRIDGE" "$OUT_BRIDGE"; do
    iptables -C OUTPUT -o "$bridge" -j REJECT 2>/dev/null || iptables -I OUTPUT -o "$bridge" -j REJECT
  done
}

install_key() {  # $1 container [$2 user, ops]: authorize the run-time key, as first-boot scripts do
  # shellcheck disable=SC2016  # expanded by the container's shell
  "$DOCKER" exec -i "$1" sh -c 'u=$0 && h=$(getent passwd "$u" | cut -d: -f6) &&
    install -d -m 700 -o "$u" -g "$u" "$h/.ssh" && cat >"$h/.ssh/authorized_keys" &&
    chown "$u:$u" "$h/.ssh/authorized_keys" && chmod 600 "$h/.ssh/authorized_keys"' "${2:-ops}" \
    <"$KEYDIR/id_ed25519.pub"
}

# $1 container: also as many sites run their jump hosts: sshd on port 2222 too, and a `jump`
# login with no sudo (another team's machine). The inventory picks which way in it uses.
jump_host() {
  "$DOCKER" exec "$1" sh -c 'id jump >/dev/null 2>&1 || useradd --create-home --shell /bin/bash jump
    if [ ! -f /etc/ssh/sshd_config.d/ports.conf ]; then
      printf "Port 22\nPort 2222\n" >/etc/ssh/sshd_config.d/ports.conf && systemctl restart ssh
    fi'
  install_key "$1" jump
}

wait_sshd() {  # $1 container
  for _ in $(seq 60); do
    "$DOCKER" exec "$1" systemctl is-active -q ssh 2>/dev/null && return 0
    sleep 1
  done
  die "sshd did not start in $1; see: $DOCKER exec $1 journalctl -u ssh"
}

# build server image $1 on base $2; the image the tag named before goes once replaced (a node image
# keeps its dlcluster:cpu alive: 7 GB per rebuilt project image), unless a container still uses it
build() {
  local replaced
  replaced=$("$DOCKER" image inspect -f '{{.Id}}' "$1" 2>/dev/null || true)
  "$DOCKER" build -q -t "$1" --build-arg BASE="$2" tests/emulated >/dev/null
  if [ -n "$replaced" ] && [ "$replaced" != "$("$DOCKER" image inspect -f '{{.Id}}' "$1")" ]; then
    "$DOCKER" image rm "$replaced" >/dev/null 2>&1 || true
  fi
}

up() {
  [ "$(id -u)" = 0 ] || die "the emulated cluster needs root (docker networks, iptables)"
  docker/engine.sh
  "$DOCKER" image inspect dlcluster:cpu >/dev/null 2>&1 \
    || die "no dlcluster:cpu image for the nodes: run make image first"
  say "building the server images (bastion: bare Debian; nodes: the project's image + sshd)"
  build "$BASTION_IMAGE" "$PIN_CPU_BASE_IMAGE"
  build "$NODE_IMAGE" dlcluster:cpu

  mkdir -p "$KEYDIR" && chmod 700 "$KEYDIR"
  if [ ! -f "$KEYDIR/id_ed25519" ]; then
    ssh-keygen -q -t ed25519 -N '' -C "dlcluster-emulated" -f "$KEYDIR/id_ed25519"
    say "made the ssh key $KEYDIR/id_ed25519"
  fi
  exists "$PUB_NET" || "$DOCKER" network create --subnet "$PUB_SUBNET" \
    -o com.docker.network.bridge.name="$PUB_BRIDGE" "$PUB_NET" >/dev/null
  exists "$PRIV_NET" || "$DOCKER" network create --internal --subnet "$PRIV_SUBNET" \
    -o com.docker.network.bridge.name="$PRIV_BRIDGE" "$PRIV_NET" >/dev/null
  exists "$OUT_NET" || "$DOCKER" network create --internal --subnet "$OUT_SUBNET" --ipv6 --subnet "$OUT_SUBNET6" \
    -o com.docker.network.bridge.name="$OUT_BRIDGE" "$OUT_NET" >/dev/null
  "$DOCKER" volume inspect "$VOLUME" >/dev/null 2>&1 || "$DOCKER" volume create "$VOLUME" >/dev/null
  block_host

  local fresh=()
  if ! exists dlc-emu-bastion; then
    # its data disk: the image registry's storage (docker_image_from: bastion)
    "$DOCKER" run -d --name dlc-emu-bastion --hostname bastion "${SYSTEMD_OPTS[@]}" "${CGROUP_RO[@]}" \
      -v "${DISK_PREFIX}bastion:/var/lib/docker-registry" \
      --network "$PUB_NET" --ip "$BASTION_PUB" "$BASTION_IMAGE" >/dev/null
    "$DOCKER" network connect --ip "$BASTION_PRIV" "$PRIV_NET" dlc-emu-bastion
    fresh+=("$BASTION_PUB" "$BASTION_PRIV")
  fi
  # an outer gateway in front of the bastion, for sites reached through two hops
  if ! exists dlc-emu-gateway; then
    "$DOCKER" run -d --name dlc-emu-gateway --hostname gateway "${SYSTEMD_OPTS[@]}" "${CGROUP_RO[@]}" \
      --network "$PUB_NET" --ip "$GATEWAY_PUB" "$BASTION_IMAGE" >/dev/null
    fresh+=("$GATEWAY_PUB")
  fi
  for n in "${NODES[@]}"; do
    exists "dlc-emu-$n" && continue
    local extra=("${CGROUP_RO[@]}")
    if [[ $DIND_NODES == *" $n "* ]]; then
      # a Docker engine of its own (docker-in-docker): every device, the cgroup tree
      # writable, a real filesystem for /var/lib/docker (overlay2 does not stack on overlay)
      extra=(--device-cgroup-rule 'a *:* rwm' -v /sys/fs/cgroup:/sys/fs/cgroup:rw
             -v "$DISK_PREFIX$n:/var/lib/docker")
    fi
    # --shm-size: Ray's object store and the DataLoaders live in /dev/shm (docker's is 64 MB)
    "$DOCKER" run -d --name "dlc-emu-$n" --hostname "$n" "${SYSTEMD_OPTS[@]}" "${extra[@]}" --shm-size 2g \
      --network "$PRIV_NET" --ip "$(node_ip "$n")" -v "$VOLUME:/srv/dlcluster" "$NODE_IMAGE" >/dev/null
    if [[ $DIND_NODES == *" $n "* ]]; then
      # as a site's own engine settings would: its containers' cgroups under the engine's own
      # (cgroupfs, relative), not beside this machine's containers; the docker_engine role keeps the file
      "$DOCKER" exec "dlc-emu-$n" sh -c 'mkdir -p /etc/docker && [ -f /etc/docker/daemon.json ] ||
        echo "{\"cgroup-parent\": \"dlc-node\"}" >/etc/docker/daemon.json'
    fi
    fresh+=("$(node_ip "$n")")
    if [ "$n" = node-1 ]; then
      "$DOCKER" network connect --ip "$NODE1_OUT" --ip6 "$NODE1_OUT6" "$OUT_NET" dlc-emu-node-1
      # Docker names every address of a container after its hostname in /etc/hosts; a server's
      # hostname does not resolve to its public IPv6 address (Horovod's Gloo fails with "address
      # family mismatch" where one does: docs/images.md)
      "$DOCKER" exec dlc-emu-node-1 sh -c "grep -v '^${NODE1_OUT6}[[:space:]]' /etc/hosts >/tmp/hosts && cat /tmp/hosts >/etc/hosts"
    fi
  done
  # The outsider may route to the private addresses through node-1's public one, as anyone on
  # that segment could: no systemd, no sshd, only Python to probe ports
  if ! exists dlc-emu-outsider; then
    "$DOCKER" run -d --name dlc-emu-outsider --hostname outsider --cap-add NET_ADMIN \
      --restart unless-stopped --network "$OUT_NET" --ip "$OUTSIDER" --ip6 "$OUTSIDER6" --entrypoint sleep \
      "$BASTION_IMAGE" infinity >/dev/null
  fi
  [ "$("$DOCKER" inspect -f '{{.State.Running}}' dlc-emu-outsider)" = true ] || "$DOCKER" start dlc-emu-outsider >/dev/null
  "$DOCKER" exec dlc-emu-outsider ip route replace "$PRIV_SUBNET" via "$NODE1_OUT"
  for c in dlc-emu-gateway dlc-emu-bastion "${NODES[@]/#/dlc-emu-}"; do
    [ "$("$DOCKER" inspect -f '{{.State.Running}}' "$c")" = true ] || "$DOCKER" start "$c" >/dev/null
    wait_sshd "$c"
    install_key "$c"
  done
  jump_host dlc-emu-bastion
  jump_host dlc-emu-gateway
  # New containers are new machines with new host keys: forget the old ones in the cluster's
  # known_hosts (any other host key change is still refused there).
  local kh=$CONFIG/clusters/emulated/known_hosts
  if [ -f "$kh" ]; then
    for ip in "${fresh[@]}"; do
      for h in "$ip" "[$ip]:2222"; do ssh-keygen -q -R "$h" -f "$kh" >/dev/null 2>&1 || true; done
    done
  fi
  say "up: bastion $BASTION_PUB (public) / $BASTION_PRIV (private); nodes ${NODES[*]} on $PRIV_SUBNET"
  say "next: make cluster-up INVENTORY=ansible/inventories/emulated/hosts.yml"
}

down() {
  for c in "${ALL_NODES[@]/#/dlc-emu-}" dlc-emu-bastion dlc-emu-gateway dlc-emu-outsider; do
    exists "$c" && "$DOCKER" rm -f "$c" >/dev/null && say "removed $c"
  done
  for net in "$PRIV_NET" "$PUB_NET" "$OUT_NET"; do
    exists "$net" || continue
    # and the unnamed containers the tests start on them (strangers, probes: docker run --rm), as a
    # killed run leaves them: a network with a container on it cannot be removed
    "$DOCKER" ps -aq --filter "network=$net" | xargs -r "$DOCKER" rm -f >/dev/null
    "$DOCKER" network rm "$net" >/dev/null
  done
  "$DOCKER" volume rm "$VOLUME" >/dev/null 2>&1 || true
  for bridge in "$PRIV_BRIDGE" "$OUT_BRIDGE"; do
    while iptables -D OUTPUT -o "$bridge" -j REJECT 2>/dev/null; do :; done
  done
  while iptables -D "${JUMP_TEST_BLOCK[@]}" 2>/dev/null; do :; done
  say "down (the key in $KEYDIR and the data disks stay: $(disks | tr '\n' ' '))"
}

disks() { "$DOCKER" volume ls -q --filter "name=^$DISK_PREFIX"; }

purge() {
  down
  for d in $(disks); do "$DOCKER" volume rm "$d" >/dev/null && say "removed the disk $d"; done
}

status() {
  "$DOCKER" ps -a --filter name=dlc-emu- --format '{{.Names}}\t{{.Status}}\t{{.Networks}}'
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  purge) purge ;;
  status) status ;;
  *) die "usage: $0 up|down|purge|status" ;;
esac
