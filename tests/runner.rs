//! Runner parity with HF transformers: every boundary, the pre-norm final state, the logits and
//! the draft forward, against references made by fixtures/gen_models.py and gen_draft.py.

use crate::support::fixture;
use candle_core::{DType, Device, Tensor};
use eagle_check::compare::closeness;
use eagle_check::config::{DraftConfig, ModelConfig};
use eagle_check::model::draft::Eagle3Draft;
use eagle_check::model::source::{SafetensorsSource, Vb};
use eagle_check::model::{CaptureRequest, ComputePath, Progress, load_target, load_target_on};
use std::collections::HashMap;

/// The f32 parity bound, with its reason: `eagle_check::tolerance::PARITY_F32`.
const F32_TOL: f64 = eagle_check::tolerance::PARITY_F32;

fn reference(path: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture(path), &Device::Cpu).expect("reference file")
}

fn ids(reference: &HashMap<String, Tensor>, key: &str) -> Vec<u32> {
    reference[key]
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect()
}

/// Runs a fixture target and returns the worst relative error over every captured tensor.
fn target_parity(name: &str, dtype: DType) -> f64 {
    target_parity_on(name, dtype, ComputePath::Candle)
}

fn target_parity_on(name: &str, dtype: DType, path: ComputePath) -> f64 {
    let dir = fixture(&format!("models/{name}"));
    let cfg = ModelConfig::load(&dir).unwrap();
    let src = SafetensorsSource::open(&dir).unwrap();
    let model = load_target_on(&cfg, &src, dtype, &Device::Cpu, path).unwrap();
    let r = reference(&format!("models/{name}/reference.safetensors"));
    let tokens = ids(&r, "input_ids");
    let cap = model
        .forward(&tokens, &CaptureRequest::all(), &mut Progress::hidden())
        .unwrap();
    let mut worst = 0f64;
    for b in 0..=cfg.num_layers {
        let c = closeness(&cap.hidden[&b], &r[&format!("hidden_states.{b}")]).unwrap();
        assert_eq!(c.non_finite, 0);
        worst = worst.max(c.max_rel);
        eprintln!("{name} b={b}: max rel {:.2e}", c.max_rel);
    }
    for (got, key) in [
        (&cap.final_pre_norm, "final_pre_norm"),
        (&cap.logits, "logits"),
    ] {
        let c = closeness(got.as_ref().unwrap(), &r[key]).unwrap();
        eprintln!("{name} {key}: max rel {:.2e}", c.max_rel);
        worst = worst.max(c.max_rel);
    }
    worst
}

/// The GPU's code path (token-major projections, rope in place, flash attention, fused
/// residual-add + norm) on the CPU, through the kernels' Rust references: every fixture target
/// matches transformers as tightly as the candle path does.
#[test]
fn kernel_path_matches_transformers_for_every_llama_family_target() {
    for name in ["llama", "llama_linear_bias", "mistral", "qwen2", "qwen3"] {
        let worst = target_parity_on(name, DType::F32, ComputePath::Kernels);
        assert!(
            worst <= F32_TOL,
            "{name} (kernel path) worst rel err {worst:.3e}"
        );
    }
}

#[test]
fn llama_boundaries_match_transformers() {
    let worst = target_parity("llama", DType::F32);
    assert!(worst <= F32_TOL, "llama worst rel err {worst:.3e}");
}

/// Linear rope scaling (x4) and biases on q/k/v/o and the MLP (`attention_bias`, `mlp_bias`):
/// dropping either the scaling or any bias moves every boundary past the tolerance.
#[test]
fn llama_linear_rope_and_biases_match_transformers() {
    let worst = target_parity("llama_linear_bias", DType::F32);
    assert!(
        worst <= F32_TOL,
        "llama_linear_bias worst rel err {worst:.3e}"
    );
}

/// The fixture's sliding window (5) is shorter than its 12 tokens (gen_models.py asserts the
/// window changes the output), so a runner that ignores it fails here.
#[test]
fn mistral_boundaries_match_transformers() {
    let worst = target_parity("mistral", DType::F32);
    assert!(worst <= F32_TOL, "mistral worst rel err {worst:.3e}");
}

#[test]
fn qwen2_boundaries_match_transformers() {
    let worst = target_parity("qwen2", DType::F32);
    assert!(worst <= F32_TOL, "qwen2 worst rel err {worst:.3e}");
}

