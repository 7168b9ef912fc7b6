//! The dense families beyond Llama against HF transformers 5.24 on the tiny checkpoints of
//! fixtures/gen_dense_models.py: every boundary, the pre-norm final state and the logits,
//! through the candle path, the kernel path (the GPU's code path, its kernels' CPU references)
//! and the streamed target; `run`, `diff` and `probe` through the binary; the published configs
//! of each family resolve and gate. Each family names the HF file it follows. The negative
//! controls plant each family's likeliest bug in a copy of the checkpoint and require the
//! parity to break, so the fixtures can tell.

use crate::support::families::{
    gate_on_both_engines, planted, reference, run, run_diff_and_probe, spec_for, streamed_matches,
};
use crate::support::parity::{ids, worst_error};
use crate::support::{eagle_check, fixture, p, scratch};
use candle_core::{DType, Device, Tensor};
use eagle_check::config::ModelConfig;
use eagle_check::model::source::SafetensorsSource;
use eagle_check::model::{CaptureRequest, ComputePath, Progress, load_target_on};
use std::collections::HashMap;
use std::path::Path;

/// The f32 parity bound, with its reason: `eagle_check::tolerance::PARITY_F32`.
const F32_TOL: f64 = eagle_check::tolerance::PARITY_F32;

/// (fixture, the HF modeling file its numbers come from)
const FAMILIES: [(&str, &str); 8] = [
    ("phi3", "models/phi3/modeling_phi3.py"),
    ("phi3_window", "models/phi3/modeling_phi3.py"),
    (
        "gemma3_text",
        "models/gemma3/modeling_gemma3.py (Gemma3ForCausalLM)",
    ),
    (
        "gemma3",
        "models/gemma3/modeling_gemma3.py (Gemma3ForConditionalGeneration)",
    ),
    (
        "qwen2_5_vl",
        "models/qwen2_5_vl/modeling_qwen2_5_vl.py (Qwen2_5_VLTextModel)",
    ),
    (
        "qwen3_vl",
        "models/qwen3_vl/modeling_qwen3_vl.py (Qwen3VLTextModel)",
    ),
    (
        "gemma4_text",
        "models/gemma4/modeling_gemma4.py (Gemma4ForCausalLM)",
    ),
    (
        "gemma4",
        "models/gemma4/modeling_gemma4.py (Gemma4ForConditionalGeneration)",
    ),
];

#[test]
fn dense_families_match_transformers_on_both_paths() {
    for (name, hf) in FAMILIES {
        let dir = fixture(&format!("models/{name}"));
        let r = reference(name);
        for path in [ComputePath::Candle, ComputePath::Kernels] {
            let what = format!("{name} ({hf}, {path:?})");
            let (cfg, cap) = run(&dir, &r, path);
            let worst = worst_error(&what, &cfg, &cap, &r);
            eprintln!("{what}: worst rel err {worst:.3e}");
            assert!(worst <= F32_TOL, "{what}: worst rel err {worst:.3e}");
        }
    }
}

/// In bf16 on the CPU (the candle path's head-major ops, which the GPU's candle path runs, and
/// the kernels' references), every family lands within the bf16 bound of HF's f32 states
/// (Gemma-4's own, `PARITY_BF16_GEMMA4`), and not bit-exact.
#[test]
fn dense_families_in_bf16_stay_within_the_bf16_bound() {
    for (name, _) in FAMILIES {
        let dir = fixture(&format!("models/{name}"));
        let r = reference(name);
        let cfg = ModelConfig::load(&dir).unwrap();
        let src = SafetensorsSource::open(&dir).unwrap();
        for path in [ComputePath::Candle, ComputePath::Kernels] {
            let model = load_target_on(&cfg, &src, DType::BF16, &Device::Cpu, path).unwrap();
            let cap = model
                .forward(&ids(&r), &CaptureRequest::all(), &mut Progress::hidden())
                .unwrap();
            let what = format!("{name} bf16 {path:?}");
            let worst = worst_error(&what, &cfg, &cap, &r);
            eprintln!("{what}: worst rel err {worst:.3e}");
            let bound = match cfg.arch {
                eagle_check::config::Arch::Gemma4 => eagle_check::tolerance::PARITY_BF16_GEMMA4,
                _ => eagle_check::tolerance::PARITY_BF16,
            };
            assert!(worst < bound && worst > F32_TOL, "{what}: {worst:.3e}");
        }
    }
}

