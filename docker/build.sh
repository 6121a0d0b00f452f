#!/usr/bin/env bash
# make image: build the CPU image (default) or, with GPU=1, the CUDA one from docker/Dockerfile.
#
# Variables (defaults in brackets):
#   GPU         0: CPU image on a plain Debian base; 1: CUDA image (NCCL operations; TensorFlow in
#               its own virtualenv with its CUDA 12 libraries, /opt/tf-venv)           [0]
#   IMAGE       the tag                                          [dlcluster:cpu / dlcluster:gpu]
#   BASE_IMAGE  CPU: [versions.env's PIN_CPU_BASE_IMAGE], made by docker/mkbase.sh when missing;
#               GPU: [versions.env's PIN_GPU_BASE_IMAGE], must be in the local engine
#               (it is never pulled by this script)
#   CUDA_ARCHS  GPU: CUDA architectures for Horovod's NCCL operations, e.g. 80,90     [all 12]
#   CA_BUNDLE   CA bundle given to the build's apt steps as a BuildKit secret, never stored in
#               the image [/etc/ssl/certs/ca-certificates.crt when /usr/local/share/ca-certificates
#               holds a certificate (a TLS-intercepting proxy), else none]; "none": never
#   PYTHON      the client's interpreter: the image must run the same major.minor
#                                                            [versions.env's DEFAULT_PYTHON]
#   IMAGE_REBUILD  1: build even when IMAGE is labelled with the same inputs' hash           [0]
# Steps: a Docker engine (docker/engine.sh), the base, the wheelhouse linked into .whl/
# (scripts/wheelhouse.sh), then `docker build`. Each build's seconds and cached/run steps are
# appended to $DLC_CACHE/image-builds.tsv for `make image-report`; the full log is
# $DLC_CACHE/image-build.log.
set -euo pipefail
cd "$(dirname "$0")/.."
. ./versions.env  # the base images, Python, Horovod (the one place for each)

export DOCKER=${DOCKER:-/usr/bin/docker} DOCKER_BUILDKIT=1
GPU=${GPU:-0}
PYTHON=${PYTHON:-$DEFAULT_PYTHON}
CACHE=${DLC_CACHE:-$HOME/$DEFAULT_CACHE_IN_HOME}
CPU_BASE=$PIN_CPU_BASE_IMAGE
GPU_BASE=$PIN_GPU_BASE_IMAGE
die() { echo "image: error: $*" >&2; exit 1; }

case $GPU in
  0) IMAGE=${IMAGE:-dlcluster:cpu}; BASE_IMAGE=${BASE_IMAGE:-$CPU_BASE} ;;
  1) IMAGE=${IMAGE:-dlcluster:gpu}; BASE_IMAGE=${BASE_IMAGE:-$GPU_BASE} ;;
  *) die "GPU must be 0 or 1 (got '$GPU')" ;;
esac
command -v "$PYTHON" >/dev/null || die "$PYTHON not found; set PYTHON=/path/to/$DEFAULT_PYTHON (the client's Python, versions.env)"
pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

docker/engine.sh
# One build at a time on this machine (two checkouts, or two make runs): they share $DLC_CACHE's
# wheel caches, the build log and the engine's tags. A second build waits, then finds the image up to
# date or builds on the first's layers.
mkdir -p "$CACHE"
exec 9>"$CACHE/image-build.lock"
if ! flock -n 9; then
  echo "image: another image build is running on this machine ($CACHE/image-build.lock); waiting for it"
  flock 9
fi
start=$SECONDS

if ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
  if [ "$BASE_IMAGE" = "$CPU_BASE" ]; then
    docker/mkbase.sh "$BASE_IMAGE"
  else
    die "base image $BASE_IMAGE is not in the local engine: '$DOCKER pull $BASE_IMAGE' where a registry is reachable, or on a machine that has it '$DOCKER save $BASE_IMAGE | gzip > base.tgz' and here '$DOCKER load -i base.tgz' (or set BASE_IMAGE= to one you have)"
  fi
