//! The GQA MoE families against HF transformers 5.24 on the tiny checkpoints of
//! fixtures/gen_moe_models.py: every boundary, the pre-norm final state, the logits and every
//! MoE layer's routing, through the candle path, the kernel path (the GPU's code path, its
//! kernels' CPU references) and the streamed target. Each family names the HF file it follows.
//! The negative controls plant each family's likeliest bug in a copy of the checkpoint (window
//! off, sinks dropped, router bias ignored, partial rotary as full) and require the parity to
//! break, so the fixtures can tell.

use crate::support::families::{
    gate_on_both_engines, planted, reference, run, run_diff_and_probe, streamed_matches,
};
use crate::support::parity::worst_error;
use crate::support::{fixture, scratch};
use candle_core::{DType, Device, Tensor};
use eagle_check::compare::closeness;
use eagle_check::config::ModelConfig;
use eagle_check::model::{Capture, ComputePath};
use std::collections::HashMap;
use std::path::Path;

/// The f32 parity bound, with its reason: `eagle_check::tolerance::PARITY_F32`.
const F32_TOL: f64 = eagle_check::tolerance::PARITY_F32;

/// (fixture, the HF modeling file its numbers come from)
const FAMILIES: [(&str, &str); 13] = [
    ("qwen3_moe", "models/qwen3_moe/modeling_qwen3_moe.py"),
    ("qwen2_moe", "models/qwen2_moe/modeling_qwen2_moe.py"),
    ("minimax_m2", "models/minimax_m2/modeling_minimax_m2.py"),
    ("glm4_moe", "models/glm4_moe/modeling_glm4_moe.py"),
    ("glm4_moe_noqk", "models/glm4_moe/modeling_glm4_moe.py"),
    (
        "glm4_moe_lite",
        "models/glm4_moe_lite/modeling_glm4_moe_lite.py",
    ),
    ("gpt_oss", "models/gpt_oss/modeling_gpt_oss.py"),
    (
        "gpt_oss_mxfp4",
        "models/gpt_oss/modeling_gpt_oss.py + integrations/mxfp4.py",
    ),
    ("llama4", "models/llama4/modeling_llama4.py"),
    ("qwen3_5_moe", "models/qwen3_5_moe/modeling_qwen3_5_moe.py"),
    ("qwen3_next", "models/qwen3_next/modeling_qwen3_next.py"),
    (
        "qwen3_vl_moe",
        "models/qwen3_vl_moe/modeling_qwen3_vl_moe.py (Qwen3VLMoeTextModel)",
    ),
    (
        "gemma4_moe",
        "models/gemma4/modeling_gemma4.py (Gemma4ForCausalLM, enable_moe_block)",
    ),
];

/// Every MoE layer picks HF's experts for every token, with HF's weights.
fn check_routing(what: &str, cfg: &ModelConfig, cap: &Capture, r: &HashMap<String, Tensor>) {
    let moe = cfg.moe.as_ref().unwrap();
    let layers: Vec<usize> = (0..cfg.num_layers)
        .filter(|&l| moe.is_moe_layer(l))
        .collect();
    assert!(!layers.is_empty(), "{what}: no MoE layer");
    for l in layers {
        let key = format!("router.{l}.topk_idx");
        let got = cap.extras[&key].to_dtype(DType::I64).unwrap();
        let want = r[&key].to_vec2::<i64>().unwrap();
        assert_eq!(
            got.to_vec2::<i64>().unwrap(),
            want,
            "{what} layer {l} experts"
        );
        let key = format!("router.{l}.topk_weight");
        let w = closeness(&cap.extras[&key], &r[&key]).unwrap();
        assert!(
            w.max_rel <= F32_TOL,
            "{what} layer {l} weights {:.2e}",
            w.max_rel
        );
    }
}