#[test]
fn dense_families_streamed_match_transformers() {
    for (name, _) in FAMILIES {
        let worst = streamed_matches(name);
        eprintln!("{name} streamed: worst rel err {worst:.3e}");
    }
}

/// The resolved configs say what HF's config classes say.
#[test]
fn dense_family_configs_resolve_as_transformers_reads_them() {
    use eagle_check::config::{Arch, RopeScaling};
    let cfg = |name: &str| ModelConfig::load(&fixture(&format!("models/{name}"))).unwrap();
    let phi = cfg("phi3");
    assert_eq!(phi.arch, Arch::Phi3);
    assert_eq!(
        (phi.rotary_dim, phi.head_dim),
        (12, 16),
        "partial_rotary_factor 0.75"
    );
    assert!(phi.tie_word_embeddings && phi.sliding_window.is_none());
    match &phi.rope.scaling {
        RopeScaling::LongRope {
            short_factor,
            original_max_position_embeddings,
            attention_factor,
            ..
        } => {
            assert_eq!(short_factor.len(), 6);
            assert_eq!(*original_max_position_embeddings, 16.0);
            // sqrt(1 + ln(64 / 16) / ln(16))
            let want = (1.0 + (4f64).ln() / (16f64).ln()).sqrt();
            assert!(
                (attention_factor - want).abs() < 1e-12,
                "{attention_factor}"
            );
        }
        other => panic!("phi3 rope: {other:?}"),
    }
    let win = cfg("phi3_window");
    assert_eq!(win.rotary_dim, win.head_dim);
    assert_eq!((win.window_of(0), win.window_of(3)), (Some(8), Some(8)));
    for name in ["gemma3_text", "gemma3"] {
        let g = cfg(name);
        assert_eq!(g.arch, Arch::Gemma3, "{name}");
        let windows: Vec<_> = (0..g.num_layers).map(|l| g.window_of(l)).collect();
        assert_eq!(windows, [Some(8), Some(8), None, Some(8), None], "{name}");
        assert!(g.tie_word_embeddings, "{name}");
        let gemma = g.gemma.as_ref().unwrap();
        assert_eq!(gemma.query_pre_attn_scalar, 24.0);
        assert_eq!(g.rope.theta, 1e6);
        assert_eq!(g.rope.scaling, RopeScaling::Linear { factor: 2.0 });
        assert_eq!(gemma.local_rope.theta, 1e4);
        assert_eq!(gemma.local_rope.scaling, RopeScaling::None);
    }
    // The towers: Qwen2's and Qwen3's decoders, M-RoPE as the default rope, theta from
    // text_config.rope_parameters.
    let q25 = cfg("qwen2_5_vl");
    assert_eq!(
        (q25.arch, q25.model_type.as_str()),
        (Arch::Qwen2, "qwen2_5_vl_text")
    );
    assert_eq!(
        (q25.rope.theta, &q25.rope.scaling),
        (1e6, &RopeScaling::None)
    );
    assert!(q25.attention_bias && !q25.o_bias);
    let q3 = cfg("qwen3_vl");
    assert_eq!(q3.arch, Arch::Qwen3);
    assert_eq!(q3.qk_norm, eagle_check::config::QkNorm::PerHead);
    assert_eq!((q3.rope.theta, &q3.rope.scaling), (5e6, &RopeScaling::None));
    // The softcap is on the causal LM's logits; transformers 5.24's Gemma-3 wrapper applies
    // none, its Gemma-4 wrapper does.
    let softcap = |name: &str| cfg(name).gemma.unwrap().final_logit_softcapping;
    assert_eq!(
        (softcap("gemma3_text"), softcap("gemma3")),
        (Some(3.0), None)
    );
    assert_eq!(
        (softcap("gemma4_text"), softcap("gemma4")),
        (Some(3.0), Some(3.0))
    );
    // Gemma-4 (`Gemma4TextConfig.__post_init__`): the full layers' head dim from
    // `per_layer_config` (transformers 5.24 writes it there), with `attention_k_eq_v` their
    // `num_global_key_value_heads`; the last layer forced full; proportional rope on a quarter.
    let g4 = cfg("gemma4_text");
    assert_eq!(g4.arch, Arch::Gemma4);
    let windows: Vec<_> = (0..g4.num_layers).map(|l| g4.window_of(l)).collect();
    assert_eq!(windows, [Some(8), Some(8), None, Some(8), None]);
    let v4 = g4.gemma.as_ref().unwrap().v4.clone().unwrap();
    assert_eq!(v4.head_dims, [16, 16, 32, 16, 32]);
    assert_eq!(v4.kv_heads, [2, 2, 1, 2, 1]);
    assert!(v4.k_eq_v && g4.tie_word_embeddings);
    let proportional = RopeScaling::Proportional {
        factor: 1.0,
        partial_rotary_factor: 0.25,
    };
    assert_eq!((g4.rope.theta, &g4.rope.scaling), (1e6, &proportional));
    let local = &g4.gemma.as_ref().unwrap().local_rope;
    assert_eq!((local.theta, &local.scaling), (1e4, &RopeScaling::None));
    let wrapped = cfg("gemma4");
    let windows: Vec<_> = (0..5).map(|l| wrapped.window_of(l)).collect();
    assert_eq!(
        windows,
        [Some(8), Some(8), Some(8), Some(8), None],
        "last forced full"
    );
    let v4 = wrapped.gemma.unwrap().v4.unwrap();
    assert_eq!((v4.head_dims[4], v4.kv_heads[4], v4.k_eq_v), (32, 2, false));
}

