//! DeepSeek-V3 / Kimi-K2 runner parity with HF transformers (MLA, YaRN, group-limited MoE) and
//! FP8 block dequantisation against DeepSeek's `weight_dequant`, on the fixtures made by
//! fixtures/gen_models.py and fixtures/fp8/gen_fp8.py.

use crate::support::fixture;
use crate::support::parity::{ids, reference, worst_error};
use candle_core::{DType, Device, Tensor};
use eagle_check::compare::closeness;
use eagle_check::config::ModelConfig;
use eagle_check::model::deepseek::softmax_scale;
use eagle_check::model::fp8;
use eagle_check::model::nn::inv_freq;
use eagle_check::model::source::{SafetensorsSource, Vb, WeightSource};
use eagle_check::model::{Capture, CaptureRequest, ComputePath, Progress, load_target_on};
use eagle_check::routing::route_token;
use std::collections::HashMap;

/// The f32 parity bound, with its reason: `eagle_check::tolerance::PARITY_F32`.
const F32_TOL: f64 = eagle_check::tolerance::PARITY_F32;

const FIXTURES: [&str; 2] = ["deepseek_v3", "deepseek_v3_noq"];

fn rows_i64(t: &Tensor) -> Vec<Vec<i64>> {
    t.to_dtype(DType::I64).unwrap().to_vec2::<i64>().unwrap()
}

/// Runs a model directory on the reference tokens in f32.
fn run(dir: &std::path::Path, r: &HashMap<String, Tensor>) -> (ModelConfig, Capture) {
    run_on(dir, r, ComputePath::Candle)
}

fn run_on(
    dir: &std::path::Path,
    r: &HashMap<String, Tensor>,
    path: ComputePath,
) -> (ModelConfig, Capture) {
    let cfg = ModelConfig::load(dir).unwrap();
    let src = SafetensorsSource::open(dir).unwrap();
    let model = load_target_on(&cfg, &src, DType::F32, &Device::Cpu, path).unwrap();
    let cap = model
        .forward(&ids(r), &CaptureRequest::all(), &mut Progress::hidden())
        .unwrap();
    (cfg, cap)
}

fn moe_layers(cfg: &ModelConfig) -> Vec<usize> {
    let moe = cfg.moe.as_ref().unwrap();
    (0..cfg.num_layers)
        .filter(|&l| moe.is_moe_layer(l))
        .collect()
}

#[test]
fn deepseek_v3_boundaries_match_transformers() {
    for name in FIXTURES {
        let dir = fixture(&format!("models/{name}"));
        let r = reference(&format!("models/{name}/reference.safetensors"));
        let (cfg, cap) = run(&dir, &r);
        let worst = worst_error(name, &cfg, &cap, &r);
        eprintln!("{name}: worst rel err {worst:.2e}");
        assert!(worst <= F32_TOL, "{name} worst rel err {worst:.3e}");
    }
}

/// The q path differs between the fixtures: low-rank (q_a_proj, q_a_layernorm, q_b_proj) and plain.
#[test]
fn q_lora_rank_selects_the_query_path() {
    let low = ModelConfig::load(&fixture("models/deepseek_v3")).unwrap();
    let plain = ModelConfig::load(&fixture("models/deepseek_v3_noq")).unwrap();
    assert_eq!(low.mla.as_ref().unwrap().q_lora_rank, Some(32));
    assert_eq!(plain.mla.as_ref().unwrap().q_lora_rank, None);
    // transformers writes head_dim = qk_rope_head_dim for deepseek; MLA must not use it.
    assert_eq!(low.head_dim, 8);
}

