#!/usr/bin/env bash
# docker/slim_cuda.sh VENV: in the CPU image, delete what torch's CUDA wheels hold beyond the
# libraries torch links against. PyPI's torch 2.14.1 is a CUDA build: `import torch` loads
# libcudart, cuBLAS, cuDNN's front library, NCCL... even on a CPU (their ELF closure, which ldd
# resolves through torch's rpath, is kept). cuDNN's engines, cuSOLVER's multi-GPU library,
# NVRTC's alternates, the static archives and Triton (it compiles GPU kernels) are loaded only
# where CUDA runs: about 2 GB an image never uses, built, saved, pushed and pulled. The GPU image
# keeps everything. Ends by importing torch and torchvision and computing on the CPU.
set -euo pipefail
venv=${1:?usage: docker/slim_cuda.sh VENV}
site=$(echo "$venv"/lib/python3*/site-packages)
[ -d "$site/torch" ] || { echo "slim_cuda: error: no torch in $site" >&2; exit 1; }
before=$(du -sm "$site" | cut -f1)
keep=$(find "$site/torch" "$site/torchvision" -name '*.so*' -type f -print0 | xargs -0 ldd 2>/dev/null |
       awk '/=> \//{print $3}' | xargs -r realpath | sort -u)
n=0
while IFS= read -r -d '' f; do
  if ! grep -qxF "$(realpath "$f")" <<<"$keep"; then rm -f "$f"; n=$((n + 1)); fi
done < <(find "$site/nvidia" -type f \( -name '*.so*' -o -name '*.a' -o -name '*.bc' \) -print0)
# the package, not its metadata: torch declares it, and `pip check` reads the metadata
rm -rf "$site/triton"
python -c "import torch, torchvision; assert not torch.cuda.is_available(); \
assert torch.nn.Conv2d(3, 4, 3)(torch.ones(1, 3, 8, 8)).shape == (1, 4, 6, 6)"
echo "slim_cuda: $n CUDA files beyond torch's closure and Triton removed: $before MB -> $(du -sm "$site" | cut -f1) MB"
