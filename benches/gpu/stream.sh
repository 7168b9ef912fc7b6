#!/usr/bin/env bash
# Streaming on the GPU (issue 11), on the GPU machine from the repository root with the
# binaries of scripts/cuda-build.sh in bins/: the HF peer builds the Llama-3.1-8B-shape random
# bf16 model (16 GB), then `eagle-check run` captures T tokens of it twice on the GPU, resident
# and with `--stream-layers --max-memory 4GiB` (each layer read from the checkpoint, uploaded,
# run and freed), both dumped; benches/gpu/stream_compare.py compares the two dumps with each
# other and with transformers' boundaries, and prints each run's time, peak and weight rate
# against the disk's read rate measured in the same run (the checkpoint read once with dd).
#   bash benches/gpu/stream.sh [OUT_DIR]      (T=512 by default)
set -euo pipefail
out=${1:-${TMPDIR:-/tmp}/eagle-check-gpu-stream}
t=${T:-512}
python3 benches/gpu/hf_peer.py --shape llama3.1-8b --out "$out" --tokens "$t" --reps 1 --warmup 0
model=$out/model
python3 -c "
import sys
sys.path.insert(0, 'benches/gpu')
from hf_peer import token_ids
print('\n'.join(map(str, token_ids($t, 128256))))" >"$out/tokens.txt"
# The disk's read rate with a cold page cache where the kernel allows dropping it.
sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
now() { date +%s.%N; }
since() { python3 -c "print(f'{$(now) - $1:.2f}')"; }
start=$(now)
dd if="$model/model.safetensors" of=/dev/null bs=64M 2>/dev/null
echo "disk: read $(stat -c %s "$model/model.safetensors") bytes in $(since "$start") s" | tee "$out/disk.txt"
for mode in resident streamed; do
    sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
    extra=()
    [ "$mode" = streamed ] && extra=(--stream-layers --max-memory 4GiB)
    start=$(now)
    rc=0
    bins/eagle-check run --target "$model" --engine vllm --token-file "$out/tokens.txt" \
        --device cuda --dump "$out/$mode.safetensors" --format json "${extra[@]}" >"$out/$mode.json" || rc=$?
    echo "$mode: exit $rc, $(since "$start") s wall (load, forward, dump)" | tee -a "$out/runs.txt"
done
python3 benches/gpu/stream_compare.py "$out" "$t"
rm -rf "$model" "$out"/*.safetensors