fi
t_base=$((SECONDS - start))

# the GPU image also gets TensorFlow's CUDA 12 environment (.whl/tf; empty for the CPU image)
tf_args=() tf_venv=''
if [ "$GPU" = 1 ]; then tf_args=(--tf-cuda); tf_venv=/opt/tf-venv; fi
scripts/wheelhouse.sh "${tf_args[@]}" --link .whl >/dev/null
# .prebuilt/: Horovod as scripts/build_horovod.sh compiled it for this host (its cache: a folder per
# key of Horovod, torch, Python minor, patch and flavour), when this host runs the base image's
# distribution release (the same glibc and compiler). The builder stage uses a wheel of its own key
# from there instead of compiling (about 10 minutes on 2 cores for the CPU flavour); the GPU flavour
# is compiled here only for a base that carries this host's own CUDA toolkit (docker/cuda-standin.sh:
# the same release, the same nvcc), once per key (the NCCL operations take 10-20 minutes on 2 cores),
# else there. The runtime stage's horovodrun --check-build checks what it installs either way.
rm -rf .prebuilt && mkdir .prebuilt
release() { sed -n 's/^\(ID\|VERSION_ID\)=//p' | tr -d '"' | paste -sd' '; }
here=$(release </etc/os-release 2>/dev/null || true)
in_base() { "$DOCKER" run --rm --network none --entrypoint "$1" "$BASE_IMAGE" "${@:2}" 2>/dev/null; }
if [ -n "$here" ] && [ "$(in_base cat /etc/os-release | release)" = "$here" ]; then
  if [ "$GPU" = 1 ] && command -v nvcc >/dev/null && [ -x .venv/bin/python ] \
     && [ "$(in_base /usr/local/cuda/bin/nvcc --version | tail -n 1)" = "$(nvcc --version | tail -n 1)" ]; then
    echo "image: Horovod's NCCL operations for this base, compiled on this host once per key (log: $CACHE/wheels/<key>/build.log)"
    HOROVOD_GPU=1 HOROVOD_BUILD_CUDA_CC_LIST=${CUDA_ARCHS:-} scripts/build_horovod.sh --wheel-only .venv/base >/dev/null \
      || die "compiling Horovod's NCCL operations failed (scripts/build_horovod.sh; its log is named above)"
  fi
  for w in "$CACHE"/wheels/horovod-*/horovod-*.whl; do
    [ -f "$w" ] || continue
    key=$(basename "$(dirname "$w")")
    mkdir -p ".prebuilt/$key" && { ln -f "$w" ".prebuilt/$key/" 2>/dev/null || cp "$w" ".prebuilt/$key/"; }
  done
fi
t_wheels=$((SECONDS - start - t_base))