#[test]
fn moe_families_match_transformers_on_both_paths() {
    for (name, hf) in FAMILIES {
        let dir = fixture(&format!("models/{name}"));
        let r = reference(name);
        for path in [ComputePath::Candle, ComputePath::Kernels] {
            let what = format!("{name} ({hf}, {path:?})");
            let (cfg, cap) = run(&dir, &r, path);
            let worst = worst_error(&what, &cfg, &cap, &r);
            eprintln!("{what}: worst rel err {worst:.3e}");
            assert!(worst <= F32_TOL, "{what}: worst rel err {worst:.3e}");
            check_routing(&what, &cfg, &cap, &r);
        }
    }
}

#[test]
fn moe_families_streamed_match_resident() {
    for (name, _) in FAMILIES {
        let worst = streamed_matches(name);
        eprintln!("{name} streamed: worst rel err {worst:.3e}");
    }
}

/// The resolved configs say what HF's config classes say.
#[test]
fn moe_family_configs_resolve_as_transformers_reads_them() {
    use eagle_check::config::{Arch, ExpertsAct, QkNorm};
    use eagle_check::routing::Scoring;
    let cfg = |name: &str| ModelConfig::load(&fixture(&format!("models/{name}"))).unwrap();
    let gpt = cfg("gpt_oss");
    assert_eq!(gpt.arch, Arch::GptOss);
    assert!(gpt.attn_sinks && gpt.o_bias && gpt.attention_bias);
    assert_eq!(gpt.window_of(0), gpt.sliding_window);
    assert_eq!(gpt.window_of(1), None);
    let moe = gpt.moe.as_ref().unwrap();
    assert_eq!(moe.routing.scoring, Scoring::Softmax);
    assert!(matches!(moe.act, ExpertsAct::ClampedSwiglu { alpha, .. } if alpha == 1.702f32));
    let mm = cfg("minimax_m2");
    assert_eq!(mm.qk_norm, QkNorm::Full);
    assert!(mm.rotary_dim < mm.head_dim);
    assert_eq!(mm.moe.as_ref().unwrap().routing.scoring, Scoring::Sigmoid);
    let glm = cfg("glm4_moe");
    assert_eq!(glm.rotary_dim * 2, glm.head_dim);
    assert_eq!(glm.qk_norm, QkNorm::PerHead);
    assert!(!glm.o_bias && glm.attention_bias);
    assert_eq!(cfg("glm4_moe_noqk").qk_norm, QkNorm::None);
    let q2 = cfg("qwen2_moe");
    let m2 = q2.moe.as_ref().unwrap();
    assert!(m2.shared_gate && m2.shared_intermediate > 0 && !m2.routing.norm_topk);
    let q3 = cfg("qwen3_moe");
    let m3 = q3.moe.as_ref().unwrap();
    assert!(
        (0..q3.num_layers).any(|l| !m3.is_moe_layer(l)),
        "mlp_only_layers"
    );
    assert_eq!(cfg("glm4_moe_lite").arch, Arch::Glm4MoeLite);
    // Qwen3-Next: the fused DeltaNet projections, layer 2 dense (`mlp_only_layers`),
    // `norm_topk_prob` as written (false; the class defaults it to true), a gated shared expert,
    // rope on a quarter of each head.
    let next = cfg("qwen3_next");
    assert_eq!(next.arch, Arch::Qwen3Next);
    let net = next.delta_net.as_ref().unwrap();
    assert!(net.grouped_projections);
    assert_eq!(net.linear_layers, [true, false, true, false]);
    let m = next.moe.as_ref().unwrap();
    let sparse: Vec<bool> = (0..4).map(|l| m.is_moe_layer(l)).collect();
    assert_eq!(sparse, [true, true, false, true]);
    assert!(!m.routing.norm_topk && m.shared_gate && m.shared_intermediate == 24);
    assert_eq!((next.rotary_dim, next.head_dim), (4, 16));
    // Qwen3-VL-MoE's tower: Qwen3-MoE's decoder, always renormalised, layer 2 dense, M-RoPE
    // as the default rope on text.
    let vl = cfg("qwen3_vl_moe");
    assert_eq!(
        (vl.arch, vl.model_type.as_str()),
        (Arch::Qwen3VlMoe, "qwen3_vl_moe_text")
    );
    assert_eq!(vl.qk_norm, QkNorm::PerHead);
    let m = vl.moe.as_ref().unwrap();
    assert!(m.routing.norm_topk && !m.shared_gate && m.shared_intermediate == 0);
    assert_eq!(
        (0..4).map(|l| m.is_moe_layer(l)).collect::<Vec<_>>(),
        [true, true, false, true]
    );
    assert_eq!(
        (vl.rope.theta, &vl.rope.scaling),
        (5e6, &eagle_check::config::RopeScaling::None)
    );
    // Gemma-4's MoE block: every layer, softmax top-k renormalised, GELU-tanh experts.
    let g4 = cfg("gemma4_moe");
    let m = g4.moe.as_ref().unwrap();
    assert_eq!((g4.arch, m.n_routed_experts, m.k()), (Arch::Gemma4, 8, 2));
    assert!(m.routing.norm_topk && m.shared_intermediate == 0);
    assert_eq!(m.act, ExpertsAct::GeluTanhMul);
    assert!((0..g4.num_layers).all(|l| m.is_moe_layer(l)));
}