/// The vision-language checkpoints as transformers 4 wrote them and Qwen2.5-VL-7B is published
/// (the text tower under `model.*`, the vision tower under `visual.*`) load as the
/// transformers 5 names (`model.language_model.*`, `model.visual.*`) do.
#[test]
fn the_vision_language_towers_load_from_their_legacy_names() {
    for name in ["qwen2_5_vl", "qwen3_vl"] {
        let legacy = planted(
            name,
            "legacy-names",
            |_| {},
            |w| {
                let old = std::mem::take(w);
                for (k, v) in old {
                    let k = match (
                        k.strip_prefix("model.language_model."),
                        k.strip_prefix("model.visual."),
                    ) {
                        (Some(rest), _) => format!("model.{rest}"),
                        (_, Some(rest)) => format!("visual.{rest}"),
                        _ => k,
                    };
                    w.insert(k, v);
                }
            },
        );
        for path in [ComputePath::Candle, ComputePath::Kernels] {
            let w = worst_of_on(&legacy, name, path);
            assert!(w <= F32_TOL, "{name} legacy names {path:?}: {w:.3e}");
        }
    }
}

/// The Gemma-3 wrapper's checkpoint as save_pretrained writes it and the published ones are
/// laid out (`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`) loads as
/// the transformers 5 names do, the towers it does not run left unread.
#[test]
fn the_gemma3_wrapper_loads_from_its_legacy_names() {
    let legacy = planted(
        "gemma3",
        "legacy-names",
        |_| {},
        |w| {
            let old = std::mem::take(w);
            for (k, v) in old {
                let k = match k.strip_prefix("model.language_model.") {
                    Some(rest) => format!("language_model.model.{rest}"),
                    None => k.strip_prefix("model.").unwrap_or(&k).to_string(),
                };
                w.insert(k, v);
            }
        },
    );
    for path in [ComputePath::Candle, ComputePath::Kernels] {
        let w = worst_of_on(&legacy, "gemma3", path);
        assert!(w <= F32_TOL, "gemma3 legacy names {path:?}: {w:.3e}");
    }
}