/// YaRN inverse frequencies, the cos/sin attention factor and the MLA softmax scale, against
/// what transformers computed for the fixture (`rope.inv_freq`, `rope.attention_scaling`,
/// `attn.softmax_scale`).
#[test]
fn yarn_rope_and_softmax_scale_match_transformers() {
    for name in FIXTURES {
        let cfg = ModelConfig::load(&fixture(&format!("models/{name}"))).unwrap();
        let r = reference(&format!("models/{name}/reference.safetensors"));
        let mla = cfg.mla.as_ref().unwrap();
        let (freqs, attn_factor) = inv_freq(&cfg.rope, mla.qk_rope_head_dim);
        let want = r["rope.inv_freq"].to_vec1::<f32>().unwrap();
        let got: Vec<f32> = freqs.iter().map(|&f| f as f32).collect();
        eprintln!("{name} inv_freq got {got:?} want {want:?}");
        assert_eq!(got, want, "{name} inv_freq");
        let want_af = r["rope.attention_scaling"].to_vec1::<f32>().unwrap()[0];
        assert_eq!(attn_factor as f32, want_af, "{name} attention_scaling");
        let want_scale = r["attn.softmax_scale"].to_vec1::<f32>().unwrap()[0] as f64;
        let scale = softmax_scale(&cfg, mla);
        eprintln!("{name} softmax scale got {scale} want {want_scale}");
        assert!((scale - want_scale).abs() < 1e-7, "{name} softmax scale");
        // mscale^2 is really applied: the plain 24^-0.5 would be off by ~30 %.
        assert!((scale - 24f64.powf(-0.5)).abs() > 0.05);
    }
}

/// The experts the model picks are HF's for every token of every MoE layer, with HF's weights,
/// and the fixture is one where plain top-k (no `n_group` / `topk_group` limit) picks otherwise:
/// a router that ignores the group limit fails here.
/// The GPU's code path on the CPU (kernel references): MLA through flash attention over
/// per-head keys, routing / dispatch / combine kernels, experts on sorted rows.
#[test]
fn kernel_path_matches_transformers_and_routes_alike() {
    for name in FIXTURES {
        let dir = fixture(&format!("models/{name}"));
        let r = reference(&format!("models/{name}/reference.safetensors"));
        let (cfg, cap) = run_on(&dir, &r, ComputePath::Kernels);
        let worst = worst_error(name, &cfg, &cap, &r);
        assert!(
            worst <= F32_TOL,
            "{name} (kernel path) worst rel err {worst:.3e}"
        );
        check_routing(name, &cfg, &cap, &r);
    }
}

#[test]
fn routing_is_group_limited_like_transformers() {
    for name in FIXTURES {
        let dir = fixture(&format!("models/{name}"));
        let r = reference(&format!("models/{name}/reference.safetensors"));
        let (cfg, cap) = run(&dir, &r);
        check_routing(name, &cfg, &cap, &r);
    }
}

fn check_routing(name: &str, cfg: &ModelConfig, cap: &Capture, r: &HashMap<String, Tensor>) {
    for l in moe_layers(cfg) {
        let want = rows_i64(&r[&format!("router.{l}.topk_idx")]);
        let plain = rows_i64(&r[&format!("router.{l}.ungrouped_topk_idx")]);
        let got = rows_i64(&cap.extras[&format!("router.{l}.topk_idx")]);
        let differs = want.iter().zip(&plain).filter(|(a, b)| a != b).count();
        eprintln!(
            "{name} layer {l}: grouped != plain top-k at {differs} of {} tokens",
            want.len()
        );
        assert!(differs > 0, "{name} layer {l}: the fixture cannot tell");
        assert_eq!(got, want, "{name} layer {l}: chosen experts");
        let w = closeness(
            &cap.extras[&format!("router.{l}.topk_weight")],
            &r[&format!("router.{l}.topk_weight")],
        )
        .unwrap();
        eprintln!("{name} layer {l}: topk_weight max rel {:.2e}", w.max_rel);
        assert!(w.max_rel <= F32_TOL, "{name} layer {l} weights");
    }
}