fn worst_of(dir: &Path, name: &str) -> f64 {
    let r = reference(name);
    let (cfg, cap) = run(dir, &r, ComputePath::Candle);
    worst_error(&format!("{name} planted"), &cfg, &cap, &r)
}

#[test]
fn planted_family_bugs_break_the_parity() {
    // gpt-oss with every layer full attention: the sliding layers see too far back.
    let no_window = planted(
        "gpt_oss",
        "window",
        |c| {
            let n = c["num_hidden_layers"].as_u64().unwrap() as usize;
            c["layer_types"] = serde_json::json!(vec!["full_attention"; n]);
        },
        |_| {},
    );
    assert!(
        worst_of(&no_window, "gpt_oss") > 1e-2,
        "window off must fail"
    );
    // gpt-oss with its sinks at -inf: no logit joins the softmax (the sinks dropped).
    let no_sinks = planted(
        "gpt_oss",
        "sinks",
        |_| {},
        |w| {
            for (k, v) in w.iter_mut() {
                if k.ends_with("self_attn.sinks") {
                    *v = (v.ones_like().unwrap() * -1e30).unwrap();
                }
            }
        },
    );
    assert!(
        worst_of(&no_sinks, "gpt_oss") > 1e-2,
        "sinks dropped must fail"
    );
    // MiniMax-M2 with the correction bias zeroed: other experts are picked.
    let no_bias = planted(
        "minimax_m2",
        "bias",
        |_| {},
        |w| {
            for (k, v) in w.iter_mut() {
                if k.ends_with("e_score_correction_bias") {
                    *v = v.zeros_like().unwrap();
                }
            }
        },
    );
    assert!(
        worst_of(&no_bias, "minimax_m2") > 1e-3,
        "router bias ignored must fail"
    );
    // GLM-4.5 with rope over the whole head.
    let full_rope = planted(
        "glm4_moe",
        "rope",
        |c| {
            c["partial_rotary_factor"] = serde_json::json!(1.0);
            if let Some(p) = c.get_mut("rope_parameters").and_then(|p| p.as_object_mut()) {
                p.insert("partial_rotary_factor".into(), serde_json::json!(1.0));
            }
        },
        |_| {},
    );
    assert!(
        worst_of(&full_rope, "glm4_moe") > 1e-2,
        "full rotary must fail"
    );
    // Llama-4 (modeling_llama4.py): chunked attention off (every layer attends over every
    // earlier position), the NoPE layers' temperature off, and rope on the NoPE layers.
    let llama4 = |tag: &str, edit: &dyn Fn(&mut serde_json::Value)| {
        worst_of(&planted("llama4", tag, edit, |_| {}), "llama4")
    };
    let n = 4;
    let unchunked = llama4("chunks", &|c| {
        c["layer_types"] = serde_json::json!(vec!["full_attention"; n]);
    });
    assert!(
        unchunked > 1e-2,
        "chunked attention off must fail: {unchunked:.2e}"
    );
    let untempered = llama4("temperature", &|c| {
        c["attn_temperature_tuning"] = serde_json::json!(false);
    });
    assert!(
        untempered > 1e-3,
        "temperature off must fail: {untempered:.2e}"
    );
    let all_rope = llama4("nope", &|c| {
        c["no_rope_layers"] = serde_json::json!(vec![1; n]);
        c["layer_types"] = serde_json::json!(vec!["chunked_attention"; n]);
    });
    assert!(
        all_rope > 1e-2,
        "rope on the NoPE layers must fail: {all_rope:.2e}"
    );
    // Qwen3.5-MoE (modeling_qwen3_5_moe.py) with rope over the whole head.
    let full_rope = planted(
        "qwen3_5_moe",
        "rope",
        |c| {
            c["rope_parameters"]["partial_rotary_factor"] = serde_json::json!(1.0);
            c["partial_rotary_factor"] = serde_json::json!(1.0);
        },
        |_| {},
    );
    let worst = worst_of(&full_rope, "qwen3_5_moe");
    assert!(worst > 1e-2, "qwen3.5 full rotary must fail: {worst:.2e}");
    // Qwen3-Next (modeling_qwen3_next.py) with its fused rows laid out as Qwen3.5's flat
    // `[q | k | v | z]` and `[b | a]` over all heads: what a runner reading them flat would
    // need. The runner reads them grouped by key head, so the copy must not match.
    let flat = planted(
        "qwen3_next",
        "qkvz-flat",
        |_| {},
        |w| {
            let (nk, dk, dv, per) = (2, 8, 12, 2);
            let group = 2 * dk + 2 * per * dv;
            for (k, v) in w.iter_mut() {
                let (size, parts) = if k.ends_with("in_proj_qkvz.weight") {
                    (
                        group,
                        vec![
                            (0, dk),
                            (dk, dk),
                            (2 * dk, per * dv),
                            (2 * dk + per * dv, per * dv),
                        ],
                    )
                } else if k.ends_with("in_proj_ba.weight") {
                    (2 * per, vec![(0, per), (per, per)])
                } else {
                    continue;
                };
                // grouped rows -> every group's part 0, then part 1, ...
                let rows: Vec<Tensor> = parts
                    .iter()
                    .flat_map(|&(start, len)| (0..nk).map(move |g| (g * size + start, len)))
                    .map(|(start, len)| v.narrow(0, start, len).unwrap())
                    .collect();
                *v = Tensor::cat(&rows, 0).unwrap();
            }
        },
    );
    let worst = worst_of(&flat, "qwen3_next");
    assert!(
        worst > 1e-2,
        "qwen3-next qkvz read flat must fail: {worst:.2e}"
    );
    // Qwen3-VL-MoE (modeling_qwen3_vl_moe.py) with every expert's gate and up halves swapped.
    let swapped = planted(
        "qwen3_vl_moe",
        "gate-up",
        |_| {},
        |w| {
            for (k, v) in w.iter_mut() {
                if k.ends_with("experts.gate_up_proj") {
                    let i = v.dim(1).unwrap() / 2;
                    *v = Tensor::cat(&[v.narrow(1, i, i).unwrap(), v.narrow(1, 0, i).unwrap()], 1)
                        .unwrap();
                }
            }
        },
    );
    let worst = worst_of(&swapped, "qwen3_vl_moe");
    assert!(
        worst > 1e-2,
        "qwen3-vl-moe gate/up swapped must fail: {worst:.2e}"
    );
    // Gemma-4's MoE block (modeling_gemma4.py) without its `per_expert_scale`: every factor 1.
    let unscaled = planted(
        "gemma4_moe",
        "expert-scale",
        |_| {},
        |w| {
            for (k, v) in w.iter_mut() {
                if k.ends_with("router.per_expert_scale") {
                    *v = v.ones_like().unwrap();
                }
            }
        },
    );
    let worst = worst_of(&unscaled, "gemma4_moe");
    assert!(
        worst > 1e-2,
        "per_expert_scale ignored must fail: {worst:.2e}"
    );
}

