//! Compiles `kernels/*.cu` to PTX with nvcc when the `cuda` feature is on; without it, does
//! nothing (the CPU build needs no CUDA toolkit).
//!
//! Why PTX at build time rather than NVRTC at run time: a kernel that does not compile fails
//! the build (and `cargo check --features cuda` in CI) instead of the first GPU run; a run pays
//! no compile latency; and the binary needs no NVRTC library. The PTX targets `compute_80`
//! (mma.sync on bf16 needs sm_80+); the driver JITs it for the GPU it loads on (sm_90 on the
//! H200). `EAGLE_CHECK_CUDA_ARCH` overrides the architecture, e.g. `compute_90`. Files named
//! `*_sm90.cu` use Hopper-only instructions (wgmma, setmaxnreg) and always target `compute_90a`:
//! their PTX loads on sm_90 devices only, and the runner picks them only there.
//!
//! nvcc is `$NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on the PATH.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for var in ["NVCC", "CUDA_HOME", "EAGLE_CHECK_CUDA_ARCH"] {
        println!("cargo::rerun-if-env-changed={var}");
    }
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernels = Path::new("kernels");
    // A new or removed .cu file changes the directory.
    println!("cargo::rerun-if-changed=kernels");
    let mut sources = Vec::new();
    let mut headers = Vec::new();
    for entry in std::fs::read_dir(kernels).expect("kernels/ is readable") {
        let path = entry.expect("kernels/ entry").path();
        match path.extension().and_then(|e| e.to_str()) {
            Some("cu") => sources.push(path),
            Some("cuh") => headers.push(path),
            _ => {}
        }
    }
    sources.sort();
    for path in sources.iter().chain(&headers) {
        println!("cargo::rerun-if-changed={}", path.display());
    }
    let nvcc = nvcc();
    let arch = std::env::var("EAGLE_CHECK_CUDA_ARCH").unwrap_or_else(|_| "compute_80".into());
    for src in &sources {
        let stem = src.file_stem().expect("a .cu file has a stem");
        let ptx = out_dir.join(stem).with_extension("ptx");
        let hopper = stem.to_string_lossy().ends_with("_sm90");
        let output = Command::new(&nvcc)
            .args(["-ptx", "-O3", "-std=c++17"])
            .arg(format!(
                "-arch={}",
                if hopper { "compute_90a" } else { arch.as_str() }
            ))
            .arg("-I")
            .arg(kernels)
            .arg(src)
            .arg("-o")
            .arg(&ptx)
            .output()
            .unwrap_or_else(|e| panic!("could not run {}: {e}", nvcc.display()));
        if !output.status.success() {
            eprintln!("{}", String::from_utf8_lossy(&output.stderr));
            panic!("nvcc failed on {} ({})", src.display(), output.status);
        }
    }
}

fn nvcc() -> PathBuf {
    if let Some(nvcc) = std::env::var_os("NVCC") {
        return nvcc.into();
    }
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        let nvcc = Path::new(&home).join("bin").join("nvcc");
        if nvcc.exists() {
            return nvcc;
        }
    }
    "nvcc".into()
}
