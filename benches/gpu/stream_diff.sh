#!/usr/bin/env bash
# The streamed diff of issue 30 on the GPU machine, from the repository root with the binaries
# of scripts/cuda-build.sh in $BINS (default bins/): 64 SpecForge-format captures of the
# Llama-3.1-8B shape at T = 512 (benches/gpu/hf_peer.py writes the model and the captures),
# `eagle-check diff --stream-layers` through the CLI under `--max-memory 4GiB` (three passes)
# and 12GiB (one): as by default (the layers kept in host memory where another pass follows)
# and with nothing kept (EAGLE_CHECK_HOST_KEEP=0), and under 4GiB with the kept layers copied
# to the device on a second queue while the layer before computes (EAGLE_CHECK_COPY_AHEAD=1),
# and with the read buffers in 4 KiB pages (EAGLE_CHECK_HUGE_PAGES=0, the code before run 72),
# alternating, against `dd` of the checkpoint before and after, then the resident diff. Prints
# one line per run: its wall time, exit code, and the report's passes and streaming lines.
#   bash benches/gpu/stream_diff.sh [OUT_DIR]
set -uo pipefail
out=${1:-${TMPDIR:-/tmp}/eagle-check-stream-diff}
bins=${BINS:-bins}
python3 benches/gpu/hf_peer.py --shape llama3.1-8b --out "$out" --tokens 512 --reps 1 --warmup 0 \
    --captures "$out/captures" --capture-tokens 512 --capture-samples 64 >"$out.peer.log" 2>&1 ||
    { echo "hf_peer.py failed: $out.peer.log"; exit 2; }
set -- "$out"/captures/t512/rows_*
rows=$1
now() { date +%s.%N; }
for mode in dd default-4GiB unkept-4GiB ahead-4GiB pages4k-4GiB default-4GiB unkept-4GiB \
    ahead-4GiB pages4k-4GiB default-12GiB unkept-12GiB dd resident; do
    start=$(now)
    env=() extra=()
    case $mode in
        default-*) extra=(--stream-layers --max-memory "${mode#default-}") ;;
        unkept-*) env=(EAGLE_CHECK_HOST_KEEP=0) extra=(--stream-layers --max-memory "${mode#unkept-}") ;;
        ahead-*) env=(EAGLE_CHECK_COPY_AHEAD=1) extra=(--stream-layers --max-memory "${mode#ahead-}") ;;
        pages4k-*) env=(EAGLE_CHECK_HUGE_PAGES=0) extra=(--stream-layers --max-memory "${mode#pages4k-}") ;;
    esac
    if [ "$mode" = dd ]; then
        dd if="$out/model/model.safetensors" of=/dev/null bs=64M 2>/dev/null
        code=0
    else
        env "${env[@]}" "$bins/eagle-check" diff --spec "$out/captures/t512/spec.yaml" \
            --target "$out/model" --captures "$rows" --device cuda --format json "${extra[@]}" \
            >"$out/$mode.json" 2>"$out/$mode.err"
        code=$?
    fi
    wall=$(python3 -c "print(f'{$(now) - $start:.3f}')")
    line="$mode: $wall s, exit $code"
    if [ "$mode" != dd ]; then
        line+=" $(python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['subject']; print(s.get('passes'), '|', s.get('streaming'))" "$out/$mode.json" 2>/dev/null)"
    fi
    echo "$line"
done