/// A LongRoPE config whose factors do not fit the rotated dims is refused when it is read,
/// in one line, naming the key.
#[test]
fn a_longrope_of_the_wrong_length_is_refused_by_name() {
    let dir = planted(
        "phi3",
        "short-list",
        |c| c["rope_parameters"]["short_factor"] = serde_json::json!([1.0, 1.0]),
        |_| {},
    );
    let err = ModelConfig::load(&dir).unwrap_err().to_string();
    assert!(
        err.contains("short_factor") && err.contains("2 entries"),
        "{err}"
    );
    let out = eagle_check([
        "run",
        "--target",
        &p(&dir),
        "--draft",
        &p(&fixture("models/qwen3-draft")),
        "--engine",
        "sglang",
        "--tokens",
        "1,2,3",
    ]);
    out.assert_could_not_check(&["short_factor"]);
}

fn worst_of(dir: &Path, name: &str) -> f64 {
    worst_of_on(dir, name, ComputePath::Candle)
}

fn worst_of_on(dir: &Path, name: &str, path: ComputePath) -> f64 {
    let r = reference(name);
    let (cfg, cap) = run(dir, &r, path);
    worst_error(&format!("{name} planted"), &cfg, &cap, &r)
}

/// Every norm weight of `w` one less: Gemma-3's `1 + w` norms read as `w`, or the reverse.
fn minus_one_norms(w: &mut HashMap<String, Tensor>) {
    map_tensors(w, &["norm.weight", "layernorm.weight"], |t| {
        (t - 1.0).unwrap()
    });
}

/// Every tensor of `w` whose name ends with one of `ends`, through `f`.
fn map_tensors(w: &mut HashMap<String, Tensor>, ends: &[&str], f: impl Fn(&Tensor) -> Tensor) {
    for (k, v) in w.iter_mut() {
        if ends.iter().any(|e| k.ends_with(e)) {
            *v = f(v);
        }
    }
}

