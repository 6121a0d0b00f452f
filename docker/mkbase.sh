#!/usr/bin/env bash
# A Debian base image made without any registry: debootstrap a minimal root file system and
# `docker import` it. For air-gapped sites, and for this project's tests (nothing is pulled).
#
# usage: docker/mkbase.sh [--force] [NAME]
#   NAME     the image to make (default: versions.env's PIN_CPU_BASE_IMAGE, with SUITE as its tag);
#            an existing one is kept unless --force
#   SUITE    Debian release (default: that image's tag, the release whose Python is the project's)
#   MIRROR   Debian mirror (default http://deb.debian.org/debian; a local mirror in air-gapped
#            sites)
#   KEYRING  the keys the mirror's Release file must be signed with (default Debian's archive
#            keyring); debootstrap stops on a bad or missing signature
# Needs root and debootstrap (installed from Debian's packages when missing). 1-3 minutes,
# about 120 MB. The image is plain Debian (minbase + ca-certificates); docker/Dockerfile adds
# Python and the rest.
set -euo pipefail

# shellcheck source=versions.env
. "$(dirname "$0")/../versions.env"  # PIN_CPU_BASE_IMAGE (the one place for each)
DOCKER=${DOCKER:-/usr/bin/docker}
SUITE=${SUITE:-${PIN_CPU_BASE_IMAGE##*:}}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
die() { echo "mkbase: error: $*" >&2; exit 1; }

force=0
if [ "${1:-}" = "--force" ]; then force=1; shift; fi
[ $# -le 1 ] || die "usage: $0 [--force] [NAME]"
name=${1:-${PIN_CPU_BASE_IMAGE%:*}:$SUITE}

"$(dirname "$0")/engine.sh"

if [ "$force" = 0 ] && "$DOCKER" image inspect "$name" >/dev/null 2>&1; then
  echo "mkbase: $name already exists (--force to make it again)"
  exit 0
fi
[ "$(id -u)" = 0 ] || die "debootstrap needs root"
# one apt-get at a time: make test's lanes install what they lack side by side (on a fresh machine
# lint's install of its shell linter lost dpkg's lock to the emulated lane's docker.io and that
# linter was skipped, 2026-12-02); tests/browser.py takes the same lock for Chromium
apt=(flock -w 900 /var/lock/dlcluster-apt.lock apt-get)
if ! command -v debootstrap >/dev/null; then
  echo "mkbase: installing debootstrap (apt-get)"
  { "${apt[@]}" update -qq && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq debootstrap; } \
    >/dev/null 2>&1 || die "apt-get install debootstrap failed; install it and run again"
fi

# Every package is checked against Debian's signing keys (the mirror may be plain HTTP: the
# signed Release file, and the hashes it lists, are what is trusted, as apt does)
KEYRING=${KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
if [ ! -s "$KEYRING" ]; then
  echo "mkbase: installing Debian's archive keyring (apt-get)"
  { "${apt[@]}" update -qq && DEBIAN_FRONTEND=noninteractive "${apt[@]}" install -y -qq debian-archive-keyring; } \
    >/dev/null 2>&1 || true
  [ -s "$KEYRING" ] || die "no keyring $KEYRING to check the packages' signatures: install debian-archive-keyring, or set KEYRING= to the keyring your mirror signs with"
fi

root=$(mktemp -d /var/tmp/dlcluster-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "mkbase: debootstrap $SUITE from $MIRROR (1-3 minutes)"
start=$SECONDS
debootstrap --variant=minbase --include=ca-certificates --keyring="$KEYRING" --force-check-gpg \
  "$SUITE" "$root" "$MIRROR" \
  >"$root.log" 2>&1 || die "debootstrap failed; log: $root.log"
rm -f "$root.log"
# the release's updates and security fixes, like the official debian images
cat >"$root/etc/apt/sources.list" <<EOF
deb $MIRROR $SUITE main
deb $MIRROR $SUITE-updates main
deb ${MIRROR%/debian}/debian-security $SUITE-security main
EOF
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar --numeric-owner -C "$root" -c . |
  "$DOCKER" import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' - "$name" >/dev/null \
  || die "docker import failed"
echo "mkbase: $name made in $((SECONDS - start)) s ($("$DOCKER" image inspect -f '{{.Size}}' "$name" | awk '{printf "%d MB", $1/1e6}'))"