/// Qwen3-VL-MoE's experts as the published checkpoints store them (`gate_up_proj` [E, H, 2I],
/// `down_proj` [E, I, H]: Qwen3-VL-30B-A3B-Instruct's model.safetensors; transformers 5's
/// conversion_mapping.py transposes them on load) load as transformers 5's own layout does, on
/// both paths.
#[test]
fn qwen3_vl_moe_experts_load_in_the_published_layout() {
    let published = planted(
        "qwen3_vl_moe",
        "published-experts",
        |_| {},
        |w| {
            for (k, v) in w.iter_mut() {
                if k.ends_with("experts.gate_up_proj") || k.ends_with("experts.down_proj") {
                    *v = v.transpose(1, 2).unwrap().contiguous().unwrap();
                }
            }
        },
    );
    let r = reference("qwen3_vl_moe");
    for path in [ComputePath::Candle, ComputePath::Kernels] {
        let what = format!("qwen3_vl_moe published layout ({path:?})");
        let (cfg, cap) = run(&published, &r, path);
        let worst = worst_error(&what, &cfg, &cap, &r);
        assert!(worst <= F32_TOL, "{what}: {worst:.3e}");
        check_routing(&what, &cfg, &cap, &r);
    }
}

/// (real target config under fixtures/real-configs/targets/, its shrunk copy under
/// fixtures/real-configs/shrunk/: the same keys and tensor names, 2 layers, small widths)
const REAL: [(&str, &str); 6] = [
    (
        "target_qwen3-30b-a3b__aiconfigurator_model_configs.json",
        "qwen3-30b-a3b",
    ),
    (
        "target_qwen3-235b-a22b__aiconfigurator_model_configs.json",
        "qwen3-235b-a22b",
    ),
    (
        "target_qwen3-coder-480b-a35b-instruct__aiconfigurator_model_configs.json",
        "qwen3-coder-480b-a35b-instruct",
    ),
    (
        "target_gpt-oss-20b__aiconfigurator_model_configs.json",
        "gpt-oss-20b",
    ),
    (
        "target_gpt-oss-120b__aiconfigurator_model_configs.json",
        "gpt-oss-120b",
    ),
    (
        "target_minimax-m2.5__aiconfigurator_model_configs.json",
        "minimax-m2.5",
    ),
];

