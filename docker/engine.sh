#!/usr/bin/env bash
# Make sure a Docker engine answers, for the image targets and tests.
#
# usage: docker/engine.sh
#   A running engine is left alone. Otherwise, as root on Debian/Ubuntu: install Debian's
#   docker.io when /usr/bin/docker is missing, start dockerd in the background (log:
#   /var/log/dlcluster-dockerd.log) and wait until it answers. Prints nothing on success.
#
# The client is always /usr/bin/docker from docker.io with DOCKER_BUILDKIT=1: a newer docker
# CLI (28.x) insists on buildx for builds, which Debian does not package.
set -euo pipefail

DOCKER=${DOCKER:-/usr/bin/docker}
die() { echo "engine: error: $*" >&2; exit 1; }

if [ -x "$DOCKER" ] && "$DOCKER" info >/dev/null 2>&1; then exit 0; fi

# one apt-get at a time: make test's lanes install what they lack side by side (on a fresh machine
# lint's install of its shell linter lost dpkg's lock to the emulated lane's docker.io and that
# linter was skipped, 2026-12-02); tests/browser.py takes the same lock for Chromium
apt=(flock -w 900 /var/lock/dlcluster-apt.lock apt-get)
if [ ! -x "$DOCKER" ]; then
  [ "$(id -u)" = 0 ] || die "no $DOCKER and not root: install Debian's docker.io (apt-get install docker.io) or set DOCKER=/path/to/docker"
  command -v apt-get >/dev/null || die "no $DOCKER and no apt-get: install a Docker engine (20.10 or newer) and set DOCKER=/path/to/docker"
  echo "engine: installing Debian's docker.io (apt-get)"
  log=/var/log/dlcluster-apt-docker.log
  { "${apt[@]}" update -qq && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq docker.io; } >"$log" 2>&1 \
    || die "apt-get install docker.io failed; log: $log"
  [ -x "$DOCKER" ] || die "docker.io is installed but there is no $DOCKER: set DOCKER=/usr/bin/docker"
fi

# an engine that is still starting (another caller, a boot script) gets its chance first
if pgrep -x dockerd >/dev/null; then
  for _ in $(seq 30); do "$DOCKER" info >/dev/null 2>&1 && exit 0; sleep 1; done
  die "dockerd is running but does not answer on its socket; see its log, or stop it and run again"
fi
[ "$(id -u)" = 0 ] || die "no Docker engine is running and only root can start one: start dockerd (or the docker service), or add yourself to the docker group"
command -v dockerd >/dev/null || die "dockerd not found: apt-get install docker.io"

echo "engine: starting dockerd (log: /var/log/dlcluster-dockerd.log)"
# setsid: the engine outlives this script and make; it is the machine's engine from now on
setsid dockerd >/var/log/dlcluster-dockerd.log 2>&1 </dev/null &
for _ in $(seq 60); do
  if "$DOCKER" info >/dev/null 2>&1; then exit 0; fi
  sleep 1
done
die "dockerd did not answer within 60 s; last lines of /var/log/dlcluster-dockerd.log: $(tail -n 3 /var/log/dlcluster-dockerd.log | tr '\n' ' ')"
