//! Compiles `kernels/*.cu` with nvcc when the `cuda` feature is on; without it, does nothing
//! (the CPU build needs no CUDA toolkit).
//!
//! Each file becomes a fatbin `{stem}.fatbin` holding machine code (SASS) for the GPUs this
//! build targets and PTX for any other, and that PTX alone, `{stem}.ptx` (the loader's
//! fallback where a driver refuses the fatbin). Why at build time rather than NVRTC at run time: a
//! kernel that does not compile fails the build (and `cargo check --features cuda` in CI)
//! instead of the first GPU run, and the binary needs no NVRTC library. Why machine code and
//! not PTX alone: the driver compiles PTX when a module first loads, in every process whose
//! compute cache is empty (a fresh machine, a container), and `ptxas` takes seconds on the
//! largest files (attention.cu, moe_gemm_sm90.cu).
//!
//! The PTX targets `compute_80` (mma.sync on bf16 needs sm_80+; `EAGLE_CHECK_CUDA_ARCH`
//! overrides, e.g. `compute_90`); the machine code is for `sm_90`, the H100 and H200
//! (`EAGLE_CHECK_CUDA_SASS` overrides: a comma list such as `sm_80,sm_90`, or `none` for PTX
//! alone). Files named `*_sm90.cu` use Hopper-only instructions (wgmma, setmaxnreg) and always
//! target `compute_90a` with `sm_90a` machine code: they load on sm_90 devices only, and the
//! runner picks them only there.
//!
//! nvcc is `$NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on the PATH. The files compile in
//! parallel.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    for var in [
        "NVCC",
        "CUDA_HOME",
        "EAGLE_CHECK_CUDA_ARCH",
        "EAGLE_CHECK_CUDA_SASS",
    ] {
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
    let sass = std::env::var("EAGLE_CHECK_CUDA_SASS").unwrap_or_else(|_| "sm_90".into());
    let sass: Vec<&str> = match sass.trim() {
        "none" | "" => Vec::new(),
        list => list.split(',').map(str::trim).collect(),
    };
    std::thread::scope(|scope| {
        let builds: Vec<_> = sources
            .iter()
            .map(|src| {
                let stem = src.file_stem().expect("a .cu file has a stem");
                let hopper = stem.to_string_lossy().ends_with("_sm90");
                let gencode = if hopper {
                    gencode("compute_90a", &["sm_90a"])
                } else {
                    gencode(&arch, &sass)
                };
                let nvcc = |kind: &str, code: &str, ext: &str| {
                    let mut command = Command::new(&nvcc);
                    command
                        .args([kind, "-O3", "-std=c++17", code])
                        .arg("-I")
                        .arg(kernels)
                        .arg(src)
                        .arg("-o")
                        .arg(out_dir.join(stem).with_extension(ext));
                    command
                };
                let ptx = if hopper { "compute_90a" } else { arch.as_str() };
                let mut fatbin = nvcc("-fatbin", &gencode, "fatbin");
                // The PTX alone too: what the loader falls back to where the driver refuses
                // the fatbin.
                let mut text = nvcc("-ptx", &format!("-arch={ptx}"), "ptx");
                let build = scope.spawn(move || {
                    let output = fatbin.output()?;
                    if output.status.success() {
                        text.output()
                    } else {
                        Ok(output)
                    }
                });
                (src, build)
            })
            .collect();
        for (src, build) in builds {
            let output = build
                .join()
                .expect("an nvcc thread does not panic")
                .unwrap_or_else(|e| panic!("could not run {}: {e}", nvcc.display()));
            if !output.status.success() {
                eprintln!("{}", String::from_utf8_lossy(&output.stderr));
                panic!("nvcc failed on {} ({})", src.display(), output.status);
            }
        }
    });
}

/// nvcc's `-gencode`: PTX for the virtual architecture `ptx`, machine code for each of `sass`.
fn gencode(ptx: &str, sass: &[&str]) -> String {
    let codes: Vec<&str> = sass.iter().copied().chain([ptx]).collect();
    format!("-gencode=arch={ptx},code=[{}]", codes.join(","))
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
