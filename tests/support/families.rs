//! What the model-family tests share (`tests/moe_families.rs`, `tests/dense_families.rs`): a
//! fixture's HF reference and a CPU f32 run of it, a planted copy of a fixture, and the spec,
//! draft config and training-data file the `run` / `diff` / `probe` checks drive the binary with.

use super::parity::{self, ids};
use super::{eagle_check, fixture, p, scratch};
use candle_core::{DType, Device, Tensor};
use eagle_check::config::ModelConfig;
use eagle_check::model::source::SafetensorsSource;
use eagle_check::model::{Capture, CaptureRequest, ComputePath, Progress, load_target_on};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Fixture `name`'s HF reference (`fixtures/models/{name}/reference.safetensors`).
pub fn reference(name: &str) -> HashMap<String, Tensor> {
    parity::reference(&format!("models/{name}/reference.safetensors"))
}

/// The checkpoint in `dir` on the CPU in f32 on compute `path`, over `r`'s tokens, every
/// boundary captured.
pub fn run(dir: &Path, r: &HashMap<String, Tensor>, path: ComputePath) -> (ModelConfig, Capture) {
    let cfg = ModelConfig::load(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let src = SafetensorsSource::open(dir).unwrap();
    let model = load_target_on(&cfg, &src, DType::F32, &Device::Cpu, path)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let cap = model
        .forward(&ids(r), &CaptureRequest::all(), &mut Progress::hidden())
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    (cfg, cap)
}

/// A copy of fixture `name` with `edit` applied to its config.json and `tensors` to its
/// weights.
pub fn planted(
    name: &str,
    tag: &str,
    edit: impl Fn(&mut serde_json::Value),
    tensors: impl Fn(&mut HashMap<String, Tensor>),
) -> PathBuf {
    let src = fixture(&format!("models/{name}"));
    let dir = scratch(&format!("planted-{name}-{tag}"));
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let mut w =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    tensors(&mut w);
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
    dir
}

/// A SpecForge-style EAGLE-3 draft config for a target of `hidden` and `vocab` (SpecForge's
/// Qwen3-8B draft with the target's widths).
pub fn draft_for(dir: &Path, hidden: usize, vocab: usize) -> PathBuf {
    let base = fixture("real-configs/draft_eagle3_qwen3-8b__SpecForge.json");
    let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(base).unwrap()).unwrap();
    cfg["hidden_size"] = serde_json::json!(hidden);
    cfg["vocab_size"] = serde_json::json!(vocab);
    let path = dir.join(format!("draft-{hidden}.json"));
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}

/// A spec for fixture `name` capturing boundaries `b` (width 64: every fixture's hidden size).
pub fn spec_for(dir: &Path, name: &str, engine: &str, layers: usize, b: [usize; 3]) -> PathBuf {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(
        &path,
        format!(
            "name: {name}\nengine: {engine}\ntarget: {{ num_hidden_layers: {layers}, hidden_size: 64 }}\n\
             capture:\n  boundaries: [{}, {}, {}]\nfc: {{ in_features: 192 }}\n",
            b[0], b[1], b[2]
        ),
    )
    .unwrap();
    path
}

/// A training-data file of HF's own boundaries `b` of fixture `name` on its reference tokens
/// (`input_ids` [1, T], `aux_hidden_states` [1, T, 3H]).
pub fn captures_of(dir: &Path, name: &str, b: [usize; 3]) -> PathBuf {
    let r = reference(name);
    let parts: Vec<&Tensor> = b
        .iter()
        .map(|b| &r[&format!("hidden_states.{b}")])
        .collect();
    let aux = Tensor::cat(&parts, 1).unwrap().unsqueeze(0).unwrap();
    let sub = dir.join(format!("captures-{name}-{}-{}-{}", b[0], b[1], b[2]));
    std::fs::create_dir_all(&sub).unwrap();
    let tensors = HashMap::from([
        (
            "input_ids".to_string(),
            r["input_ids"].unsqueeze(0).unwrap(),
        ),
        ("aux_hidden_states".to_string(), aux),
    ]);
    candle_core::safetensors::save(&tensors, sub.join("data_0.safetensors")).unwrap();
    sub
}

