#!/usr/bin/env bash
# On a GPU machine, from the repository root, with scripts/cuda-build.sh's bins.tar.xz in .gpu/:
# unpacks the binaries, runs every kernel's device test, the GPU integration tests, the kernel
# throughput probe and the capture bench (benches/gpu/run.sh) in one go, logging each step in
# $OUT (default: a temp dir) and printing a summary last.
#   CUDA_LIB: the CUDA 13 runtime libraries (libcublas, libcudart, ...), default /usr/local/cuda/lib64
#   STEPS: which steps to run (default: kernels gpu throughput bench; also bench-deepseek,
#     bench-qwen3moe (Qwen3-30B-A3B, 48 layers), bench-gptoss (gpt-oss-20b),
#     moe-gemm (MOE_EXPERTS=384 for Kimi-K2), score, stream, diff, bench-diff (issue 30's diff,
#     streaming and torch.compile benches), bench-diff-deepseek (the same on the DeepSeek-V3
#     3-layer shape at T = 512, streamed under DS_MAX_MEMORY, default 48GiB), bench-gemma3 / bench-llama4 (Gemma-3-27B and
#     Llama-4-Scout shapes, GEMMA_LAYERS / LLAMA4_LAYERS of them), load (benches/gpu/load.py:
#     the 8B-shape resident load against dd and transformers' from_pretrained, `run` at T = 2048
#     as a whole process against transformers' load + forward; about 4 minutes));
#     EAGLE_CHECK_PHASES=1 adds a phase-by-phase forward to each bench length
#   CLOCKS=1: samples the SM clock, power, temperature and throttle reasons every 200 ms into
#     $OUT/clocks.csv while the steps run (is a long forward slower than its phases because the
#     clock drops?)
#   STEP_TIMEOUT: seconds before a step is killed (default 1200: a hung kernel costs one step,
#     not the whole device call); a step still running then leaves $OUT/<step>.stall: each of
#     its processes' threads (by name), their state, CPU time, system call and kernel stack,
#     and the host's memory
#   SAMPLE_EVERY=N: the same snapshot every N seconds of each step into
#     $OUT/<step>.samples (which thread burns the time, and when)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-${TMPDIR:-/tmp}/eagle-check-gpu}
mkdir -p "$out"
tar xJf .gpu/bins.tar.xz -C .gpu
export LD_LIBRARY_PATH=${CUDA_LIB:-/usr/local/cuda/lib64}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export EAGLE_CHECK_ROOT=$PWD EAGLE_CHECK_BIN=$PWD/.gpu/bins/eagle-check
ln -sfn .gpu/bins bins
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
if [ "${CLOCKS:-0}" = 1 ]; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
        --format=csv -lms 200 >"$out/clocks.csv" 2>&1 &
    clocks_pid=$!
    trap 'kill $clocks_pid 2>/dev/null' EXIT
