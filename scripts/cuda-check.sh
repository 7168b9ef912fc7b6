#!/usr/bin/env bash
# Type-checks and lints the CUDA build on a machine without a GPU or a CUDA install (CI):
# nvcc and the CUDA headers from the pinned PyPI wheels (the GPU machines' driver is CUDA 13.0;
# cudarc 0.19.10 rejects a newer nvcc), then clippy with --features cuda, which compiles every
# kernels/*.cu to PTX (build.rs) and candle's kernels. Nothing is linked, so no libcuda is needed.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
cu_dir() { ls -d "$root"/.cuda/lib/python3*/site-packages/nvidia/cu13 2>/dev/null | head -n 1; }
if [ -z "$(cu_dir)" ] || [ ! -x "$(cu_dir)/bin/nvcc" ]; then
    [ -x .cuda/bin/pip ] || python3 -m venv .cuda
    .cuda/bin/pip install --quiet nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 \
        nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85 \
        nvidia-cuda-nvrtc==13.0.88 nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35
fi
cu=$(cu_dir)
export CUDA_HOME=$cu PATH=$cu/bin:$PATH
# candle-kernels asks nvidia-smi for the compute capability unless this is set.
export CUDA_COMPUTE_CAP=90
export CARGO_TARGET_DIR=target/cuda-check
cargo clippy --release --features cuda --all-targets -- -D warnings