#[test]
fn planted_dense_family_bugs_break_the_parity() {
    // Phi-4-mini with rope over the whole head (partial_rotary_factor ignored).
    let full_rope = planted(
        "phi3",
        "rope",
        |c| {
            c["rope_parameters"]["partial_rotary_factor"] = serde_json::json!(1.0);
            let pad = |l: &mut serde_json::Value| {
                l.as_array_mut().unwrap().extend([1.0.into(), 1.0.into()])
            };
            pad(&mut c["rope_parameters"]["short_factor"]);
            pad(&mut c["rope_parameters"]["long_factor"]);
        },
        |_| {},
    );
    assert!(
        worst_of(&full_rope, "phi3") > 1e-2,
        "partial rotary ignored must fail"
    );
    // Phi-3 with its window off: every query sees the whole past.
    let no_window = planted(
        "phi3_window",
        "window",
        |c| c["sliding_window"] = serde_json::Value::Null,
        |_| {},
    );
    assert!(
        worst_of(&no_window, "phi3_window") > 1e-2,
        "window off must fail"
    );
    // Gemma-3 with its embedding unscaled: the weights divided by sqrt(H), so the runner's
    // scaled rows are the raw ones HF never returns.
    let unscaled = planted(
        "gemma3_text",
        "embed-scale",
        |_| {},
        |w| map_tensors(w, &["embed_tokens.weight"], |t| (t / 8.0).unwrap()),
    );
    assert!(
        worst_of(&unscaled, "gemma3_text") > 1e-2,
        "embedding scale missing must fail"
    );
    // Gemma-3's norms read as `w`, not `1 + w`: every norm weight one less.
    let plain_norms = planted("gemma3_text", "one-plus-w", |_| {}, minus_one_norms);
    assert!(
        worst_of(&plain_norms, "gemma3_text") > 1e-2,
        "1 + w norm as w must fail"
    );
    // Gemma-3 with the window off (wider than the 24 tokens): the sliding layers see too far.
    let no_window = planted(
        "gemma3",
        "window",
        |c| c["text_config"]["sliding_window"] = serde_json::json!(64),
        |_| {},
    );
    assert!(
        worst_of(&no_window, "gemma3") > 1e-2,
        "Gemma window off must fail"
    );
    // Gemma-3's sliding layers on the global rope base.
    let one_base = planted(
        "gemma3_text",
        "local-base",
        |c| c["rope_parameters"]["sliding_attention"]["rope_theta"] = serde_json::json!(1e6),
        |_| {},
    );
    assert!(
        worst_of(&one_base, "gemma3_text") > 1e-2,
        "local rope base ignored must fail"
    );
    // Qwen3-VL's tower with the rope base not read from `text_config.rope_parameters`
    // (the default 10000 instead of 5e6).
    let wrong_base = planted(
        "qwen3_vl",
        "rope-base",
        |c| c["text_config"]["rope_parameters"]["rope_theta"] = serde_json::json!(10000.0),
        |_| {},
    );
    assert!(
        worst_of(&wrong_base, "qwen3_vl") > 1e-2,
        "the tower's rope base lost must fail"
    );
    // Qwen2.5-VL's tower without its q/k/v biases (zeroed): Qwen2's bias is part of it.
    let no_bias = planted(
        "qwen2_5_vl",
        "bias",
        |_| {},
        |w| {
            map_tensors(w, &["q_proj.bias", "k_proj.bias", "v_proj.bias"], |t| {
                t.zeros_like().unwrap()
            })
        },
    );
    assert!(
        worst_of(&no_bias, "qwen2_5_vl") > 1e-2,
        "the tower's q/k/v bias dropped must fail"
    );
    // Gemma-3's causal LM without its final softcap: only the logits move.
    let no_cap = planted(
        "gemma3_text",
        "softcap",
        |c| c["final_logit_softcapping"] = serde_json::Value::Null,
        |_| {},
    );
    assert!(
        worst_of(&no_cap, "gemma3_text") > 1e-2,
        "softcap missing must fail"
    );
    // Gemma-4 (modeling_gemma4.py) without its `layer_scalar`s: every stored scalar 1.
    let unscaled = planted(
        "gemma4_text",
        "layer-scalar",
        |_| {},
        |w| map_tensors(w, &["layer_scalar"], |t| t.ones_like().unwrap()),
    );
    assert!(
        worst_of(&unscaled, "gemma4_text") > 1e-2,
        "layer_scalar ignored must fail"
    );
    // Gemma-4's full layers on a plain rope over the whole head (proportional read as default).
    let plain_rope = planted(
        "gemma4_text",
        "proportional",
        |c| c["rope_parameters"]["full_attention"]["rope_type"] = serde_json::json!("default"),
        |_| {},
    );
    assert!(
        worst_of(&plain_rope, "gemma4_text") > 1e-2,
        "proportional rope as default must fail"
    );
    // Gemma-4's norms read as Gemma-3's `1 + w`: every norm weight one less.
    let offset = planted("gemma4", "offset-norms", |_| {}, minus_one_norms);
    assert!(
        worst_of(&offset, "gemma4") > 1e-2,
        "Gemma-4's w norms as 1 + w must fail"
    );
}

/// Real target configs under fixtures/real-configs/targets/.
const REAL: [&str; 3] = [
    "target_phi-4__tt-metal_model_params.json",
    "target_gemma-3-1b-it__TensorRT-LLM_test_modeling_gemma3_PATCHED_L26.json",
    "target_qwen2.5-vl-7b-instruct__tt-metal_model_params.json",
];

