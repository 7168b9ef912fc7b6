//! Compiles `kernels/*.cu` with nvcc when the `cuda` feature is on; without it, does nothing
//! (the CPU build needs no CUDA toolkit).
//!
//! Each file compiles once to PTX, `{stem}.ptx`, and ptxas makes a fatbin of that PTX,
//! `{stem}.fatbin`: machine code (SASS) for the GPUs this build targets, and the PTX for any
//! other (the PTX alone is the loader's fallback where a driver refuses the fatbin). Why at
//! build time rather than NVRTC at run time: a kernel that does not compile fails the build
//! (and `cargo check --features cuda` in CI) instead of the first GPU run, and the binary needs
//! no NVRTC library. Why machine code and not PTX alone: the driver compiles PTX when a module
//! first loads, in every process whose compute cache is empty (a fresh machine, a container),
//! and `ptxas` takes seconds on the largest files (attention.cu, moe_gemm_sm90.cu).
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
                let (virtual_arch, machine): (&str, &[&str]) =
                    if stem.to_string_lossy().ends_with("_sm90") {
                        ("compute_90a", &["sm_90a"])
                    } else {
                        (&arch, &sass)
                    };
                let ptx = out_dir.join(stem).with_extension("ptx");
                // The source compiles once, to PTX (kept: the loader's fallback where a driver
                // refuses the fatbin); the fatbin is ptxas's machine code of that PTX, with it.
                let mut to_ptx = Command::new(&nvcc);
                to_ptx
                    .args(["-ptx", "-O3", "-std=c++17"])
                    .arg(format!("-arch={virtual_arch}"))
                    .arg("-I")
                    .arg(kernels)
                    .arg(src)
                    .arg("-o")
                    .arg(&ptx);
                let mut to_fatbin = Command::new(&nvcc);
                to_fatbin
                    .arg("-fatbin")
                    .arg(gencode(virtual_arch, machine))
                    .arg(&ptx)
                    .arg("-o")
                    .arg(out_dir.join(stem).with_extension("fatbin"));
                let build = scope.spawn(move || {
                    let output = to_ptx.output()?;
                    if output.status.success() {
                        to_fatbin.output()
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
