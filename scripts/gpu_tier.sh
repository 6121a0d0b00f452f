#!/usr/bin/env bash
# The GPU tier on a bare GPU machine (its own Python and torch, no Ray, no network), from what
# scripts/stage_gpu.sh staged: the staged wheels go into a temporary site; the tests that need no
# Horovod run first (so a slow or failed compile costs none of their results); then Horovod is
# compiled for NCCL against this machine's torch and CUDA (for its GPU's architecture only) and
# its tests run. Logs go to $OUT when set (else /tmp/dlc-gpu-out); the exit status is nonzero
# when either pytest run failed.
#
#   usage: scripts/gpu_tier.sh [DIR] [pytest args...]     DIR: default .gpu-stage (a -k among the
#          args replaces each part's own: the part without Horovod, then Horovod's)
#   GPU_PYTHON=python3   the Python environment that holds torch
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "gpu-tier: error: $*" >&2; exit 2; }

dir=${1:-.gpu-stage}; shift || true
py=${GPU_PYTHON:-python3}
[ -d "$dir" ] || die "no $dir: run make stage-gpu where the package index is reachable, and carry it here"
out=${OUT:-/tmp/dlc-gpu-out}
mkdir -p "$out"
"$py" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"' \
  || die "$py sees no CUDA device (torch $("$py" -c 'import torch; print(torch.__version__)'))"

# the language model's FSDP test takes Transformers (with tokenizers and safetensors) from the
# machine, whose image holds them: no room for its 13 MiB beside Ray's in the stage
if ver=$("$py" -c 'import safetensors, tokenizers, transformers; print(transformers.__version__)' 2>/dev/null); then
  echo "gpu-tier: this machine's Transformers $ver (the language model's FSDP test)"
else
  echo "gpu-tier: no Transformers on this machine: the language model's FSDP test will be skipped"
fi

site=$(mktemp -d /tmp/dlc-gpu-site.XXXXXX)
"$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$dir"/*.whl
ln -s "$PWD/trainkit" "$PWD/dlcluster" "$site/"  # this checkout's packages, as make setup installs them
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PATH=$site/bin:$PATH
export DLC_HOME=${DLC_HOME:-/tmp/dlc-gpu-home} DLC_CACHE=${DLC_CACHE:-/tmp/dlc-gpu-cache}

set -o pipefail
tier() { "$py" -m pytest tests/gpu -v -s -p no:cacheprovider "$@" 2>&1 | tee -a "$out/gpu-tier.log"; }
: >"$out/gpu-tier.log"  # this run's log only (both parts append to it)
status=0
echo "gpu-tier: the tests that need no Horovod"
tier -k "not horovod" "$@" || status=$?

# Horovod with NCCL, built here (a wheel built elsewhere does not load against this torch)
mkdir -p "$DLC_CACHE/wheels/src"
. ./versions.env
cp "$dir/horovod-$PIN_HOROVOD.tar.gz" "$DLC_CACHE/wheels/src/"
prefix=$("$py" -c 'import sys; print(sys.prefix)')
cc=$("$py" -c 'import torch; print("%d%d" % torch.cuda.get_device_capability())')
if wheel=$(HOROVOD_GPU=1 HOROVOD_BUILD_CUDA_CC_LIST=$cc scripts/build_horovod.sh --wheel-only "$prefix" \
           2>"$out/horovod-build.err" | tail -n 1); then
  # a site of its own: into $site, whose bin/ the staged wheels made, pip would not put horovodrun
  hvd_site=$(mktemp -d /tmp/dlc-gpu-horovod.XXXXXX)
  "$py" -m pip install -q --no-index --no-deps --target "$hvd_site" "$wheel"
  export PYTHONPATH=$hvd_site:$PYTHONPATH PATH=$hvd_site/bin:$PATH
  echo "gpu-tier: Horovod (NCCL, sm_$cc) from $wheel"
else
  echo "gpu-tier: Horovod did not build (see $out/horovod-build.err); its tests will be skipped"
fi

echo "gpu-tier: Horovod's tests"
tier -k horovod "$@" || status=$?
exit "$status"