#[test]
fn qwen3_boundaries_match_transformers() {
    let worst = target_parity("qwen3", DType::F32);
    assert!(worst <= F32_TOL, "qwen3 worst rel err {worst:.3e}");
}

/// bf16 weights computed in f32 must match the f32 reference made from the same rounded weights.
#[test]
fn bf16_weights_load_and_match_in_f32() {
    let worst = target_parity("llama_bf16", DType::F32);
    assert!(worst <= F32_TOL, "llama_bf16 worst rel err {worst:.3e}");
}

/// Computing in bf16 is a different computation; it lands within bf16 tolerance (~1e-2).
#[test]
fn bf16_compute_stays_within_bf16_tolerance() {
    let worst = target_parity("llama", DType::BF16);
    assert!(
        worst < eagle_check::tolerance::PARITY_BF16,
        "bf16 compute worst rel err {worst:.3e}"
    );
    assert!(
        worst > 1e-4,
        "bf16 compute should not be bit-exact with f32 ({worst:.3e})"
    );
}

fn draft_parity(target: &str, draft: &str) -> f64 {
    draft_parity_on(target, draft, ComputePath::Candle)
}

fn draft_parity_on(target: &str, draft: &str, path: ComputePath) -> f64 {
    let tdir = fixture(&format!("models/{target}"));
    let tcfg = ModelConfig::load(&tdir).unwrap();
    let tsrc = SafetensorsSource::open(&tdir).unwrap();
    let model = load_target(&tcfg, &tsrc, DType::F32, &Device::Cpu).unwrap();
    let ddir = fixture(&format!("models/{draft}"));
    let dcfg = DraftConfig::load(&ddir).unwrap();
    let dsrc = SafetensorsSource::open(&ddir).unwrap();
    let vb = Vb::new(&dsrc, DType::F32, &Device::Cpu);
    let d = Eagle3Draft::load(&dcfg, &vb, tcfg.hidden_size, 3)
        .unwrap()
        .with_path(path);
    let r = reference(&format!("models/{draft}/draft_reference.safetensors"));
    let out = d
        .forward(
            &ids(&r, "draft_input_ids"),
            &r["draft_fc_input"],
            model.embeddings(),
        )
        .unwrap();
    let c = closeness(&out.logits, &r["draft_logits"]).unwrap();
    eprintln!("{draft} logits: max rel {:.2e}", c.max_rel);
    let want: Vec<i64> = r["draft_next_target_ids"].to_vec1::<i64>().unwrap();
    assert_eq!(
        out.next_target_ids, want,
        "{draft}: greedy draft tokens through d2t"
    );
    c.max_rel
}

#[test]
fn llama_draft_logits_match_the_pytorch_reference() {
    let worst = draft_parity("llama", "llama-draft");
    assert!(worst <= F32_TOL, "{worst:.3e}");
}

/// The drafts on the GPU's code path (CPU kernel references), the MLA draft included.
#[test]
fn kernel_path_drafts_match_the_pytorch_references() {
    for (target, draft) in [
        ("llama", "llama-draft"),
        ("qwen3", "qwen3-draft"),
        ("deepseek_v3", "mla-draft"),
    ] {
        let worst = draft_parity_on(target, draft, ComputePath::Kernels);
        assert!(worst <= F32_TOL, "{draft} (kernel path): {worst:.3e}");
    }
}

#[test]
fn qwen3_draft_logits_match_the_pytorch_reference() {
    let worst = draft_parity("qwen3", "qwen3-draft");
    assert!(worst <= F32_TOL, "{worst:.3e}");
}