/// The published configs resolve to the runner's settings as transformers reads them, and the
/// gate checks them (no `unsupported-architecture`, no exit 2) on sglang and vLLM.
#[test]
fn real_dense_configs_resolve_and_gate() {
    use eagle_check::config::{Arch, RopeScaling};
    let dir = scratch("dense-real-gate");
    for file in REAL {
        let path = fixture(&format!("real-configs/targets/{file}"));
        let cfg = ModelConfig::load(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
        match cfg.arch {
            Arch::Phi3 => {
                // Phi-4: 40 layers, GQA 40/10, full rotary, no window, rope_theta 250000.
                assert_eq!(
                    (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads),
                    (40, 40, 10)
                );
                assert_eq!(cfg.rotary_dim, cfg.head_dim);
                assert_eq!(cfg.rope.theta, 250000.0);
                assert_eq!(cfg.rope.scaling, RopeScaling::None);
                assert!(cfg.sliding_window.is_none() && !cfg.tie_word_embeddings);
            }
            Arch::Gemma3 => {
                // Gemma-3-1B (a transformers 4 file): every 6th layer full, the rest on a
                // 512 window with the local base; query_pre_attn_scalar 256, head_dim 256.
                assert_eq!(
                    (cfg.num_layers, cfg.head_dim, cfg.num_kv_heads),
                    (26, 256, 1)
                );
                let full: Vec<usize> = (0..cfg.num_layers)
                    .filter(|&l| cfg.window_of(l).is_none())
                    .collect();
                assert_eq!(full, [5, 11, 17, 23], "{file}");
                assert_eq!(cfg.window_of(0), Some(512));
                let g = cfg.gemma.as_ref().unwrap();
                assert_eq!((cfg.rope.theta, g.local_rope.theta), (1e6, 1e4));
                assert_eq!(g.query_pre_attn_scalar, 256.0);
                assert_eq!(g.final_logit_softcapping, None);
                assert!(cfg.tie_word_embeddings);
            }
            Arch::Qwen2 => {
                // Qwen2.5-VL-7B (a transformers 4 file, no text_config): its text tower is
                // Qwen2's; `rope_scaling: {type: mrope}` is the default rope on text.
                assert_eq!(cfg.model_type, "qwen2_5_vl");
                assert_eq!(
                    (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads),
                    (28, 28, 4)
                );
                assert_eq!(
                    (cfg.rope.theta, &cfg.rope.scaling),
                    (1e6, &RopeScaling::None)
                );
                assert!(cfg.attention_bias && !cfg.o_bias && cfg.sliding_window.is_none());
            }
            other => panic!("{file}: {other:?}"),
        }
        for (engine, out) in gate_on_both_engines(&dir, &cfg, &path) {
            assert_ne!(out.code, 2, "{file} on {engine}: {}", out.stdout);
            // vLLM's Gemma-3 implements no SupportsEagle3 (the rule table says so); every
            // other pair is served.
            let refused = cfg.arch == Arch::Gemma3 && engine == "vllm";
            assert_eq!(
                out.finding_names()
                    .contains(&"unsupported-architecture".to_string()),
                refused,
                "{file} on {engine}: {}",
                out.stdout
            );
        }
    }
}

/// The engine a family's spec names: sglang, but for Gemma-3 the release whose layer still
/// returns the residual sum (0.5.23's fused one feeds no residual stream, and vLLM serves no
/// EAGLE-3 on it; the rule table's `missing-residual` and `unsupported-architecture`; 0.5.23's
/// Gemma-4 layer still returns the stream).
fn engine_of(name: &str) -> &'static str {
    if name.starts_with("gemma3") {
        "sglang@0.5.14"
    } else {
        "sglang"
    }
}

/// The shrunk copies of the published configs (every key kept, their checkpoints' tensor names
/// and bf16 dtype: Phi-4's fused projections, Gemma-3-1B's `model.*`, Qwen2.5-VL-7B's
/// `model.*` + `visual.*`, Gemma-4-31B-IT's `model.language_model.*` / `model.vision_tower.*` /
/// `model.embed_vision.*` with its NVFP4 quantisation dropped) load and match transformers on
/// both paths.
#[test]
fn shrunk_real_dense_checkpoints_load_and_match_transformers() {
    for name in [
        "shrunk-dense/phi-4",
        "shrunk-dense/gemma-3-1b-it",
        "shrunk-dense/qwen2.5-vl-7b-instruct",
        "shrunk-families/gemma-4-31b-it",
    ] {
        let dir = fixture(&format!("real-configs/{name}"));
        let r = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu)
            .unwrap();
        for path in [ComputePath::Candle, ComputePath::Kernels] {
            let what = format!("shrunk {name} ({path:?})");
            let (cfg, cap) = run(&dir, &r, path);
            let worst = worst_error(&what, &cfg, &cap, &r);
            eprintln!("{what}: worst rel err {worst:.3e}");
            assert!(worst <= F32_TOL, "{what}: {worst:.3e}");
        }
    }
}

