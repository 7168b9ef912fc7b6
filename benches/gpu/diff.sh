#!/usr/bin/env bash
# Issue 30's GPU benches, on the GPU machine from the repository root with the binaries of
# scripts/cuda-build.sh in bins/:
#  1. the HF peer builds the Llama-3.1-8B-shape random bf16 model, times its capture forward
#     eager and under torch.compile, and writes 256 SpecForge-format captures of its own states
#     (8 distinct sequences, hard-linked) at each T;
#  2. the capture bench (eagle-check against both HF peers);
#  3. `gpu diff`: diff over the 256 captures at each T, batched and one sample at a time,
#     against the forward-only rate;
#  4. the streamed diff of 64 samples at T = 512 under --max-memory 4GiB through the CLI,
#     against the disk's rate (dd of the checkpoint in the same run) and the resident diff of
#     the same samples, with the pinned staging and with pageable copies (EAGLE_CHECK_PAGEABLE=1).
#   bash benches/gpu/diff.sh [OUT_DIR]     (TOKENS=128,512,2048 by default)
#   COMPILE=0: without the torch.compile peer (its compiles take minutes at three lengths)
#   SHAPE=deepseek-v3-3l TOKENS=512 MAX_MEMORY=48GiB: the DeepSeek-V3 3-layer full-width shape
#   (a MoE layer is about 23 GB in bf16: the budget holds two, not the model)
set -euo pipefail
out=${1:-${TMPDIR:-/tmp}/eagle-check-gpu-diff}
tokens=${TOKENS:-128,512,2048}
shape=${SHAPE:-llama3.1-8b}
max_memory=${MAX_MEMORY:-4GiB}
mkdir -p "$out"
compile=(--compile)
[ "${COMPILE:-1}" = 0 ] && compile=()
python3 benches/gpu/hf_peer.py --shape "$shape" --out "$out" --tokens "$tokens" --reps 5 \
    "${compile[@]}" --captures "$out/captures" --capture-tokens "$tokens" --capture-samples 256
bins/gpu-bench "$out/model" "$out/hf_states.safetensors" "$tokens" 5 | tee "$out/ours.jsonl"
python3 benches/gpu/table.py "$out"
bins/gpu-bench diff "$out/model" "$out/captures" "$tokens" | tee "$out/diff.jsonl"

# 64 samples at T = 512, streamed under $max_memory and resident, through the binary.
s64=$out/s64/rows_0-64
mkdir -p "$s64"
src=$(ls -d "$out"/captures/t512/rows_*)
for i in $(seq 0 63); do ln "$src/data_$i.ckpt" "$s64/data_$i.ckpt"; done
cp "$out/captures/t512/spec.yaml" "$out/s64/spec.yaml"
now() { date +%s.%N; }
start=$(now)
dd if="$out/model/model.safetensors" of=/dev/null bs=64M 2>/dev/null
disk_s=$(python3 -c "print($(now) - $start)")
bytes=$(stat -c %s "$out/model/model.safetensors")
# streamed-pageable: the same with candle's pageable copies to the device in place of the pinned
# staging (EAGLE_CHECK_PAGEABLE=1), the comparison in the same run. streamed-first is reported,
# not compared: the first streamed run on a fresh machine paid a one-time cost the runs after it
# did not (runs 41 and 43 in BENCHMARKS.md, 6-10 s).
for mode in resident streamed-first streamed-pageable streamed; do
    extra=()
    case $mode in streamed*) extra=(--stream-layers --max-memory "$max_memory") ;; esac
    pageable=0
    [ "$mode" = streamed-pageable ] && pageable=1
    start=$(now)
    rc=0
    EAGLE_CHECK_PAGEABLE=$pageable bins/eagle-check diff --spec "$out/s64/spec.yaml" --target "$out/model" \
        --captures "$out/s64" --device cuda --format json "${extra[@]}" >"$out/diff-$mode.json" || rc=$?
    echo "$mode $rc $(python3 -c "print($(now) - $start)")" >>"$out/diff-cli.txt"
done
python3 - "$out" "$disk_s" "$bytes" <<'PY'
import json, sys
out, disk_s, size = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
runs = {}
for line in open(f"{out}/diff-cli.txt"):
    mode, rc, wall = line.split()
    runs[mode] = (int(rc), float(wall))
print(f"disk: {size / 1e9:.2f} GB checkpoint read by dd in {disk_s:.2f} s ({size / disk_s / 1e9:.2f} GB/s, page cache as left by the peer's save)")
for mode, (rc, wall) in runs.items():
    j = json.load(open(f"{out}/diff-{mode}.json"))
    s = j["subject"]
    print(f"{mode}: exit {rc}, {wall:.2f} s wall; samples {s.get('samples')}; passes: {s.get('passes')}; weights: {s.get('weights')}; streaming: {s.get('streaming', '-')}; peak: {s.get('peak_memory')}")
# The resident forwards of the same 64 samples: the packed forwards of `gpu diff` at T = 512
# (256 samples, every state dropped as it comes), scaled to 64.
forwards_s = None
for line in open(f"{out}/diff.jsonl"):
    j = json.loads(line)
    if j.get("T") == 512:
        forwards_s = j["packed_forwards_s"] * 64 / j["samples"]
for mode in ("streamed", "streamed-pageable"):
    if mode not in runs or "resident" not in runs:
        continue
    streamed = runs[mode][1]
    if forwards_s is not None:
        floor = max(disk_s, forwards_s)
        print(f"{mode} wall / max(checkpoint at dd's rate {disk_s:.2f} s, resident forwards of the 64 samples {forwards_s:.2f} s) = {streamed:.2f} / {floor:.2f} = {streamed / floor:.2f}")
    floor = max(disk_s, runs["resident"][1])
    print(f"{mode} wall / max(dd, resident diff's whole wall, its load included) = {streamed:.2f} / {floor:.2f} = {streamed / floor:.2f}")
PY
rm -rf "$out/model" "$out/hf_states.safetensors"