/// `run`, `diff` and `probe` through the binary on fixture `name` (`hf`: the modeling file it
/// follows) with the tiny EAGLE-3 draft of fixtures/models/qwen3-draft (hidden 64, vocab 256,
/// ids [0, 1, 2]) and specs for `engine`, each command with `extra` arguments (a device):
/// - run: the draft's ids are b = [1, 2, 3] on sglang, a consistent bundle on a target deep
///   enough that b = 3 is inside it (exit 0), else a mismatch (1);
/// - diff: HF's own boundaries are identified as what they are (0), a shifted capture is not (1);
/// - probe (no spec: every engine's layout and the usual suspects; a 2-layer target is too
///   shallow for any engine to feed three slots, so a spec names [0, 1, 2] there): each
///   layout's acceptance measured through the target and the draft.
///
/// Returns each command's exit code and finding names (and the probe's measured layouts), in
/// order, for a comparison across devices.
pub fn run_diff_and_probe(
    dir: &Path,
    name: &str,
    hf: &str,
    engine: &str,
    extra: &[&str],
) -> Vec<(String, i32, Vec<String>)> {
    let with_extra = |mut args: Vec<String>| {
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let mut seen = Vec::new();
    let draft = fixture("models/qwen3-draft");
    let target = fixture(&format!("models/{name}"));
    let l = ModelConfig::load(&target).unwrap().num_layers;
    let spec = spec_for(dir, name, engine, l, [1, 2, 3]);
    let tokens = ids(&reference(name))
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let run: Vec<String> = [
        "run",
        "--target",
        &p(&target),
        "--draft",
        &p(&draft),
        "--spec",
        &p(&spec),
        "--format",
        "json",
        "--tokens",
        &tokens,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let out = eagle_check(with_extra(run));
    seen.push((format!("run {name}"), out.code, out.finding_names()));
    let want = if l > 3 { 0 } else { 1 };
    assert_eq!(
        out.code, want,
        "run {name} ({hf}): {}\n{}",
        out.stdout, out.stderr
    );
    let spec = spec_for(dir, &format!("{name}-diff"), engine, l, [1, 2, l - 1]);
    for (b, code) in [([1, 2, l - 1], 0), ([0, 1, l - 2], 1)] {
        let diff: Vec<String> = [
            "diff",
            "--spec",
            &p(&spec),
            "--target",
            &p(&target),
            "--captures",
            &p(&captures_of(dir, name, b)),
            "--format",
            "json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let out = eagle_check(with_extra(diff));
        seen.push((format!("diff {name} {b:?}"), out.code, out.finding_names()));
        assert_eq!(
            out.code, code,
            "diff {name} {b:?}: {}\n{}",
            out.stdout, out.stderr
        );
    }
    let probe_tokens: Vec<String> = (0..160u64)
        .map(|i| (((1103515245 * i + 12345) % (1 << 31)) % 256).to_string())
        .collect();
    let mut probe: Vec<String> = [
        "probe",
        "--target",
        &p(&target),
        "--draft",
        &p(&draft),
        "--tokens",
        &probe_tokens.join(","),
        "--format",
        "json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if l < 3 {
        let shallow = spec_for(dir, &format!("{name}-probe"), engine, l, [0, 1, l]);
        probe.extend(["--spec".into(), p(&shallow)]);
    }
    let out = eagle_check(with_extra(probe));
    assert_ne!(out.code, 2, "probe {name}: {}\n{}", out.stdout, out.stderr);
    let rows = out.json()["probe"].as_array().cloned().unwrap_or_default();
    assert!(
        !rows.is_empty(),
        "probe {name}: no layout measured: {}",
        out.stdout
    );
    let mut found = out.finding_names();
    found.extend(rows.iter().map(|r| r["labels"].to_string()));
    seen.push((format!("probe {name}"), out.code, found));
    seen
}

/// `gate` on sglang and on vLLM (in that order) for the target config at `path` (resolved as
/// `cfg`), with a spec capturing [2, L/2, L - 3] and a SpecForge-style draft of its widths.
pub fn gate_on_both_engines(
    dir: &Path,
    cfg: &ModelConfig,
    path: &Path,
) -> Vec<(&'static str, super::Output)> {
    let (l, h) = (cfg.num_layers, cfg.hidden_size);
    let spec = dir.join(format!("{}.yaml", cfg.model_type));
    std::fs::write(
        &spec,
        format!(
            "name: default\ncapture:\n  boundaries: [2, {}, {}]\nfc: {{ in_features: {} }}\n",
            l / 2,
            l - 3,
            3 * h
        ),
    )
    .unwrap();
    let draft = draft_for(dir, h, cfg.vocab_size);
    ["sglang", "vllm"]
        .into_iter()
        .map(|engine| (engine, super::gate_json(&spec, &draft, Some(path), engine)))
        .collect()
}

/// Fixture `name` streamed layer by layer on the CPU in f32: its worst error against the HF
/// reference (asserted within the f32 parity bound), every layer loaded once.
pub fn streamed_matches(name: &str) -> f64 {
    use eagle_check::model::load_streamed;
    use eagle_check::model::stream::StreamOptions;
    let dir = fixture(&format!("models/{name}"));
    let r = reference(name);
    let cfg = ModelConfig::load(&dir).unwrap();
    let src = Box::new(SafetensorsSource::open(&dir).unwrap());
    let streamed = load_streamed(
        &cfg,
        src,
        DType::F32,
        &Device::Cpu,
        StreamOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    let cap = streamed
        .forward(&ids(&r), &CaptureRequest::all(), &mut Progress::hidden())
        .unwrap();
    let worst = parity::worst_error(&format!("{name} streamed"), &cfg, &cap, &r);
    assert!(
        worst <= eagle_check::tolerance::PARITY_F32,
        "{name} streamed: {worst:.3e}"
    );
    let stats = streamed.stream_stats().unwrap();
    assert_eq!(stats.layers_loaded, cfg.num_layers, "{name}");
    worst
}