/// `run`, `diff` and `probe` on every dense family with `extra` arguments on each command
/// (`tests/gpu.rs` passes `--device cuda`): each command's exit code, findings and probed
/// layouts, in order.
pub(crate) fn run_diff_and_probe_on_every_family(
    extra: &[&str],
) -> Vec<(String, i32, Vec<String>)> {
    let dir = scratch(&format!("dense-cli{}", extra.join("")));
    FAMILIES
        .iter()
        .flat_map(|(name, hf)| run_diff_and_probe(&dir, name, hf, engine_of(name), extra))
        .collect()
}

/// `run`, `diff` and `probe` through the binary on every family's tiny checkpoint, with the
/// tiny EAGLE-3 draft of fixtures/models/qwen3-draft (hidden 64, vocab 256, ids [0, 1, 2]).
#[test]
fn run_diff_and_probe_work_on_every_dense_family() {
    run_diff_and_probe_on_every_family(&[]);
    let dir = scratch("dense-cli-sglang");
    let draft = fixture("models/qwen3-draft");
    for (name, _) in FAMILIES {
        let engine = engine_of(name);
        if engine != "sglang" {
            // The current sglang on Gemma-3: its fused layer feeds no residual stream.
            let target = fixture(&format!("models/{name}"));
            let l = ModelConfig::load(&target).unwrap().num_layers;
            let spec = spec_for(&dir, name, engine, l, [1, 2, 3]);
            let tokens = ids(&reference(name))
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",");
            let out = eagle_check([
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
                "--engine",
                "sglang",
            ]);
            assert_eq!(out.code, 1, "run {name} on sglang: {}", out.stdout);
            assert!(
                out.finding_names()
                    .contains(&"missing-residual".to_string()),
                "{name}: {}",
                out.stdout
            );
        }
    }
}

/// What the Gemma runner does not compute is refused when the config is read, in one line with
/// exit 2: bidirectional attention, attention-logit softcapping, another activation; and
/// Gemma-4's per-layer inputs (E2B/E4B), KV sharing, fully bidirectional attention, per-layer
/// overrides beyond the attention's shape, and modelopt-quantised weights.
#[test]
fn gemma_settings_the_runner_does_not_compute_are_refused() {
    let draft = fixture("models/qwen3-draft");
    let gemma4: [(&str, &str, serde_json::Value, &str); 5] = [
        (
            "ple",
            "hidden_size_per_layer_input",
            serde_json::json!(256),
            "hidden_size_per_layer_input 256",
        ),
        (
            "kv-share",
            "num_kv_shared_layers",
            serde_json::json!(2),
            "num_kv_shared_layers 2",
        ),
        (
            "bidir-all",
            "use_bidirectional_attention",
            serde_json::json!("all"),
            "use_bidirectional_attention \"all\"",
        ),
        (
            "per-layer",
            "per_layer_config",
            serde_json::json!({"2": {"head_dim": 32, "intermediate_size": 8}}),
            "per_layer_config.2.intermediate_size",
        ),
        (
            "nvfp4",
            "quantization_config",
            serde_json::json!({"quant_method": "modelopt", "quant_algo": "NVFP4"}),
            "modelopt NVFP4",
        ),
    ];
    for (tag, key, value, needle) in gemma4 {
        let dir = planted("gemma4_text", tag, |c| c[key] = value.clone(), |_| {});
        let out = eagle_check([
            "run",
            "--target",
            &p(&dir),
            "--draft",
            &p(&draft),
            "--engine",
            "sglang",
            "--tokens",
            "1,2,3",
        ]);
        out.assert_could_not_check(&[needle]);
    }
    for (tag, key, value, needle) in [
        (
            "bidir",
            "use_bidirectional_attention",
            serde_json::json!(true),
            "use_bidirectional_attention",
        ),
        (
            "attn-cap",
            "attn_logit_softcapping",
            serde_json::json!(50.0),
            "attn_logit_softcapping",
        ),
        (
            "act",
            "hidden_activation",
            serde_json::json!("relu"),
            "`relu`",
        ),
    ] {
        let dir = planted("gemma3_text", tag, |c| c[key] = value.clone(), |_| {});
        let out = eagle_check([
            "run",
            "--target",
            &p(&dir),
            "--draft",
            &p(&draft),
            "--engine",
            "sglang@0.5.14",
            "--tokens",
            "1,2,3",
        ]);
        out.assert_could_not_check(&[needle]);
    }
}

