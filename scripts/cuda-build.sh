#!/usr/bin/env bash
# Builds the GPU binaries on a CPU-only machine (no GPU, no CUDA install) and packs them for
# the GPU machine: target/gpu-carry/bins.tar.xz holding
#   bins/eagle-check          the CLI, built with --features cuda
#   bins/eagle_check-lib      the library's unit tests (the kernel device tests among them)
#   bins/main-tests           the integration tests (tests/main.rs)
#   bins/gpu-bench            the GPU capture bench (benches/gpu.rs; benches/gpu/run.sh drives it)
#   bins/diff-bench           the diff bench (benches/diff.rs), run on the CPU and the GPU
#
# What it does:
#   1. .cuda/: a venv with nvcc and the CUDA 13.0 libraries from PyPI, pinned (the GPU
#      machine's driver is CUDA 13.0; cudarc 0.19.10 rejects nvcc 13.5), unless already there;
#   2. lib<name>.so links next to the wheels' versioned libraries (the linker wants them);
#   3. .cuda/stubs/libcuda.so: a link stub exporting every cu* symbol cudarc may reference,
#      soname libcuda.so.1 (libcuda belongs to the driver: no wheel ships it; the binaries load
#      the real one on the GPU machine). Every stub function fails with "no device", so
#        LD_LIBRARY_PATH=.cuda/stubs:$CUDA_HOME/lib target/gpu-carry/bins/eagle_check-lib
#      runs the tests here as on a GPU-less machine;
#   4. cargo build / cargo test --no-run with --features cuda into target/cuda (first run:
#      candle-kernels' nvcc build takes 5-15 minutes on two cores);
#   5. strips the three binaries and packs them with xz -9 (candle's embedded PTX compresses
#      well; everything carried to the GPU machine, repository included, must fit 64 MiB).
#
# On the GPU machine (glibc 2.39, CUDA 13.0 libraries, driver libcuda in /usr/local/nvidia/lib64):
#   tar xJf bins.tar.xz
#   export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib
#   bins/eagle_check-lib kernels:: --include-ignored --nocapture
set -euo pipefail

cd "$(dirname "$0")/.."
root=$PWD

# 1. The toolkit wheels.
wheels=(
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88
    nvidia-nvvm==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88
    nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35
)
cu_dir() { ls -d "$root"/.cuda/lib/python3*/site-packages/nvidia/cu13 2>/dev/null | head -n 1; }
if [ -z "$(cu_dir)" ] || [ ! -x "$(cu_dir)/bin/nvcc" ]; then
    echo "installing nvcc and the CUDA libraries into .cuda/"
    [ -x .cuda/bin/pip ] || python3 -m venv .cuda
    .cuda/bin/pip install --quiet "${wheels[@]}"
fi
cu=$(cu_dir)

# 2. Unversioned names for the linker.
for lib in cublas cublasLt cudart curand nvrtc; do
    versioned=$(cd "$cu/lib" && ls "lib$lib.so."* | grep -E "^lib$lib\.so\.[0-9]+$" | head -n 1)
    ln -sf "$versioned" "$cu/lib/lib$lib.so"
done

# 3. The libcuda link stub: every cu* function cuda.h declares (with and without the _v2
# renames) and every one cudarc's bindings name (they include newer CUDA versions' entries).
stubs=$root/.cuda/stubs
mkdir -p "$stubs"
cargo fetch --quiet
cudarc_dir=$(cargo metadata --format-version 1 --features cuda --quiet |
    python3 -c 'import json,sys; m=json.load(sys.stdin); print(next(p["manifest_path"] for p in m["packages"] if p["name"]=="cudarc").rsplit("/",1)[0])')
{
    gcc -E -P "$cu/include/cuda.h"
    gcc -E -P -D__CUDA_API_VERSION_INTERNAL "$cu/include/cuda.h"
} 2>/dev/null | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d '( \t' >"$stubs/symbols.txt"
grep -ohE '\bfn cu[A-Z][A-Za-z0-9_]*\(' "$cudarc_dir"/src/driver/sys/*.rs | sed -e 's/^fn //' -e 's/($//' >>"$stubs/symbols.txt"
sort -u -o "$stubs/symbols.txt" "$stubs/symbols.txt"
# Each returns CUDA_ERROR_NO_DEVICE (100): with the stub on LD_LIBRARY_PATH the binaries start
# on this machine and behave as on a machine without a GPU (the device tests say "skipped").
sed 's/.*/int &(void) { return 100; }/' "$stubs/symbols.txt" >"$stubs/libcuda_stub.c"
gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so" "$stubs/libcuda_stub.c"
ln -sf libcuda.so "$stubs/libcuda.so.1"
echo "libcuda stub: $(wc -l <"$stubs/symbols.txt") symbols"

# 4. Build. The same environment every time, so cargo reuses the CUDA build.
export CUDA_HOME=$cu
export PATH=$cu/bin:$PATH
export CUDA_COMPUTE_CAP=90
export LIBRARY_PATH=$cu/lib:$stubs${LIBRARY_PATH:+:$LIBRARY_PATH}
export CARGO_TARGET_DIR=target/cuda
cargo build --release --features cuda
tests_json=$(cargo test --release --features cuda --no-run --message-format=json)
test_binary() { # $1: target name, $2: target kind
    python3 -c '
import json, sys
name, kind = sys.argv[1], sys.argv[2]
for line in sys.stdin:
    m = json.loads(line)
    t = m.get("target", {})
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") \
            and t.get("name") == name and kind in t.get("kind", []) and m.get("executable"):
        print(m["executable"])
' "$1" "$2" <<<"$tests_json"
}
lib_tests=$(test_binary eagle_check lib)
main_tests=$(test_binary main test)
bench_json=$(cargo bench --features cuda --bench gpu --bench diff --no-run --message-format=json)
bench_binary() { # $1: bench name
    python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == sys.argv[1] \
            and m.get("executable"):
        print(m["executable"])
' "$1" <<<"$bench_json"
}
gpu_bench=$(bench_binary gpu)
diff_bench=$(bench_binary diff)

# 5. Strip and pack.
carry=target/gpu-carry
rm -rf "$carry/bins" && mkdir -p "$carry/bins"
cp target/cuda/release/eagle-check "$carry/bins/eagle-check"
cp "$lib_tests" "$carry/bins/eagle_check-lib"
cp "$main_tests" "$carry/bins/main-tests"
cp "$gpu_bench" "$carry/bins/gpu-bench"
cp "$diff_bench" "$carry/bins/diff-bench"
strip "$carry"/bins/*
tar -C "$carry" -cf - bins | xz -9 -T0 >"$carry/bins.tar.xz"
ls -l "$carry"/bins/* "$carry/bins.tar.xz" | awk '{printf "%10d  %s\n", $5, $NF}'
