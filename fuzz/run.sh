#!/usr/bin/env bash
# Fuzzes every target for MINUTES (default 10) each, JOBS (default 2) at a time, from the seeds
# (make_seeds.py) plus the committed corpus, then merges what it found into corpus/<target>/
# (minimised: only inputs that add coverage are kept). Logs and crash artifacts go to
# fuzz/logs/ and fuzz/artifacts/<target>/ (both ignored by git).
#
#   bash fuzz/run.sh [target...]      # needs cargo-fuzz and a nightly toolchain
set -euo pipefail
cd "$(dirname "$0")"
MINUTES=${MINUTES:-10}
JOBS=${JOBS:-2}
# -a: debug assertions, and with them overflow checks: an overflow is a crash here.
FLAGS=${FLAGS:--O -a}
TARGETS=("$@")
if [ ${#TARGETS[@]} -eq 0 ]; then
    TARGETS=(pickle npy npz safetensors_header gguf spec config)
fi
[ -d corpus-raw ] || python3 make_seeds.py
mkdir -p logs
cargo +nightly fuzz build $FLAGS
one() {
    local t=$1
    mkdir -p "corpus-raw/$t" "corpus/$t" "artifacts/$t"
    cargo +nightly fuzz run $FLAGS "$t" "corpus-raw/$t" "corpus/$t" -- \
        -max_total_time=$((MINUTES * 60)) -max_len=65536 -timeout=10 -rss_limit_mb=2048 \
        -artifact_prefix="artifacts/$t/" -print_final_stats=1 >"logs/$t.log" 2>&1 || true
    # Keep a minimal corpus: the smallest set of inputs that covers what all of them cover.
    mkdir -p "corpus-new/$t"
    cargo +nightly fuzz run $FLAGS "$t" "corpus-new/$t" "corpus/$t" "corpus-raw/$t" -- \
        -set_cover_merge=1 -max_len=65536 -timeout=10 >"logs/$t.merge.log" 2>&1
    rm -rf "corpus/$t" && mv "corpus-new/$t" "corpus/$t"
    # Inputs over 4 KiB are rare and add little; dropping them keeps the corpus under 2 MB.
    find "corpus/$t" -type f -size +4k -delete
    grep -E "^(stat::number_of_executed_units|Done)" "logs/$t.log" | sed "s/^/$t: /" || true
}
export -f one
export MINUTES FLAGS
printf '%s\n' "${TARGETS[@]}" | xargs -P "$JOBS" -I{} bash -c 'one {}'
rmdir corpus-new 2>/dev/null || true