/// `route_token` alone, fed HF's own router logits: exactly HF's choice (and not plain top-k).
#[test]
fn route_token_reproduces_the_reference_from_router_logits() {
    for name in FIXTURES {
        let dir = fixture(&format!("models/{name}"));
        let cfg = ModelConfig::load(&dir).unwrap();
        let moe = cfg.moe.clone().unwrap();
        let src = SafetensorsSource::open(&dir).unwrap();
        let r = reference(&format!("models/{name}/reference.safetensors"));
        for l in moe_layers(&cfg) {
            let bias = src
                .load(
                    &format!("model.layers.{l}.mlp.gate.e_score_correction_bias"),
                    &Device::Cpu,
                )
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let logits = r[&format!("router.{l}.logits")].to_vec2::<f32>().unwrap();
            let want = rows_i64(&r[&format!("router.{l}.topk_idx")]);
            for (tok, row) in logits.iter().enumerate() {
                let scores: Vec<f32> = row.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect();
                let got = route_token(&scores, &bias, &moe.routing);
                let got: Vec<i64> = got.experts.iter().map(|&e| e as i64).collect();
                assert_eq!(got, want[tok], "{name} layer {l} token {tok}");
            }
        }
    }
}

/// transformers 5 keeps experts fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`
/// [E, H, I]); a checkpoint in that layout must run to the same numbers.
#[test]
fn fused_expert_layout_matches_per_expert_layout() {
    let name = "deepseek_v3";
    let dir = fixture(&format!("models/{name}"));
    let r = reference(&format!("models/{name}/reference.safetensors"));
    let cfg = ModelConfig::load(&dir).unwrap();
    let moe = cfg.moe.clone().unwrap();
    let weights =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut fused: HashMap<String, Tensor> = HashMap::new();
    for (k, v) in &weights {
        if !k.contains(".mlp.experts.") {
            fused.insert(k.clone(), v.clone());
        }
    }
    for l in moe_layers(&cfg) {
        let p = format!("model.layers.{l}.mlp.experts");
        let w = |e: usize, part: &str| weights[&format!("{p}.{e}.{part}.weight")].clone();
        let gate_up: Vec<Tensor> = (0..moe.n_routed_experts)
            .map(|e| Tensor::cat(&[&w(e, "gate_proj"), &w(e, "up_proj")], 0).unwrap())
            .collect();
        let down: Vec<Tensor> = (0..moe.n_routed_experts)
            .map(|e| w(e, "down_proj"))
            .collect();
        fused.insert(
            format!("{p}.gate_up_proj"),
            Tensor::stack(&gate_up, 0).unwrap(),
        );
        fused.insert(format!("{p}.down_proj"), Tensor::stack(&down, 0).unwrap());
    }
    let tmp = std::env::temp_dir().join(format!("ec-ds-fused-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::copy(dir.join("config.json"), tmp.join("config.json")).unwrap();
    candle_core::safetensors::save(&fused, tmp.join("model.safetensors")).unwrap();
    let (cfg, cap) = run(&tmp, &r);
    let worst = worst_error("deepseek_v3 (fused experts)", &cfg, &cap, &r);
    std::fs::remove_dir_all(&tmp).unwrap();
    assert!(worst <= F32_TOL, "fused layout worst rel err {worst:.3e}");
}

// ---------------------------------------------------------------------------------------------
// FP8 block dequantisation (fixtures/fp8/gen_fp8.py)

/// Exact: an F8E4M3 value times an f32 scale is one f32 rounding in both PyTorch and here.
fn assert_same(got: &Tensor, want: &Tensor, label: &str) {
    let c = closeness(got, want).unwrap();
    eprintln!(
        "{label}: max abs {:.2e}, max rel {:.2e}",
        c.max_abs, c.max_rel
    );
    assert_eq!(c.max_abs, 0.0, "{label}");
}

#[test]
fn fp8_blocks_dequantise_like_deepseek_weight_dequant() {
    let path = fixture("fp8/fp8_blocks.safetensors");
    let src = SafetensorsSource::open(&path).unwrap();
    let r = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    // (name, shape): partial edge blocks on both axes, a tensor within one block, exact tiling.
    for (name, shape) in [
        ("edge", [300usize, 200usize]),
        ("small", [64, 48]),
        ("exact", [256, 64]),
    ] {
        let w = &r[&format!("{name}.weight")];
        assert_eq!(w.dtype(), DType::F8E4M3, "{name} is stored as F8_E4M3");
        let want = &r[&format!("{name}.reference")];
        // Directly.
        let direct = fp8::dequantize_blocks(w, &r[&format!("{name}.weight_scale_inv")]).unwrap();
        assert_same(&direct, want, &format!("{name} dequantize_blocks"));
        let explicit =
            fp8::dequantize_blocks_with(w, &r[&format!("{name}.weight_scale_inv")], [128, 128])
                .unwrap();
        assert_same(&explicit, want, &format!("{name} dequantize_blocks_with"));
        // Through the loader, as a model weight is read.
        let vb = Vb::new(&src, DType::F32, &Device::Cpu).pp(name);
        let loaded = vb.get("weight", &shape).unwrap();
        assert_same(&loaded, want, &format!("{name} Vb::get"));
        // The quantisation is real: fp8 alone (scale ignored) is far from the reference.
        let unscaled = w.to_dtype(DType::F32).unwrap();
        assert!(closeness(&unscaled, want).unwrap().max_rel > 0.1);
    }
}

/// 300 rows in 3 blocks are also tiled by blocks of 100; only 128 is DeepSeek's. Inferring the
/// block from `ceil(rows / scale_rows)` (100) scales rows 100..127 and 200..255 wrongly.
#[test]
fn fp8_block_size_is_not_inferred_from_the_scale_grid() {
    let path = fixture("fp8/fp8_blocks.safetensors");
    let r = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let w = &r["edge.weight"];
    let s = &r["edge.weight_scale_inv"];
    let want = &r["edge.reference"];
    let wrong = fp8::dequantize_blocks_with(w, s, [100, 100]).unwrap();
    assert!(closeness(&wrong, want).unwrap().max_abs > 0.0);
    // A grid no 128 block fits and several sizes could: refused, not guessed.
    let w = Tensor::zeros((256, 64), DType::F32, &Device::Cpu).unwrap();
    let s = Tensor::ones((4, 1), DType::F32, &Device::Cpu).unwrap();
    let err = fp8::dequantize_blocks(&w, &s).unwrap_err().to_string();
    assert!(err.contains("ambiguous"), "{err}");
    // A grid that does not tile at all.
    let s = Tensor::ones((3, 1), DType::F32, &Device::Cpu).unwrap();
    assert!(fp8::dequantize_blocks_with(&w, &s, [128, 128]).is_err());
}

/// Layer 1 of the deepseek_v3 fixture stored as a real FP8 checkpoint stores it (F8_E4M3
/// weights + `weight_scale_inv`, `quantization_config` in config.json) runs through the loader's
/// dequantisation to transformers' output on the dequantised weights.
#[test]
fn fp8_quantised_layer_runs_like_transformers_on_the_dequantised_weights() {
    let dir = fixture("models/deepseek_v3");
    let mut tensors =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let quant = candle_core::safetensors::load(
        fixture("fp8/deepseek_v3_layer1_fp8.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let fp8_weights = quant
        .values()
        .filter(|t| t.dtype() == DType::F8E4M3)
        .count();
    assert_eq!(fp8_weights, 32);
    tensors.extend(quant);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    config["quantization_config"] = serde_json::json!({
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]
    });
    let tmp = std::env::temp_dir().join(format!("ec-ds-fp8-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::write(tmp.join("config.json"), config.to_string()).unwrap();
    candle_core::safetensors::save(&tensors, tmp.join("model.safetensors")).unwrap();
    let r = candle_core::safetensors::load(
        fixture("fp8/deepseek_v3_layer1_fp8_reference.safetensors"),
        &Device::Cpu,
    )
    .unwrap();
    let (cfg, cap) = run(&tmp, &r);
    std::fs::remove_dir_all(&tmp).unwrap();
    assert_eq!(cfg.fp8_block, Some([128, 128]));
    let worst = worst_error("deepseek_v3 (layer 1 fp8)", &cfg, &cap, &r);
    assert!(worst <= F32_TOL, "fp8 layer worst rel err {worst:.3e}");
    for l in moe_layers(&cfg) {
        let key = format!("router.{l}.topk_idx");
        assert_eq!(rows_i64(&cap.extras[&key]), rows_i64(&r[&key]), "{key}");
    }
}