/// A multimodal wrapper around the llama fixture, in both layouts transformers has written:
/// `model.language_model.*` + `lm_head.weight` (transformers 5) and `language_model.model.*` +
/// `language_model.lm_head.weight` (older LLaVA-style exports). The text model's settings sit in
/// `text_config`, the vocabulary size only at the top level. Both must capture exactly what the
/// plain checkpoint captures.
#[test]
fn multimodal_wrappers_capture_what_the_text_model_captures() {
    let plain_dir = fixture("models/llama");
    let plain_cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(plain_dir.join("config.json")).unwrap()).unwrap();
    let weights =
        candle_core::safetensors::load(plain_dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let r = reference("models/llama/reference.safetensors");
    let tokens = ids(&r, "input_ids");
    for (decoder, head) in [
        ("model.language_model", "lm_head.weight"),
        ("language_model.model", "language_model.lm_head.weight"),
    ] {
        let dir = crate::support::scratch(&format!("multimodal-{decoder}"));
        let mut text = plain_cfg.clone();
        let vocab = text.as_object_mut().unwrap().remove("vocab_size").unwrap();
        let cfg = serde_json::json!({
            "architectures": ["LlavaForConditionalGeneration"],
            "model_type": "llava",
            "vocab_size": vocab,
            "text_config": text,
        });
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let renamed: HashMap<String, Tensor> = weights
            .iter()
            .map(|(k, v)| {
                let name = match k.strip_prefix("model.") {
                    Some(rest) => format!("{decoder}.{rest}"),
                    None => head.to_string(),
                };
                (name, v.clone())
            })
            .collect();
        candle_core::safetensors::save(&renamed, dir.join("model.safetensors")).unwrap();
        let cfg = ModelConfig::load(&dir).unwrap();
        assert_eq!(
            cfg.vocab_size, 256,
            "text_config inherits the wrapper's vocab_size"
        );
        let src = SafetensorsSource::open(&dir).unwrap();
        let model = load_target(&cfg, &src, DType::F32, &Device::Cpu).unwrap();
        let cap = model
            .forward(&tokens, &CaptureRequest::all(), &mut Progress::hidden())
            .unwrap();
        for b in 0..=cfg.num_layers {
            let c = closeness(&cap.hidden[&b], &r[&format!("hidden_states.{b}")]).unwrap();
            assert!(c.max_rel <= F32_TOL, "{decoder} b={b}: {:.2e}", c.max_rel);
        }
        let c = closeness(cap.logits.as_ref().unwrap(), &r["logits"]).unwrap();
        assert!(c.max_rel <= F32_TOL, "{decoder} logits: {:.2e}", c.max_rel);
    }
}

/// A tensor the architecture never reads (here a stray MLP bias on a config without
/// `mlp_bias`) is refused by name, not silently ignored.
#[test]
fn unread_checkpoint_tensors_are_refused_by_name() {
    let plain_dir = fixture("models/llama");
    let dir = crate::support::scratch("unread-tensor");
    std::fs::copy(plain_dir.join("config.json"), dir.join("config.json")).unwrap();
    let mut weights =
        candle_core::safetensors::load(plain_dir.join("model.safetensors"), &Device::Cpu).unwrap();
    weights.insert(
        "model.layers.0.mlp.down_proj.bias".into(),
        Tensor::zeros(64, DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&weights, dir.join("model.safetensors")).unwrap();
    let cfg = ModelConfig::load(&dir).unwrap();
    let src = SafetensorsSource::open(&dir).unwrap();
    let err = load_target(&cfg, &src, DType::F32, &Device::Cpu)
        .err()
        .expect("an unread tensor is an error")
        .to_string();
    assert!(
        err.contains("model.layers.0.mlp.down_proj.bias") && err.contains("mlp_bias"),
        "{err}"
    );
}

/// `run --generate N`: each new token is the target's argmax at the last position of the
/// sequence so far. The first one is checked against transformers' logits, the next ones
/// against our own forward over the grown sequence (no reference holds longer sequences).
#[test]
fn greedy_continuation_takes_the_argmax_of_the_last_position() {
    let dir = fixture("models/llama");
    let cfg = ModelConfig::load(&dir).unwrap();
    let src = SafetensorsSource::open(&dir).unwrap();
    let model = load_target(&cfg, &src, DType::F32, &Device::Cpu).unwrap();
    let r = reference("models/llama/reference.safetensors");
    let tokens = ids(&r, "input_ids");
    let argmax_last = |logits: &Tensor| -> u32 {
        let rows = logits.dim(0).unwrap();
        logits
            .get(rows - 1)
            .and_then(|row| row.argmax(0))
            .and_then(|a| a.to_scalar::<u32>())
            .unwrap()
    };
    let new = eagle_check::commands::run::greedy_continuation(model.as_ref(), &tokens, 3).unwrap();
    assert_eq!(new.len(), 3, "{new:?}");
    assert_eq!(
        new[0],
        argmax_last(&r["logits"]),
        "first token vs transformers"
    );
    let want = CaptureRequest {
        boundaries: Some(Vec::new()),
        final_pre_norm: false,
        logits: true,
        layer_outputs: false,
    };
    for k in 1..3 {
        let mut seq = tokens.clone();
        seq.extend(&new[..k]);
        let cap = model.forward(&seq, &want, &mut Progress::hidden()).unwrap();
        assert_eq!(
            new[k],
            argmax_last(cap.logits.as_ref().unwrap()),
            "token {k}"
        );
    }
}