/// Gemma-4-31B-IT's published config (NVIDIA's NVFP4 export of it, `Gemma4ForConditionalGeneration`,
/// the text model under `text_config`): the gate checks it on sglang and vLLM as the rule table
/// says; the runner refuses its modelopt NVFP4 weights by name, and without them (the bf16
/// checkpoint's config) it resolves as `Gemma4TextConfig.__post_init__` fills it in: 60 layers,
/// every 6th full with `global_head_dim` 512 and 4 KV heads (`attention_k_eq_v`), the sliding
/// ones 16 KV heads of 256 on a 1024 window, proportional rope on a quarter of the full heads.
#[test]
fn gemma4_31b_config_resolves_and_gates() {
    use eagle_check::config::{Arch, RopeScaling};
    let file = "target_gemma-4-31b-it-nvfp4__aiconfigurator_model_configs.json";
    let dir = scratch("gemma4-31b");
    let path = fixture(&format!("real-configs/targets/{file}"));
    let err = ModelConfig::load(&path).unwrap_err().to_string();
    assert!(err.contains("modelopt NVFP4"), "{err}");
    let mut raw: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    raw.as_object_mut().unwrap().remove("quantization_config");
    let bf16 = dir.join("config.json");
    std::fs::write(&bf16, raw.to_string()).unwrap();
    let cfg = ModelConfig::load(&bf16).unwrap();
    assert_eq!(cfg.arch, Arch::Gemma4);
    assert_eq!(
        (
            cfg.num_layers,
            cfg.hidden_size,
            cfg.head_dim,
            cfg.num_kv_heads
        ),
        (60, 5376, 256, 16)
    );
    let full: Vec<usize> = (0..60).filter(|&l| cfg.window_of(l).is_none()).collect();
    assert_eq!(full, (5..60).step_by(6).collect::<Vec<_>>());
    assert_eq!(cfg.window_of(0), Some(1024));
    let g = cfg.gemma.as_ref().unwrap();
    let v4 = g.v4.as_ref().unwrap();
    assert!(v4.k_eq_v);
    assert_eq!((v4.head_dims[5], v4.kv_heads[5]), (512, 4));
    assert_eq!((v4.head_dims[0], v4.kv_heads[0]), (256, 16));
    assert_eq!(
        (cfg.rope.theta, &cfg.rope.scaling),
        (
            1e6,
            &RopeScaling::Proportional {
                factor: 1.0,
                partial_rotary_factor: 0.25
            }
        )
    );
    assert_eq!(g.local_rope.theta, 1e4);
    assert_eq!(g.final_logit_softcapping, Some(30.0));
    assert!(cfg.tie_word_embeddings);
    for target in [&path, &bf16] {
        for (engine, out) in gate_on_both_engines(&dir, &cfg, target) {
            assert_ne!(out.code, 2, "Gemma-4 31B on {engine}: {}", out.stdout);
        }
    }
}
