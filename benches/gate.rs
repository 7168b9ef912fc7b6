//! `cargo bench --bench gate`: the static gate on a DeepSeek-V3-sized directory (163 sparse
//! shards with the real tensor shapes), against a peer measured in the same run: reading the
//! same 163 headers' raw bytes with no parsing, the floor any header-based check pays.

#[path = "../tests/support/synth.rs"]
#[allow(dead_code)]
mod synth;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

fn raw_headers(dir: &Path) -> usize {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            let mut f = std::fs::File::open(&path).unwrap();
            let mut len = [0u8; 8];
            f.read_exact(&mut len).unwrap();
            let mut buf = vec![0u8; u64::from_le_bytes(len) as usize];
            f.read_exact(&mut buf).unwrap();
            total += buf.len();
        }
    }
    total
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let scratch = root.join("target/bench-scratch/dsv3");
    let _ = std::fs::remove_dir_all(&scratch);
    let fixtures = root.join("fixtures/real-configs");
    let target = synth::deepseek_v3_dir(
        &scratch.join("target"),
        &fixtures.join("target_deepseek-v3-671b__tt-metal_reference_config.json"),
        163,
    );
    let draft = synth::draft_dir(
        &scratch.join("draft"),
        &fixtures.join("draft_eagle3_deepseek-v3-671b__SpecForge.json"),
        3 * 7168,
    );
    let bin = root.join("target/release/eagle-check");
    assert!(
        bin.exists(),
        "build the binary first: cargo build --release"
    );
    let runs = 9;
    let mut gate = Vec::new();
    let mut peer = Vec::new();
    let mut header_bytes = 0;
    for _ in 0..runs {
        let t = Instant::now();
        let out = Command::new(&bin)
            .args([
                "gate",
                "--spec",
                "specs/deepseek-v3-specforge.yaml",
                "--engine",
                "sglang",
                "--format",
                "json",
            ])
            .arg("--draft")
            .arg(&draft)
            .arg("--target")
            .arg(&target)
            .current_dir(&root)
            .output()
            .unwrap();
        gate.push(t.elapsed());
        assert_eq!(
            out.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let t = Instant::now();
        header_bytes = raw_headers(&target);
        peer.push(t.elapsed());
    }
    let (g, r) = (median(gate), median(peer));
    println!(
        "gate, DeepSeek-V3 671B layout (163 shards, {header_bytes} header bytes), median of {runs}:"
    );
    println!(
        "  eagle-check gate (whole process):  {:>8.1} ms",
        g.as_secs_f64() * 1e3
    );
    println!(
        "  peer: raw header reads, no parse:  {:>8.1} ms",
        r.as_secs_f64() * 1e3
    );
    println!(
        "  ratio gate / peer:                 {:>8.1}x",
        g.as_secs_f64() / r.as_secs_f64()
    );
}
