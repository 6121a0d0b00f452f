#!/usr/bin/env bash
# Prometheus' own checker, promtool, from the distribution's `prometheus` package (the version the
# metrics role installs on the head), unpacked into $DLC_CACHE/tools without installing the package
# (nothing is started or changed on this machine), with the package's `prometheus` beside it (the
# tests' local cluster runs it). Prints promtool's path; runs it with arguments; --bin-dir prints
# the folder that holds both.
#
#   usage: scripts/promtool.sh [--bin-dir | check config FILE | test rules FILE ...]
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "promtool: error: $*" >&2; exit 2; }
. ./versions.env
dir=${DLC_CACHE:-$HOME/$DEFAULT_CACHE_IN_HOME}/tools/prometheus
tool=$dir/usr/bin/promtool
if [ ! -x "$tool" ] || [ ! -x "$dir/usr/bin/prometheus" ]; then
  command -v apt-get >/dev/null || die "no apt-get here: install Prometheus' promtool and put it on PATH"
  mkdir -p "$dir"
  work=$(mktemp -d "$dir/.dl.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && apt-get download -q prometheus >/dev/null 2>&1) \
    || die "apt-get download prometheus failed (is the distribution's package source reachable?)"
  dpkg-deb -x "$work"/prometheus_*.deb "$work/x"
  mkdir -p "$dir/usr/bin"
  mv "$work/x/usr/bin/prometheus" "$dir/usr/bin/prometheus"
  mv "$work/x/usr/bin/promtool" "$tool"
fi
if [ $# -eq 0 ]; then echo "$tool"; elif [ "$1" = --bin-dir ]; then dirname "$tool"; else exec "$tool" "$@"; fi
