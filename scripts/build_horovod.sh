#!/usr/bin/env bash
# Install Horovod (versions.env's PIN_HOROVOD; PyTorch + Gloo, no MPI) into a virtualenv, compiled once and cached.
#
# usage: scripts/build_horovod.sh [--wheel-only] VENV
#   VENV          a virtualenv that already holds torch (the project's is .venv)
#   --wheel-only  build (or find) the cached wheel and print its path; VENV is left unchanged
#   HOROVOD_GPU=1 build the NCCL (GPU) flavour instead of the CPU one (the default)
#   HOROVOD_BUILD_CUDA_CC_LIST=90[,80...]  (NCCL flavour) compile for these CUDA architectures only
#                 instead of Horovod's 12 (a quick compile check); part of the cache key
#
# Horovod's last release (2023) does not build against torch 2.14 as released: its
# CMake files compile the PyTorch ops as C++14, but torch >= 2.1 headers need C++17 and torch
# 2.14's need C++20 (at::symint::sizes<T> errors). patches/horovod-<version>-torch2.14.patch
# changes three CMake files:
#   horovod/torch/CMakeLists.txt      torch >= 2.1: compile as C++20, mark the build as
#                                     C++17-or-newer and link compatible17_gloo, the C++17 copy
#                                     of gloo that Horovod already builds for TensorFlow >= 2.10;
#   CMakeLists.txt                    build that compatible17_gloo copy for such a torch build
#                                     too, with torch's CXX11 ABI;
#   cmake/Modules/FindPytorch.cmake   HOROVOD_TORCH_CPU_ONLY=1 forces CPU-only ops. torch is a
#                                     CUDA build, and where an nvcc is on PATH without a full CUDA
#                                     toolkit Horovod otherwise decides to build GPU ops and stops
#                                     at "Could NOT find CUDAToolkit"; no stock variable turns
#                                     that off.
# and one header: horovod/common/group_table.h includes <string> and <cstdint> (GCC 13, the GPU
# machine's compiler, no longer brings them in through <queue>).
# A compile takes 4-15 minutes on 2 cores, so the wheel is cached under
# $DLC_CACHE/wheels/<key>/ with its build log, where the key is Horovod's
# version + torch's version + Python's version + the patch's sha256 + the flavour; VENV/.horovod-key
# records the key of the Horovod installed there, so a rerun with nothing changed returns at once.
set -euo pipefail
# shellcheck source=versions.env
. "$(dirname "$0")/../versions.env"  # PIN_HOROVOD and its sdist's sha256 (the one place for each)

HVD_VERSION=$PIN_HOROVOD
HVD_SDIST=horovod-$HVD_VERSION.tar.gz
HVD_SDIST_SHA256=$PIN_HOROVOD_SDIST_SHA256

die() { echo "build_horovod: error: $*" >&2; exit 1; }

