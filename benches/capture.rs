//! `cargo bench --bench capture`: one capture forward of SmolLM2-135M-Instruct (Q4_1 GGUF
//! dequantised to f32) on the CPU at T = 256 (every boundary, the pre-norm state and the
//! logits), median of several runs, against HF transformers timing
//! `model(input_ids, output_hidden_states=True)` on the same tokens, threads and machine in the
//! same run (fixtures/smollm2/bench_hf.py, run with `EAGLE_CHECK_PYTHON`, else `python3`).

use candle_core::{DType, Device};
use eagle_check::model::gguf::open_gguf;
use eagle_check::model::{CaptureRequest, Progress, load_target, phases};
use eagle_check::tokenize::Tokenizer;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const T: usize = 256;
const RUNS: usize = 5;

fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

/// The HF peer's (median, min) seconds, or why there is none.
fn hf_peer(
    root: &Path,
    gguf: &Path,
    ids_file: &Path,
    threads: usize,
) -> Result<(f64, f64), String> {
    let python = std::env::var_os("EAGLE_CHECK_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("python3"));
    let out = Command::new(&python)
        .arg(root.join("fixtures/smollm2/bench_hf.py"))
        .arg(gguf)
        .arg(ids_file)
        .arg(threads.to_string())
        .arg(RUNS.to_string())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().unwrap_or("");
    let v: serde_json::Value = serde_json::from_str(line).map_err(|_| {
        format!(
            "{} printed no result: {}",
            python.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )
    })?;
    if let Some(e) = v.get("error") {
        return Err(format!("bench_hf.py failed: {e}"));
    }
    eprintln!("HF peer: {line}");
    match (v["median_s"].as_f64(), v["min_s"].as_f64()) {
        (Some(median), Some(min)) => Ok((median, min)),
        _ => Err(format!("no median_s/min_s in {line}")),
    }
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let gguf = std::env::var_os("EAGLE_CHECK_SMOLLM2")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    if !gguf.is_file() {
        println!(
            "skipped: {} not found: run fixtures/smollm2/fetch.sh",
            gguf.display()
        );
        return;
    }
    let threads = candle_core::utils::get_num_threads();
    let t = Instant::now();
    let (cfg, src) = open_gguf(&gguf).unwrap();
    let model = load_target(&cfg, &src, DType::F32, &Device::Cpu).unwrap();
    let load = t.elapsed();

    // Real text, repeated to T tokens.
    let tok = Tokenizer::from_gguf_metadata(src.metadata(), &gguf).unwrap();
    let text = "Speculative decoding drafts several tokens with a small model and verifies them \
                with the target in one forward pass; EAGLE-3 drafts from the target's hidden \
                states at three depths. ";
    let ids: Vec<u32> = tok
        .encode(text)
        .unwrap()
        .into_iter()
        .cycle()
        .take(T)
        .collect();
    let scratch = root.join("target/bench-scratch");
    std::fs::create_dir_all(&scratch).unwrap();
    let ids_file = scratch.join("capture_ids.txt");
    let listing: Vec<String> = ids.iter().map(u32::to_string).collect();
    std::fs::write(&ids_file, listing.join("\n")).unwrap();

    let want = CaptureRequest::all();
    let run = || {
        let t = Instant::now();
        let cap = model.forward(&ids, &want, &mut Progress::hidden()).unwrap();
        assert_eq!(cap.hidden.len(), cfg.num_layers + 1);
        t.elapsed()
    };
    run(); // warm-up
    let times: Vec<Duration> = (0..RUNS).map(|_| run()).collect();
    let ours_min = times
        .iter()
        .min()
        .copied()
        .unwrap_or_default()
        .as_secs_f64();
    let ours_s = median(times).as_secs_f64();

    println!(
        "capture forward, SmolLM2-135M-Instruct Q4_1 -> f32, CPU, {threads} threads, T = {T}, \
         all {} boundaries + logits, median (best) of {RUNS}:",
        cfg.num_layers + 1
    );
    println!(
        "  eagle-check (f32 CPU): {:>8.1} ms ({:.1}) {:>6.0} tokens/s ({:.0})   load + dequantise {:.2} s",
        ours_s * 1e3,
        ours_min * 1e3,
        T as f64 / ours_s,
        T as f64 / ours_min,
        load.as_secs_f64()
    );
    if std::env::var_os("EAGLE_CHECK_PHASES").is_some() {
        // One more forward, phase by phase: where the time goes, apart from the timed runs.
        phases::set_enabled(true);
        run();
        let totals = phases::take();
        phases::set_enabled(false);
        let all: f64 = totals.iter().map(|p| p.1).sum();
        println!("  phases of one more forward ({all:.1} ms in all):");
        for (name, ms, n) in totals {
            println!(
                "    {name:<24} {ms:>8.1} ms  {:>5.1}%  ({n} marks)",
                100.0 * ms / all
            );
        }
    }
    match hf_peer(&root, &gguf, &ids_file, threads) {
        Ok((hf_s, hf_min)) => {
            println!(
                "  HF transformers:      {:>8.1} ms ({:.1}) {:>6.0} tokens/s ({:.0})",
                hf_s * 1e3,
                hf_min * 1e3,
                T as f64 / hf_s,
                T as f64 / hf_min
            );
            println!(
                "  ratio eagle-check / HF (tokens/s): {:.2}x median, {:.2}x best",
                hf_s / ours_s,
                hf_min / ours_min
            );
        }
        Err(why) => println!("  HF transformers: unavailable ({why}); only eagle-check reported"),
    }
}