fi
summary=()
descendants() { # pid: its children, theirs, ...
    local c
    for c in $(pgrep -P "$1"); do
        echo "$c"
        descendants "$c"
    done
}
# What a step's processes are doing when its time is up (a stall: which threads run, which
# wait, in which system call), before `timeout` ends it: runs 28-30 in BENCHMARKS.md found a
# load stalled in its reader threads this way.
snapshot() { # pid
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
    grep -E '^(MemFree|Cached|Dirty|AnonPages|Mlocked):' /proc/meminfo | tr -s ' ' | tr '\n' ' '
    echo
    local p t
    for p in $(descendants "$1"); do
        ps -o pid=,stat=,etimes=,time=,rss=,args= -p "$p" | cut -c1-200
        for t in /proc/"$p"/task/*; do
            # The name can hold spaces: the fields after its closing parenthesis.
            local st
            st=$(sed 's/.*) //' "$t/stat" 2>/dev/null | cut -d' ' -f1,12,13)
            echo "  thread ${t##*/} $(cat "$t/comm" 2>/dev/null): state, utime, stime $st;" \
                "syscall $(cut -d' ' -f1 "$t/syscall" 2>/dev/null); $(head -3 "$t/stack" 2>/dev/null | tr '\n' ' ')"
        done
    done
}
# (No debugger: attaching cuda-gdb to a stalled eagle-check hung and took the rest of the
# device call twice, runs 29 and 40.)
stall_report() { # pid
    snapshot "$1"
}
step() { # name, command...
    local name=$1
    shift
    local start=$SECONDS limit=${STEP_TIMEOUT:-1200}
    timeout "$limit" "$@" >"$out/$name.log" 2>&1 &
    local pid=$!
    # A second before the limit, the stall report (when the step is still running).
    local every=${SAMPLE_EVERY:-0} next=$((SECONDS + ${SAMPLE_EVERY:-0}))
    while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - start)) -lt $((limit - 1)) ]; do
        sleep 1
        if [ "$every" -gt 0 ] && [ "$SECONDS" -ge "$next" ]; then
            { echo "-- $((SECONDS - start)) s"; snapshot "$pid"; } >>"$out/$name.samples" 2>&1
            next=$((SECONDS + every))
        fi
    done
    local stuck=()
    if kill -0 "$pid" 2>/dev/null; then
        stall_report "$pid" >"$out/$name.stall" 2>&1
        stuck=($(descendants "$pid"))
    fi
    wait "$pid"
    local rc=$?
    # `timeout` ends its own child; a grandchild (the bench binary under its script) would go on
    # holding the GPU through the next steps.
    [ ${#stuck[@]} -gt 0 ] && kill -9 "${stuck[@]}" 2>/dev/null
    summary+=("$name: exit $rc in $((SECONDS - start)) s (ended $(date +%T)); $(grep -E '^test result' "$out/$name.log" | tr '\n' ' ')")
}
for s in ${STEPS:-kernels gpu throughput bench}; do
    case $s in
    kernels) step kernels bins/eagle_check-lib kernels:: ;;
    gpu) step gpu bins/main-tests gpu:: --test-threads 1 ;;
    throughput) step throughput bins/eagle_check-lib device_throughput --ignored --nocapture ;;
    bench) step bench bash benches/gpu/run.sh "$out/bench" ;;
    bench-deepseek) step bench-deepseek env SHAPE=deepseek-v3-3l TOKENS=${DS_TOKENS:-128,512,2048} bash benches/gpu/run.sh "$out/bench-deepseek" ;;
    bench-qwen3moe) step bench-qwen3moe env SHAPE=qwen3-30b-a3b TOKENS=${MOE_BENCH_TOKENS:-128,512,2048} bash benches/gpu/run.sh "$out/bench-qwen3moe" ;;
    bench-gptoss) step bench-gptoss env SHAPE=gpt-oss-20b F32_TRUTH=${F32_TRUTH:-1} TOKENS=${MOE_BENCH_TOKENS:-128,512,2048} bash benches/gpu/run.sh "$out/bench-gptoss" ;;
    stream) step stream bash benches/gpu/stream.sh "$out/stream" ;;
    bench-diff) step bench-diff bash benches/gpu/diff.sh "$out/bench-diff" ;;
    bench-diff-deepseek) step bench-diff-deepseek env SHAPE=deepseek-v3-3l TOKENS=512 MAX_MEMORY=${DS_MAX_MEMORY:-48GiB} bash benches/gpu/diff.sh "$out/bench-diff-deepseek" ;;
    bench-gemma3) step bench-gemma3 env SHAPE=gemma3-27b LAYERS=${GEMMA_LAYERS:-30} TOKENS=${FAMILY_TOKENS:-128,512,2048} bash benches/gpu/run.sh "$out/bench-gemma3" ;;
    bench-llama4) step bench-llama4 env SHAPE=llama4-scout LAYERS=${LLAMA4_LAYERS:-10} TOKENS=${FAMILY_TOKENS:-128,512,2048} bash benches/gpu/run.sh "$out/bench-llama4" ;;
    load) step load python3 benches/gpu/load.py "$out/load" ;;
    score) step score bins/gpu-bench score ${REPS:-5} ;;
    gemm) step gemm bins/gpu-bench gemm ${GEMM_TOKENS:-2048,8192} ${REPS:-5} ;;
    moe-gemm) step moe-gemm bins/gpu-bench moe-gemm ${MOE_TOKENS:-128,512,2048} ${REPS:-5} ${MOE_EXPERTS:-256} ;;
    diff) step diff env EAGLE_CHECK_BENCH_DEVICES=cpu,cuda EAGLE_CHECK_BENCH_SAMPLES=${DIFF_SAMPLES:-200} EAGLE_CHECK_BENCH_DIR="${TMPDIR:-/tmp}/eagle-check-diff-bench" bins/diff-bench ;;
    esac
done
for s in ${STEPS:-kernels gpu throughput bench}; do
    echo "== $s (last lines)"
    grep -E "FAILED|panicked|failed|error" "$out/$s.log" | head -20
    tail -n 25 "$out/$s.log"
    [ -f "$out/$s.stall" ] && { echo "-- still running at the limit ($out/$s.stall):"; head -n 60 "$out/$s.stall"; }
done
printf '%s\n' "${summary[@]}"