wheel_only=0
if [ "${1:-}" = "--wheel-only" ]; then wheel_only=1; shift; fi
[ $# -eq 1 ] || die "usage: $0 [--wheel-only] VENV"
[ -d "$1" ] || die "no virtualenv at $1"
# absolute and physical, before changing directory: .venv is a link into $DLC_CACHE, which every
# checkout shares, so the scripts pip writes (horovodrun) must start with the cache's own python,
# not a checkout's link to it (a removed checkout left horovodrun with a shebang that was gone)
venv=$(cd "$1" && pwd -P)
cd "$(dirname "$0")/.."
root=$(pwd)
patch_file=$root/patches/horovod-$HVD_VERSION-torch2.14.patch
py=$venv/bin/python

[ -x "$py" ] || die "$venv is not a virtualenv (no bin/python)"
[ -f "$patch_file" ] || die "missing $patch_file"

# Everything the key needs is read from files (no Python start-up), so the no-op case is fast.
shopt -s nullglob
site_dirs=("$venv"/lib/python3.*/site-packages)
[ ${#site_dirs[@]} -eq 1 ] || die "cannot find the site-packages of $venv"
site=${site_dirs[0]}
pyver=${site%/site-packages}; pyver=${pyver##*/python}
torch_meta=("$site"/torch-*.dist-info/METADATA)
[ ${#torch_meta[@]} -eq 1 ] || die "torch is not installed in $venv (run scripts/setup.sh first)"
torch_version=$(sed -n 's/^Version: //p' "${torch_meta[0]}" | head -n 1)
[ -n "$torch_version" ] || die "cannot read torch's version from ${torch_meta[0]}"
patch_sha=$(sha256sum "$patch_file" | cut -c1-16)
if [ "${HOROVOD_GPU:-}" = "1" ]; then flavour=nccl; else flavour=cpu; fi
key=horovod-$HVD_VERSION-torch$torch_version-py$pyver-patch$patch_sha-$flavour
cc_list=
if [ "$flavour" = nccl ] && [ -n "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]; then
  cc_list=$HOROVOD_BUILD_CUDA_CC_LIST
  [[ $cc_list =~ ^[0-9]+(,[0-9]+)*$ ]] || die "HOROVOD_BUILD_CUDA_CC_LIST must look like 90 or 80,90 (got '$cc_list')"
  key=$key-cc${cc_list//,/_}
fi

cache=${DLC_CACHE:-$HOME/$DEFAULT_CACHE_IN_HOME}/wheels
keydir=$cache/$key
log=$keydir/build.log
marker=$venv/.horovod-key
installed=("$site"/horovod-"$HVD_VERSION".dist-info)

cached_wheel() { local w=("$keydir"/horovod-"$HVD_VERSION"-*.whl); [ ${#w[@]} -eq 1 ] && echo "${w[0]}"; }

if [ "$wheel_only" = 0 ] && [ ${#installed[@]} -eq 1 ] && [ -f "$marker" ] && [ "$(cat "$marker")" = "$key" ] \
   && [ "$(head -n 1 "$venv/bin/horovodrun" 2>/dev/null)" = "#!$py" ]; then
  echo "build_horovod: horovod $HVD_VERSION ($flavour, torch $torch_version) already installed in $venv"
  exit 0
fi
if [ "$wheel_only" = 1 ] && wheel=$(cached_wheel); then echo "$wheel"; exit 0; fi

mkdir -p "$cache"
exec 9>"$cache/.lock"
# one build at a time (setup.sh and a manual run may race): the second waits, then reuses the wheel
if ! flock -n 9; then echo "build_horovod: waiting for another build_horovod.sh to finish"; flock 9; fi
rm -rf "$cache"/.build.* "$cache"/src/.dl.*   # left by a killed run (we hold the lock)

if ! wheel=$(cached_wheel); then
  # The sdist, downloaded once and checked against its pinned sha256.
  mkdir -p "$cache/src"
  if [ ! -f "$cache/src/$HVD_SDIST" ]; then
    echo "build_horovod: downloading the Horovod $HVD_VERSION sdist"
    dl=$(mktemp -d "$cache/src/.dl.XXXXXX")
    "$py" -m pip download --no-deps --no-binary :all: "horovod==$HVD_VERSION" -d "$dl" \
      >"$cache/src/download.log" 2>&1 \
      || { rm -rf "$dl"; die "pip download horovod==$HVD_VERSION failed; log: $cache/src/download.log"; }
    mv "$dl/$HVD_SDIST" "$cache/src/$HVD_SDIST"
    rm -rf "$dl"
  fi
  echo "$HVD_SDIST_SHA256  $cache/src/$HVD_SDIST" | sha256sum --quiet -c - \
    || die "$cache/src/$HVD_SDIST does not match its pinned sha256; delete it to download again"

  work=$(mktemp -d "$cache/.build.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  tar -xzf "$cache/src/$HVD_SDIST" -C "$work"
  src=$work/horovod-$HVD_VERSION
  mkdir -p "$keydir"
  patch -p1 -d "$src" <"$patch_file" >"$log" 2>&1 \
    || die "$patch_file does not apply to $HVD_SDIST; log: $log"

  # The build environment is exactly this, whatever HOROVOD_* the caller has set (the key promises
  # it); HOROVOD_GPU in particular means CUDA/ROCM to Horovod's CMake, not our 1.
  unset "${!HOROVOD_@}"
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo
  if [ "$flavour" = nccl ]; then
    nvcc=$(command -v nvcc) || die "HOROVOD_GPU=1 needs nvcc (the CUDA toolkit) on PATH"
    # nvcc may be a wrapper script or a link (here /usr/local/bin/nvcc execs the real one): ask it
    # where it lives rather than guessing from its path.
    nvcc_bin=$("$nvcc" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -n 1)
    if [ -z "$nvcc_bin" ] || [ ! -f "$nvcc_bin/../include/cuda_runtime.h" ]; then
      die "cannot locate the CUDA toolkit of $nvcc"
    fi
    nccl=$site/nvidia/nccl
    if [ ! -f "$nccl/include/nccl.h" ] || [ ! -f "$nccl/lib/libnccl.so.2" ]; then
      die "HOROVOD_GPU=1 needs the nvidia-nccl-cu13 wheel in $venv (no $nccl/lib/libnccl.so.2)"
    fi
    # the wheel ships only libnccl.so.2; the linker wants libnccl.so: a build-private link
    mkdir "$work/nccl-lib"
    ln -s "$nccl/lib/libnccl.so.2" "$work/nccl-lib/libnccl.so"
    cuda_home=$(cd "$nvcc_bin/.." && pwd)
    # CUDA_HOME for torch.utils.cpp_extension too: it otherwise guesses /usr/local from
    # /usr/local/bin/nvcc and Horovod's CMake then cannot find libcudart for the torch ops
    export HOROVOD_GPU=CUDA HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME=$cuda_home \
      CUDA_HOME=$cuda_home HOROVOD_NCCL_INCLUDE=$nccl/include HOROVOD_NCCL_LIB=$work/nccl-lib \
      HOROVOD_NCCL_LINK=SHARED
    if [ -n "$cc_list" ]; then export HOROVOD_BUILD_CUDA_CC_LIST=$cc_list; fi
  else
    export HOROVOD_TORCH_CPU_ONLY=1
  fi
  # The system CMake (3.25): CMake 4 refuses gloo's cmake_minimum_required, unless told this.
  if [ -x /usr/bin/cmake ]; then export HOROVOD_CMAKE=/usr/bin/cmake; fi
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  MAKEFLAGS=-j$(nproc)
  export MAKEFLAGS

  echo "build_horovod: compiling Horovod $HVD_VERSION ($flavour, torch $torch_version) on $(nproc) cores (several minutes; log: $log)"
  start=$SECONDS
  if ! "$py" -m pip wheel -v --no-deps --no-build-isolation --no-cache-dir -w "$work/dist" "$src" >>"$log" 2>&1; then
    die "compiling Horovod failed; full log: $log"
  fi
  built=("$work"/dist/horovod-"$HVD_VERSION"-*.whl)
  [ ${#built[@]} -eq 1 ] || die "pip wheel made no Horovod wheel; full log: $log"
  mv "${built[0]}" "$keydir/"
  wheel=$(cached_wheel)
  echo "build_horovod: compiled in $((SECONDS - start)) s: $wheel"
fi

if [ "$wheel_only" = 1 ]; then echo "$wheel"; exit 0; fi

echo "build_horovod: installing $(basename "$wheel") into $venv"
rm -f "$marker"
# --force-reinstall: pip would skip a wheel of the same version built with another key; the
# second call adds only what Horovod needs and VENV lacks (psutil, from the package index).
if ! { "$py" -m pip install -q --no-warn-script-location --force-reinstall --no-deps "$wheel" &&
  "$py" -m pip install -q --no-warn-script-location "$wheel"; }; then
  die "pip install $wheel failed"
fi

# Horovod's own report: PyTorch and Gloo must be there (and NCCL in the GPU flavour).
report=$("$venv/bin/horovodrun" --check-build 2>&1) \
  || die "$venv/bin/horovodrun --check-build failed: $(tail -n 1 <<<"$report")"
need=(PyTorch Gloo)
if [ "$flavour" = nccl ]; then need+=(NCCL); fi
for item in "${need[@]}"; do
  grep -Eq "\[X\] ${item}[[:space:]]*\$" <<<"$report" || die "horovodrun --check-build does not list $item as available"
done
echo "$key" >"$marker"
echo "build_horovod: horovod $HVD_VERSION ($flavour, torch $torch_version) installed in $venv; check-build lists ${need[*]}"
