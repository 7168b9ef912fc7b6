#!/usr/bin/env bash
# Builds the lane-level emulation of the tensor-core attention (kernels/emu/README.md) and runs
# every tile tag over the shapes of src/kernels/attention.rs `device_tensor_core_matches_reference`
# and a few more (a growing-max ramp for the rescale path, windows with tq < tk, many tiles for
# the stage rings), both dtypes, with cp.async data landing eagerly, lazily or at random.
#   bash scripts/attention-emu.sh            # all tags
#   bash scripts/attention-emu.sh d128_v128_lean d192_v128_lean
# Needs only g++ (no CUDA). Prints one line per run; exits non-zero if any run fails.
set -euo pipefail
cd "$(dirname "$0")/.."
build=target/attention-emu
mkdir -p "$build"
cp kernels/attention.cu "$build/attention.cu"
cp kernels/emu/common.cuh kernels/emu/mma.cuh kernels/emu/attention_emu.cpp "$build/"
g++ -std=c++17 -O2 -Wall -Wno-unknown-pragmas -Wno-unused-function -Wno-unused-variable \
    -o "$build/attention_emu" "$build/attention_emu.cpp"
tags=("$@")
if [ ${#tags[@]} -eq 0 ]; then
    tags=($(grep -oE '^ *CFG\(([a-z0-9_]+)' kernels/emu/attention_emu.cpp | sed 's/.*(//'))
fi
fail=0
run() { "$build/attention_emu" "$@" || { echo "FAILED: $*"; fail=1; }; }
for tag in "${tags[@]}"; do
    dk=$(grep -oE "CFG\($tag, [0-9]+, [0-9]+" kernels/emu/attention_emu.cpp | awk -F', ' '{print $2}')
    dv=$(grep -oE "CFG\($tag, [0-9]+, [0-9]+" kernels/emu/attention_emu.cpp | awk -F', ' '{print $3}')
    if [ "$dk" != "$dv" ]; then nh=4; nkv=4; else nh=4; nkv=1; fi
    mode=(random lazy eager)
    i=0
    for dtype in bf16 f16; do
        # tq tk window scale ramp sinks   (the device test's shapes, then the extra ones, then
        # gpt-oss attention sinks with and without a window)
        for shape in "1 1 0 0 0 0" "37 37 0 0 0 0" "129 129 0 0 0 0" "70 300 0 0 0 0" \
            "200 200 33 0 0 0" "300 300 0 0.5 1 0" "100 600 150 0 0 0" "257 257 70 0.5 1 0" \
            "1 1 0 0 0 1" "70 300 0 0 0 1" "200 200 33 0 0 1" "257 257 70 0.5 1 1"; do
            set -- $shape
            run "$tag" "$dtype" "$1" "$2" "$nh" "$nkv" "$3" "$4" "$5" $((i + 7)) "${mode[$((i % 3))]}" "$6"
            i=$((i + 1))
        done
    done
done
exit $fail