/// The published configs resolve to the runner's settings as transformers reads them, and the
/// gate checks them (no `unsupported-architecture`, no exit 2) on sglang and vLLM.
#[test]
fn real_moe_configs_resolve_and_gate() {
    use eagle_check::config::{Arch, ExpertsAct, QkNorm};
    use eagle_check::routing::Scoring;
    let dir = scratch("moe-real-gate");
    for (file, _) in REAL {
        let path = fixture(&format!("real-configs/targets/{file}"));
        let cfg = ModelConfig::load(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
        let moe = cfg.moe.as_ref().unwrap();
        match cfg.arch {
            Arch::Qwen3Moe => {
                // 128 experts for the 30B and 235B, 160 for Coder-480B; 8 per token.
                assert!(matches!(moe.n_routed_experts, 128 | 160), "{file}");
                assert_eq!(moe.k(), 8, "{file}");
                assert!(moe.routing.norm_topk && cfg.qk_norm == QkNorm::PerHead);
            }
            Arch::GptOss => {
                assert_eq!(moe.k(), 4, "{file}: experts_per_token");
                assert_eq!(moe.routing.scoring, Scoring::Softmax);
                assert!(matches!(moe.act, ExpertsAct::ClampedSwiglu { limit, .. } if limit == 7.0));
                assert_eq!((cfg.window_of(0), cfg.window_of(1)), (Some(128), None));
                assert!(cfg.attn_sinks && cfg.o_bias);
            }
            Arch::MiniMaxM2 => {
                assert_eq!((cfg.rotary_dim, cfg.head_dim), (64, 128), "{file}");
                assert_eq!(cfg.qk_norm, QkNorm::Full);
                assert_eq!(moe.routing.scoring, Scoring::Sigmoid);
                assert_eq!(cfg.fp8_block, Some([128, 128]));
            }
            other => panic!("{file}: {other:?}"),
        }
        for (engine, out) in gate_on_both_engines(&dir, &cfg, &path) {
            assert_ne!(out.code, 2, "{file} on {engine}: {}", out.stdout);
            assert!(
                !out.finding_names()
                    .contains(&"unsupported-architecture".to_string()),
                "{file} on {engine}: {}",
                out.stdout
            );
        }
    }
}

/// The shrunk copies of the published configs (their tensor names, dtypes and quantisation:
/// bf16, gpt-oss's MXFP4 experts, MiniMax-M2.5's FP8 blocks, Qwen3-VL-30B-A3B's experts input
/// by output, Qwen3-Next's one module per expert beside its fused DeltaNet projections) load
/// and match transformers.
#[test]
fn shrunk_real_moe_checkpoints_load_and_match_transformers() {
    let families = [
        "shrunk-families/qwen3-vl-30b-a3b-instruct",
        "shrunk-families/qwen3-next-80b-a3b-instruct",
    ];
    let shrunk = REAL.iter().map(|(_, s)| format!("shrunk/{s}"));
    for shrunk in shrunk.chain(families.map(String::from)) {
        let dir = fixture(&format!("real-configs/{shrunk}"));
        let r = candle_core::safetensors::load(dir.join("reference.safetensors"), &Device::Cpu)
            .unwrap();
        for path in [ComputePath::Candle, ComputePath::Kernels] {
            let what = format!("shrunk {shrunk} ({path:?})");
            let (cfg, cap) = run(&dir, &r, path);
            let worst = worst_error(&what, &cfg, &cap, &r);
            eprintln!("{what}: worst rel err {worst:.3e}");
            assert!(worst <= F32_TOL, "{what}: {worst:.3e}");
            check_routing(&what, &cfg, &cap, &r);
        }
    }
}

/// `run`, `diff` and `probe` through the binary on every family's tiny checkpoint, with the
/// tiny EAGLE-3 draft of fixtures/models/qwen3-draft (hidden 64, vocab 256, ids [0, 1, 2]).
#[test]
fn run_diff_and_probe_work_on_every_moe_family() {
    run_diff_and_probe_on_every_family(&[]);
}

/// What [`run_diff_and_probe_work_on_every_moe_family`] checks, with `extra` arguments added to
/// every command (`tests/gpu.rs` passes `--device cuda`); each command's exit code, finding
/// names and (for probe) measured layouts, in order, for a comparison across devices.
pub(crate) fn run_diff_and_probe_on_every_family(
    extra: &[&str],
) -> Vec<(String, i32, Vec<String>)> {
    let dir = scratch(&format!("moe-cli{}", extra.join("")));
    FAMILIES
        .iter()
        .flat_map(|(name, hf)| run_diff_and_probe(&dir, name, hf, "sglang", extra))
        .collect()
}

/// Our MXFP4 dequantisation alone against transformers' own (`Mxfp4Config(dequantize=True)`,
/// integrations/mxfp4.py `convert_moe_packed_tensors`, on the fixture's layer 0): bit for bit,
/// in HF's `[E, H, 2I]` / `[E, I, H]` layout after the transpose the loader applies.
#[test]
fn mxfp4_experts_dequantise_as_transformers_does() {
    let dir = fixture("models/gpt_oss_mxfp4");
    let w = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let r = reference("gpt_oss_mxfp4");
    for (name, key) in [
        ("gate_up_proj", "experts.0.gate_up_proj"),
        ("down_proj", "experts.0.down_proj"),
    ] {
        let p = format!("model.layers.0.mlp.experts.{name}");
        let (blocks, scales) = (&w[&format!("{p}_blocks")], &w[&format!("{p}_scales")]);
        let got = eagle_check::kernels::mxfp4_dequant(blocks, scales, DType::F32)
            .and_then(|t| t.transpose(1, 2))
            .unwrap();
        assert_eq!(got.dims(), r[key].dims(), "{name}");
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (got, want) = (flat(&got), flat(&r[key]));
        let same = got
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{name}: our MXFP4 values differ from transformers'");
    }
}

/// Llama-4 Scout's published config (the `Llama4ForConditionalGeneration` wrapper, its text
/// model under `text_config`) resolves as `Llama4TextConfig.__post_init__` fills it in, and
/// gates on both engines.
#[test]
fn llama4_scout_config_resolves_and_gates() {
    let file = "target_llama-4-scout-17b-16e-instruct__aiconfigurator_model_configs.json";
    let path = fixture(&format!("real-configs/targets/{file}"));
    let dir = scratch("llama4-scout");
    let cfg_path = dir.join("config.json");
    std::fs::copy(&path, &cfg_path).unwrap();
    let cfg = ModelConfig::load(&cfg_path).unwrap();
    assert_eq!(cfg.arch, eagle_check::config::Arch::Llama4);
    assert_eq!(
        (cfg.num_layers, cfg.hidden_size, cfg.head_dim),
        (48, 5120, 128)
    );
    // Dense layers would be intermediate_size_mlp wide; Scout has none (interleave step 1).
    assert_eq!(cfg.intermediate_size, 16384);
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!(
        (moe.n_routed_experts, moe.k(), moe.moe_intermediate_size),
        (16, 1, 8192)
    );
    assert_eq!(moe.shared_intermediate, 8192);
    assert!(moe.weights_on_input && !moe.routing.norm_topk);
    assert!((0..48).all(|l| moe.is_moe_layer(l)));
    let l4 = cfg.llama4.as_ref().unwrap();
    let nope: Vec<usize> = (0..48).filter(|&l| !l4.rope_layers[l]).collect();
    assert_eq!(nope, (3..48).step_by(4).collect::<Vec<_>>());
    assert_eq!(l4.chunk, 8192);
    assert_eq!(l4.chunked_layers, l4.rope_layers);
    assert!(l4.l2_qk_norm);
    assert_eq!(l4.temperature, Some((0.1, 8192.0)));
    for (engine, out) in gate_on_both_engines(&dir, &cfg, &cfg_path) {
        assert_ne!(out.code, 2, "Scout on {engine}: {}", out.stdout);
    }
}

/// Qwen3.5-35B-A3B's published config (`Qwen3_5MoeForConditionalGeneration`, its text model
/// under `text_config`) resolves as `Qwen3_5MoeTextConfig` reads it, and gates on both engines.
#[test]
fn qwen35_moe_config_resolves_and_gates() {
    let file = "target_qwen3.5-35b-a3b__aiconfigurator_model_configs.json";
    let dir = scratch("qwen35-real");
    let cfg_path = dir.join("config.json");
    std::fs::copy(fixture(&format!("real-configs/targets/{file}")), &cfg_path).unwrap();
    let cfg = ModelConfig::load(&cfg_path).unwrap();
    assert_eq!(cfg.arch, eagle_check::config::Arch::Qwen35Moe);
    assert_eq!(
        (cfg.num_layers, cfg.hidden_size, cfg.head_dim),
        (40, 2048, 256)
    );
    assert_eq!(cfg.rotary_dim, 64, "partial_rotary_factor 0.25 of 256");
    let net = cfg.delta_net.as_ref().unwrap();
    let full: Vec<usize> = (0..40).filter(|&l| !net.linear_layers[l]).collect();
    assert_eq!(full, (3..40).step_by(4).collect::<Vec<_>>());
    assert_eq!(
        (
            net.key_heads,
            net.value_heads,
            net.key_dim,
            net.value_dim,
            net.conv_kernel
        ),
        (16, 32, 128, 128, 4)
    );
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!(
        (moe.n_routed_experts, moe.k(), moe.moe_intermediate_size),
        (256, 8, 512)
    );
    assert!(moe.shared_gate && moe.shared_intermediate == 512 && moe.routing.norm_topk);
    for (engine, out) in gate_on_both_engines(&dir, &cfg, &cfg_path) {
        assert_ne!(out.code, 2, "Qwen3.5 on {engine}: {}", out.stdout);
    }
}

/// Qwen3-VL-30B-A3B-Instruct's published config (`Qwen3VLMoeForConditionalGeneration`, a
/// transformers 4 file: `rope_scaling` M-RoPE and `rope_theta` beside it) and a Qwen3-Next-80B-A3B
/// config put together from cited sources (fixtures/real-configs/targets/README.md) resolve as
/// `Qwen3VLMoeTextConfig` and `Qwen3NextConfig` read them, and gate on both engines.
#[test]
fn qwen3_vl_moe_and_qwen3_next_configs_resolve_and_gate() {
    use eagle_check::config::Arch;
    let dir = scratch("qwen3-vl-next-real");
    for file in [
        "target_qwen3-vl-30b-a3b-instruct__published_config.json",
        "target_qwen3-next-80b-a3b-instruct__RECONSTRUCTED_from_cited_sources.json",
    ] {
        let path = fixture(&format!("real-configs/targets/{file}"));
        let cfg = ModelConfig::load(&path).unwrap_or_else(|e| panic!("{file}: {e}"));
        let moe = cfg.moe.as_ref().unwrap();
        match cfg.arch {
            Arch::Qwen3VlMoe => {
                assert_eq!(
                    (
                        cfg.num_layers,
                        cfg.hidden_size,
                        cfg.head_dim,
                        cfg.num_kv_heads
                    ),
                    (48, 2048, 128, 4)
                );
                assert_eq!(
                    (moe.n_routed_experts, moe.k(), moe.moe_intermediate_size),
                    (128, 8, 768)
                );
                assert!(moe.routing.norm_topk && (0..48).all(|l| moe.is_moe_layer(l)));
                assert_eq!(cfg.rope.theta, 5e6);
                assert!(!cfg.tie_word_embeddings);
            }
            Arch::Qwen3Next => {
                assert_eq!(
                    (
                        cfg.num_layers,
                        cfg.hidden_size,
                        cfg.head_dim,
                        cfg.num_kv_heads
                    ),
                    (48, 2048, 256, 2)
                );
                assert_eq!(cfg.rotary_dim, 64, "partial_rotary_factor 0.25 by default");
                let net = cfg.delta_net.as_ref().unwrap();
                assert!(net.grouped_projections);
                let full: Vec<usize> = (0..48).filter(|&l| !net.linear_layers[l]).collect();
                assert_eq!(full, (3..48).step_by(4).collect::<Vec<_>>());
                assert_eq!((net.key_heads, net.value_heads, net.key_dim), (16, 32, 128));
                assert_eq!(
                    (moe.n_routed_experts, moe.k(), moe.moe_intermediate_size),
                    (512, 10, 512)
                );
                assert!(moe.shared_gate && moe.shared_intermediate == 512 && moe.routing.norm_topk);
            }
            other => panic!("{file}: {other:?}"),
        }
        for (engine, out) in gate_on_both_engines(&dir, &cfg, &path) {
            assert_ne!(out.code, 2, "{file} on {engine}: {}", out.stdout);
        }
    }
}
