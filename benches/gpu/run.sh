#!/usr/bin/env bash
# The GPU bench, on the GPU machine, from the repository root with the binaries of
# scripts/cuda-build.sh unpacked in bins/: the HF transformers peer builds a random bf16 model
# of the shape (Llama-3.1-8B by default), saves it and times its capture forward; then
# eagle-check's bench binary loads the same directory, times its own and compares the states.
#   bash benches/gpu/run.sh [OUT_DIR]      (TOKENS=128,512,2048,8192 REPS=5 by default)
#   SHAPE=deepseek-v3-3l bash benches/gpu/run.sh OUT_DIR   (DeepSeek-V3, 1 dense + 2 MoE layers)
#   SHAPE=qwen3-30b-a3b or SHAPE=gpt-oss-20b: the MoE families at full size (LAYERS=N for fewer
#   layers where the disk cannot hold the checkpoint)
#   F32_TRUTH=1: the peer also runs the weights in f32, and both bf16 runs are compared with it
set -euo pipefail
out=${1:-${TMPDIR:-/tmp}/eagle-check-gpu-bench}
tokens=${TOKENS:-128,512,2048,8192}
reps=${REPS:-5}
shape=${SHAPE:-llama3.1-8b}
truth=()
[ "${F32_TRUTH:-0}" = 1 ] && truth=(--f32-truth)
python3 benches/gpu/hf_peer.py --shape "$shape" --out "$out" --tokens "$tokens" --reps "$reps" --layers "${LAYERS:-0}" "${truth[@]}"
bins/gpu-bench "$out/model" "$out/hf_states.safetensors" "$tokens" "$reps" | tee "$out/ours.jsonl"
python3 benches/gpu/table.py "$out"
# The model directory is tens of GB: gone once measured.
rm -rf "$out/model" "$out/hf_states.safetensors"