secret=()
if [ "${CA_BUNDLE:-}" != none ]; then
  if [ -z "${CA_BUNDLE:-}" ] && compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null \
     && [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt
  fi
  if [ -n "${CA_BUNDLE:-}" ]; then
    [ -f "$CA_BUNDLE" ] || die "CA_BUNDLE=$CA_BUNDLE does not exist"
    secret=(--secret "id=ca,src=$CA_BUNDLE")
  fi
fi

commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [ "$commit" != unknown ] && [ -n "$(git status --porcelain -uno 2>/dev/null)" ]; then commit=$commit-dirty; fi

# What the image is made of, hashed: the files the build reads (.dockerignore's list; the wheelhouse
# by the locks it is collected from; .prebuilt/ by the versions and patch that key it), the base
# image's id and the build arguments. An image already labelled with the same hash is not built
# again (a second `make image` in one `make test`, the emulated tier's after the image tier's: the
# same image id, so its node image, push and pull are the same too); IMAGE_REBUILD=1 builds anyway.
inputs=$( {
  printf '%s\n' "$("$DOCKER" image inspect -f '{{.Id}}' "$BASE_IMAGE")" "$pyver" "$PIN_PIP" "${CUDA_ARCHS:-}" \
    "$tf_venv" "$commit" "${secret[*]:+ca}"
  find docker/Dockerfile .dockerignore versions.env trainkit jobs scripts/build_horovod.sh \
    docker/slim_cuda.sh patches requirements.lock docker/tf-cuda.lock -type f \
    -not -name '*.pyc' -not -path '*/__pycache__/*' -print0 | sort -z | xargs -0 sha256sum
} | sha256sum | cut -c1-32)
if [ "${IMAGE_REBUILD:-0}" != 1 ] \
   && [ "$("$DOCKER" image inspect -f '{{index .Config.Labels "dlcluster.inputs"}}' "$IMAGE" 2>/dev/null)" = "$inputs" ]; then
  echo "image: $IMAGE is up to date (built from the same inputs, $inputs): not built again"
  exit 0
fi

log=$CACHE/image-build.log
# the build's progress on the terminal: each step once, as it starts, cut to one line
show_steps() {
  local line
  declare -A seen=()
  while IFS= read -r line; do
    if [ -z "${seen[$line]:-}" ]; then seen[$line]=1; echo "${line:0:150}"; fi
  done
}
# the image $IMAGE names now: removed once the build has replaced it (with its untagged layers), unless
# a container or another tag still uses it; each rebuild would otherwise keep 7-17 GB nobody can name
replaced=$("$DOCKER" image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)
echo "image: building $IMAGE from $BASE_IMAGE (log: $log; a first build takes about 10 minutes)"
b0=$SECONDS
set +e
"$DOCKER" build --progress=plain -f docker/Dockerfile -t "$IMAGE" "${secret[@]}" \
  --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg PYTHON="python$pyver" --build-arg PYTHON_VERSION="$pyver" \
  --build-arg PIN_PIP="$PIN_PIP" --build-arg CUDA_ARCHS="${CUDA_ARCHS:-}" --build-arg TF_VENV="$tf_venv" --build-arg DLC_GIT_COMMIT="$commit" \
  --label "dlcluster.inputs=$inputs" . 2>&1 |
  tee "$log" | grep --line-buffered -E '^#[0-9]+ (\[[a-z]+ +[0-9]+/[0-9]+\]|CACHED$)|ERROR' | show_steps
rc=${PIPESTATUS[0]}
set -e
t_build=$((SECONDS - b0))
if [ "$rc" != 0 ]; then
  echo "--- last lines of $log:" >&2
  tail -n 40 "$log" >&2
  die "docker build of $IMAGE failed (exit $rc); full log: $log"
fi

steps=$(grep -Eo '^#[0-9]+ \[[a-z]+ +[0-9]+/[0-9]+\]' "$log" | sort -u | wc -l)
cached=$(grep -Ec '^#[0-9]+ CACHED$' "$log" || true)
total=$((SECONDS - start))
printf '%s\t%s\t%s\t%d\t%d\t%d\t%d\t%d\t%d\n' "$(date -u +%FT%TZ)" "$IMAGE" "$BASE_IMAGE" "$total" \
  "$t_base" "$t_wheels" "$t_build" "$steps" "$cached" >>"$CACHE/image-builds.tsv"
if [ -n "$replaced" ] && [ "$replaced" != "$("$DOCKER" image inspect -f '{{.Id}}' "$IMAGE")" ] \
   && "$DOCKER" image rm "$replaced" >/dev/null 2>&1; then
  echo "image: removed the image $IMAGE replaced (${replaced#sha256:})"
fi
size=$("$DOCKER" image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.1f GB", $1/1e9}')
echo "image: $IMAGE built in $total s (base $t_base s, wheelhouse $t_wheels s, docker build $t_build s; $cached of $steps steps cached), $size"
