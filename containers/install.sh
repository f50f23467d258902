#!/bin/bash
# Install vapo-megatron's GPU stack into vLLM's own image (containers/Dockerfile, or
# BUILD_IMAGE=1 sbatch slurm/vapo_qwen32b.sh through pyxis). Run from the repository root.
# The image's torch is vLLM's pin; every step installs under containers/pins.txt, so none can
# replace it, and Transformer Engine and apex are compiled against it (the image is a CUDA
# devel image: nvcc and headers). Ends with the smoke test's import checks (no GPU needed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PIP=(python3 -m pip install --no-cache-dir -c containers/pins.txt)
# apex: no releases on PyPI (the "apex" package there is another project); a fixed commit.
APEX_COMMIT="${APEX_COMMIT:-6424da3b4faa6c8f062da4a48c424fff3f02d42d}"

torch_before="$(python3 -c 'import torch; print(torch.__version__)')"
cuda_major="$(python3 -c 'import torch; print(torch.version.cuda.split(".")[0])')"
echo "base image: torch $torch_before, CUDA $cuda_major; nvcc: $(command -v nvcc || echo none)"
command -v nvcc >/dev/null || { echo "no nvcc in the base image: TE and apex cannot build" >&2; exit 2; }

"${PIP[@]}" -e .                       # the project and megatron-core (vllm is in the image)
"${PIP[@]}" --no-build-isolation "transformer-engine[pytorch,core_cu${cuda_major}]"
APEX_CPP_EXT=1 APEX_CUDA_EXT=1 "${PIP[@]}" --no-build-isolation \
    "apex @ git+https://github.com/NVIDIA/apex.git@${APEX_COMMIT}"

torch_after="$(python3 -c 'import torch; print(torch.__version__)')"
if [[ "$torch_after" != "$torch_before" ]]; then
    echo "torch changed from $torch_before to $torch_after during the install" >&2
    exit 2
fi
python3 containers/smoke_test.py --imports-only
