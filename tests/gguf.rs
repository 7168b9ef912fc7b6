//! GGUF targets and tokenizers.
//!
//! - The tiny fixture targets (llama with llama3 rope, qwen2 with q/k/v bias and tied
//!   embeddings, qwen3 with q/k norm) are written to GGUF the way llama.cpp's
//!   `convert_hf_to_gguf.py` writes them (names, reversed dims, llama's Q/K row permutation,
//!   `rope_freqs.weight`), read back with `open_gguf`, and must reproduce the transformers
//!   references of the original checkpoints.
//! - Hostile files are refused with errors naming the file.
//! - SmolLM2-135M-Instruct Q4_1, a real llama.cpp file (`fixtures/smollm2/fetch.sh`), is
//!   compared with transformers' own GGUF loader (`fixtures/smollm2/reference.safetensors`).

use crate::support::{fixture, root, scratch};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use eagle_check::commands::run::greedy_continuation;
use eagle_check::compare::closeness;
use eagle_check::config::{ModelConfig, Rope, RopeScaling};
use eagle_check::model::gguf::{GgufSource, open_gguf};
use eagle_check::model::source::WeightSource;
use eagle_check::model::stream::StreamOptions;
use eagle_check::model::{CaptureRequest, Progress, Target, load_streamed, load_target};
use eagle_check::tokenize::{Tokenizer, read_token_file};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// f32 weights in, f32 compute: the GGUF round trip must be as exact as the safetensors path
/// (runner.rs holds that to 1e-4; the only new rounding is eps and rope theta stored as f32,
/// and the llama3 rope divisors stored as f32, ~1e-7 relative).
const F32_TOL: f64 = 1e-5;

// ---------------------------------------------------------------------------------------------
// Writing GGUF files the way convert_hf_to_gguf.py does.

/// A GGUF file in the making: metadata and tensors in GGUF naming, HF-ordered shapes.
struct Parts {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Tensor)>,
}

impl Parts {
    fn set(&mut self, key: &str, v: Value) {
        self.metadata.retain(|(k, _)| k != key);
        self.metadata.push((key.to_string(), v));
    }

    fn remove(&mut self, key: &str) {
        self.metadata.retain(|(k, _)| k != key);
        self.tensors.retain(|(k, _)| k != key);
    }

    fn write(&self, path: &Path) {
        self.write_as(path, GgmlDType::F32);
    }

    /// Matrices quantised to `matrices` (vectors stay f32, as llama.cpp keeps norms).
    fn write_as(&self, path: &Path, matrices: GgmlDType) {
        let q: Vec<(String, QTensor)> = self
            .tensors
            .iter()
            .map(|(n, t)| {
                let dtype = if t.rank() == 2 {
                    matrices
                } else {
                    GgmlDType::F32
                };
                (n.clone(), QTensor::quantize(t, dtype).unwrap())
            })
            .collect();
        let md: Vec<(&str, &Value)> = self.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let ts: Vec<(&str, &QTensor)> = q.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let mut f = std::fs::File::create(path).unwrap();
        gguf_file::write(&mut f, &md, &ts).unwrap();
    }
}

/// HF name -> GGUF name (llama.cpp `gguf-py/gguf/tensor_mapping.py`).
fn gguf_name(hf: &str) -> String {
    match hf {
        "model.embed_tokens.weight" => return "token_embd.weight".into(),
        "model.norm.weight" => return "output_norm.weight".into(),
        "lm_head.weight" => return "output.weight".into(),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.").unwrap();
    let (i, rest) = rest.split_once('.').unwrap();
    let g = match rest {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        "mlp.gate.weight" => "ffn_gate_inp.weight",
        "mlp.experts.gate_proj" => "ffn_gate_exps.weight",
        "mlp.experts.up_proj" => "ffn_up_exps.weight",
        "mlp.experts.down_proj" => "ffn_down_exps.weight",
        other => panic!("no GGUF name for {other}"),
    };
    format!("blk.{i}.{g}")
}

/// `LlamaModel.permute` of convert_hf_to_gguf.py:
/// `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`.
fn llama_cpp_permute(w: &Tensor, n_head: usize) -> Tensor {
    let dims = w.dims().to_vec();
    let rest: usize = dims[1..].iter().product();
    w.reshape((n_head, 2, dims[0] / n_head / 2, rest))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape(dims)
        .unwrap()
}

/// A fixture checkpoint as convert_hf_to_gguf.py would write it (f32, unquantised).
/// `permute`: apply llama.cpp's Q/K permutation for llama (false plants the bug of a converter
/// that forgot it).
fn convert(name: &str, permute: bool) -> (ModelConfig, Parts) {
    let dir = fixture(&format!("models/{name}"));
    let cfg = ModelConfig::load(&dir).unwrap();
    // llama.cpp's architecture names (gguf-py/gguf/constants.py MODEL_ARCH_NAMES).
    let arch = match cfg.model_type.as_str() {
        "qwen3_moe" => "qwen3moe".to_string(),
        other => other.to_string(),
    };
    let u = |x: usize| Value::U32(x as u32);
    let mut metadata = vec![
        (
            "general.architecture".to_string(),
            Value::String(arch.clone()),
        ),
        ("general.alignment".to_string(), Value::U32(32)),
    ];
    let a = |k: &str| format!("{arch}.{k}");
    metadata.extend([
        (a("block_count"), u(cfg.num_layers)),
        (a("context_length"), u(256)),
        (a("embedding_length"), u(cfg.hidden_size)),
        (a("feed_forward_length"), u(cfg.intermediate_size)),
        (a("attention.head_count"), u(cfg.num_heads)),
        (a("attention.head_count_kv"), u(cfg.num_kv_heads)),
        (a("attention.key_length"), u(cfg.head_dim)),
        (a("attention.value_length"), u(cfg.head_dim)),
        (a("rope.dimension_count"), u(cfg.head_dim)),
        (a("rope.freq_base"), Value::F32(cfg.rope.theta as f32)),
        (
            a("attention.layer_norm_rms_epsilon"),
            Value::F32(cfg.rms_norm_eps as f32),
        ),
        (a("vocab_size"), u(cfg.vocab_size)),
    ]);
    if let Some(moe) = &cfg.moe {
        metadata.extend([
            (a("expert_count"), u(moe.n_routed_experts)),
            (a("expert_used_count"), u(moe.k())),
            (
                a("expert_feed_forward_length"),
                u(moe.moe_intermediate_size),
            ),
        ]);
    }
    let weights =
        candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let mut tensors = Vec::new();
    // Qwen3MoeModel.modify_tensors: each layer's experts stacked per projection, [E, rows, cols].
    if let Some(moe) = &cfg.moe {
        for l in (0..cfg.num_layers).filter(|&l| moe.is_moe_layer(l)) {
            for part in ["gate_proj", "up_proj", "down_proj"] {
                let per: Vec<Tensor> = (0..moe.n_routed_experts)
                    .map(|e| {
                        weights[&format!("model.layers.{l}.mlp.experts.{e}.{part}.weight")].clone()
                    })
                    .collect();
                let name = gguf_name(&format!("model.layers.{l}.mlp.experts.{part}"));
                tensors.push((name, Tensor::stack(&per, 0).unwrap()));
            }
        }
    }
    for hf in names.into_iter().filter(|n| !n.contains(".mlp.experts.")) {
        let mut t = weights[hf].clone();
        if arch == "llama" && permute {
            if hf.contains("q_proj") {
                t = llama_cpp_permute(&t, cfg.num_heads);
            } else if hf.contains("k_proj") {
                t = llama_cpp_permute(&t, cfg.num_kv_heads);
            }
        }
        tensors.push((gguf_name(hf), t));
    }
    // LlamaModel.generate_extra_tensors: llama3 rope scaling as per-frequency divisors.
    if let RopeScaling::Llama3 {
        factor,
        low_freq_factor: low,
        high_freq_factor: high,
        original_max_position_embeddings: orig,
    } = cfg.rope.scaling
    {
        let dim = cfg.head_dim;
        let factors: Vec<f32> = (0..dim / 2)
            .map(|i| {
                let freq = 1.0 / cfg.rope.theta.powf((2 * i) as f64 / dim as f64);
                let wl = 2.0 * std::f64::consts::PI / freq;
                let f = if wl < orig / high {
                    1.0
                } else if wl > orig / low {
                    factor
                } else {
                    let s = (orig / wl - low) / (high - low);
                    1.0 / ((1.0 - s) / factor + s)
                };
                f as f32
            })
            .collect();
        let n = factors.len();
        tensors.push((
            "rope_freqs.weight".into(),
            Tensor::from_vec(factors, n, &Device::Cpu).unwrap(),
        ));
    }
    (cfg, Parts { metadata, tensors })
}

fn write_converted(name: &str, permute: bool) -> (ModelConfig, PathBuf) {
    let (cfg, parts) = convert(name, permute);
    let dir = scratch(&format!("gguf-{name}-{permute}"));
    let path = dir.join(format!("{name}.gguf"));
    parts.write(&path);
    (cfg, path)
}

/// A fixture checkpoint converted to GGUF with its matrices quantised to Q8_0 (blocks of 32
/// along each row, as llama.cpp's `--outtype q8_0` writes them), in a scratch folder of the
/// test module `user` (tests running at once never write each other's files).
pub(crate) fn write_q8_0(name: &str, user: &str) -> PathBuf {
    let (_, parts) = convert(name, true);
    let dir = scratch(&format!("{user}-gguf-q8_0-{name}"));
    let path = dir.join(format!("{name}.q8_0.gguf"));
    parts.write_as(&path, GgmlDType::Q8_0);
    path
}

/// Worst relative error over every boundary, the pre-norm state and the logits, against
/// fixture `name`'s transformers reference.
fn parity(name: &str, cfg: &ModelConfig, src: &GgufSource) -> f64 {
    parity_with(
        name,
        &format!("models/{name}/reference.safetensors"),
        cfg,
        src,
    )
}

/// [`parity`] against the reference at `reference` (under fixtures/).
fn parity_with(name: &str, reference: &str, cfg: &ModelConfig, src: &GgufSource) -> f64 {
    let model = load_target(cfg, src, DType::F32, &Device::Cpu).unwrap();
    let r = candle_core::safetensors::load(fixture(reference), &Device::Cpu).unwrap();
    let ids: Vec<u32> = r["input_ids"]
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect();
    let cap = model
        .forward(&ids, &CaptureRequest::all(), &mut Progress::hidden())
        .unwrap();
    let mut worst = 0f64;
    for b in 0..=cfg.num_layers {
        let c = closeness(&cap.hidden[&b], &r[&format!("hidden_states.{b}")]).unwrap();
        assert_eq!(c.non_finite, 0);
        worst = worst.max(c.max_rel);
    }
    for (got, key) in [
        (&cap.final_pre_norm, "final_pre_norm"),
        (&cap.logits, "logits"),
    ] {
        worst = worst.max(closeness(got.as_ref().unwrap(), &r[key]).unwrap().max_rel);
    }
    eprintln!("{name} (GGUF): worst rel err {worst:.2e}");
    worst
}

/// The GGUF-resolved config equals the config.json-resolved one, up to f32 storage.
fn assert_same_config(gguf: &ModelConfig, hf: &ModelConfig) {
    assert_eq!(gguf.arch, hf.arch);
    assert_eq!(
        (gguf.hidden_size, gguf.num_layers, gguf.vocab_size),
        (hf.hidden_size, hf.num_layers, hf.vocab_size)
    );
    assert_eq!(
        (gguf.num_heads, gguf.num_kv_heads, gguf.head_dim),
        (hf.num_heads, hf.num_kv_heads, hf.head_dim)
    );
    assert_eq!(gguf.intermediate_size, hf.intermediate_size);
    assert_eq!(gguf.tie_word_embeddings, hf.tie_word_embeddings);
    assert_eq!(gguf.attention_bias, hf.attention_bias);
    assert_eq!(gguf.qk_norm, hf.qk_norm);
    assert_eq!(gguf.rope, hf.rope);
    assert!((gguf.rms_norm_eps - hf.rms_norm_eps).abs() <= 1e-7 * hf.rms_norm_eps.max(1e-6) * 10.0);
}

fn converted_parity(name: &str) {
    let (hf_cfg, path) = write_converted(name, true);
    let (cfg, src) = open_gguf(&path).unwrap();
    assert_same_config(&cfg, &hf_cfg);
    assert_eq!(cfg.path, path);
    let worst = parity(name, &cfg, &src);
    assert!(worst <= F32_TOL, "{name}: worst rel err {worst:.3e}");
}

#[test]
fn llama_gguf_with_permuted_qk_and_rope_freqs_matches_transformers() {
    converted_parity("llama");
}

#[test]
fn qwen2_gguf_with_bias_and_tied_embeddings_matches_transformers() {
    let (_, path) = write_converted("qwen2", true);
    let (cfg, src) = open_gguf(&path).unwrap();
    assert!(cfg.tie_word_embeddings && cfg.attention_bias);
    assert!(src.shape("lm_head.weight").is_none());
    assert_eq!(
        src.gguf_name("model.layers.1.self_attn.k_proj.bias"),
        Some("blk.1.attn_k.bias")
    );
    converted_parity("qwen2");
}

#[test]
fn qwen3_gguf_with_qk_norm_matches_transformers() {
    converted_parity("qwen3");
}

/// qwen3moe (Qwen3-30B-A3B's llama.cpp architecture): stacked experts, the router, a dense
/// block (no `ffn_gate_inp`), renormalised top-k, in f32 and with Q8_0 matrices.
#[test]
fn qwen3moe_gguf_matches_transformers() {
    converted_parity("qwen3_moe");
    let (_, path) = write_converted("qwen3_moe", true);
    let (cfg, src) = open_gguf(&path).unwrap();
    let moe = cfg.moe.as_ref().unwrap();
    assert!(moe.routing.norm_topk);
    assert!(
        !moe.is_moe_layer(1) && moe.is_moe_layer(0),
        "{:?}",
        moe.layers
    );
    assert_eq!(
        src.gguf_name("model.layers.0.mlp.experts.gate_proj"),
        Some("blk.0.ffn_gate_exps.weight")
    );
}

/// Guards the Q/K un-permutation: a llama file whose rows were never permuted is read as if
/// they had been, and the outputs move far from the reference. (Planting the bug the other way,
/// dropping `unpermute_rows` in gguf.rs, fails `llama_gguf_with_permuted_qk_...` the same way.)
#[test]
fn llama_gguf_qk_rows_are_unpermuted() {
    let (_, path) = write_converted("llama", false);
    let (cfg, src) = open_gguf(&path).unwrap();
    let worst = parity("llama", &cfg, &src);
    assert!(worst > 1e-2, "unpermuted rows went unnoticed: {worst:.3e}");
}

#[test]
fn gguf_shapes_are_in_hf_order() {
    let (cfg, path) = write_converted("qwen3", true);
    let (_, src) = open_gguf(&path).unwrap();
    let (h, hd) = (cfg.hidden_size, cfg.head_dim);
    assert_eq!(
        src.shape("model.layers.0.self_attn.q_proj.weight"),
        Some(vec![cfg.num_heads * hd, h])
    );
    assert_eq!(
        src.shape("model.layers.0.mlp.down_proj.weight"),
        Some(vec![h, cfg.intermediate_size])
    );
    assert_eq!(
        src.shape("model.embed_tokens.weight"),
        Some(vec![cfg.vocab_size, h])
    );
    assert_eq!(src.arch(), "qwen3");
}

// ---------------------------------------------------------------------------------------------
// Hostile and unsupported files.

fn open_err(parts: &Parts, tag: &str) -> String {
    let dir = scratch(&format!("gguf-evil-{tag}"));
    let path = dir.join("evil.gguf");
    parts.write(&path);
    open_err_at(&path)
}

fn open_err_at(path: &Path) -> String {
    let err = match open_gguf(path) {
        Ok((cfg, src)) => match load_target(&cfg, &src, DType::F32, &Device::Cpu) {
            Ok(_) => panic!("{} was accepted", path.display()),
            Err(e) => e.to_string(),
        },
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(&path.display().to_string()),
        "error does not name the file: {err}"
    );
    err
}

#[test]
fn gguf_missing_or_mistyped_metadata_is_refused() {
    let (_, mut parts) = convert("qwen2", true);
    parts.remove("qwen2.block_count");
    let e = open_err(&parts, "no-blocks");
    assert!(e.contains("`qwen2.block_count` is missing"), "{e}");

    let (_, mut parts) = convert("qwen2", true);
    parts.set("qwen2.attention.head_count", Value::String("4".into()));
    let e = open_err(&parts, "string-heads");
    assert!(e.contains("qwen2.attention.head_count"), "{e}");

    let (_, mut parts) = convert("qwen2", true);
    parts.set("qwen2.attention.head_count", Value::I32(-4));
    let e = open_err(&parts, "negative-heads");
    assert!(e.contains("not a non-negative integer"), "{e}");

    let (_, mut parts) = convert("qwen2", true);
    parts.set("general.architecture", Value::String("gpt2".into()));
    let e = open_err(&parts, "arch");
    assert!(e.contains("architecture `gpt2` is not supported"), "{e}");

    let (_, mut parts) = convert("qwen2", true);
    parts.set("qwen2.rope.scaling.type", Value::String("longrope".into()));
    let e = open_err(&parts, "rope");
    assert!(e.contains("`longrope` is not supported"), "{e}");

    let (_, mut parts) = convert("qwen2", true);
    parts.set("qwen2.rope.dimension_count", Value::U32(8));
    let e = open_err(&parts, "partial-rope");
    assert!(e.contains("partial rotary"), "{e}");
}

#[test]
fn gguf_unknown_missing_or_misshapen_tensors_are_refused() {
    let (_, mut parts) = convert("qwen2", true);
    let t = parts.tensors[0].1.clone();
    parts
        .tensors
        .push(("blk.0.ffn_gate_exps.weight".into(), t.clone()));
    let e = open_err(&parts, "moe-tensor");
    assert!(
        e.contains("`blk.0.ffn_gate_exps.weight` has no HF counterpart"),
        "{e}"
    );

    // A layer past block_count is unknown too.
    let (_, mut parts) = convert("qwen2", true);
    parts.tensors.push(("blk.4.attn_norm.weight".into(), t));
    let e = open_err(&parts, "extra-layer");
    assert!(e.contains("blk.4.attn_norm.weight"), "{e}");

    let (_, mut parts) = convert("qwen2", true);
    parts.remove("blk.2.ffn_up.weight");
    let e = open_err(&parts, "missing");
    assert!(
        e.contains("model.layers.2.mlp.up_proj.weight is missing"),
        "{e}"
    );

    let (_, mut parts) = convert("qwen2", true);
    for (n, t) in parts.tensors.iter_mut() {
        if n == "blk.1.attn_v.weight" {
            *t = Tensor::zeros((16, 64), DType::F32, &Device::Cpu).unwrap();
        }
    }
    let e = open_err(&parts, "shape");
    assert!(
        e.contains(
            "model.layers.1.self_attn.v_proj.weight: expected shape [32, 64], found [16, 64]"
        ),
        "{e}"
    );

    let (_, mut parts) = convert("qwen2", true);
    parts.set("qwen2.embedding_length", Value::U32(32));
    let e = open_err(&parts, "embd");
    assert!(e.contains("token_embd.weight` has shape [256, 64]"), "{e}");

    let (_, mut parts) = convert("qwen2", true);
    parts.remove("token_embd.weight");
    let e = open_err(&parts, "no-embd");
    assert!(e.contains("token_embd.weight` is missing"), "{e}");
}

/// Byte-level damage: truncation, sizes that overflow, offsets past the end, alignment 0 (which
/// makes candle's header reader divide by zero), garbage. None may panic.
#[test]
fn gguf_corrupt_bytes_are_refused_without_panicking() {
    let (_, parts) = convert("qwen2", true);
    let dir = scratch("gguf-evil-bytes");
    let good = dir.join("good.gguf");
    parts.write(&good);
    let bytes = std::fs::read(&good).unwrap();

    let truncated = dir.join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    let e = open_err_at(&truncated);
    assert!(e.contains("past the end of the file"), "{e}");

    let header_only = dir.join("header.gguf");
    std::fs::write(&header_only, &bytes[..2000]).unwrap();
    open_err_at(&header_only);

    let tiny = dir.join("tiny.gguf");
    std::fs::write(&tiny, b"GGUF").unwrap();
    let e = open_err_at(&tiny);
    assert!(e.contains("too short"), "{e}");

    let garbage = dir.join("garbage.gguf");
    std::fs::write(&garbage, vec![0x5au8; 4096]).unwrap();
    let e = open_err_at(&garbage);
    assert!(e.contains("not a readable GGUF file"), "{e}");

    // token_embd.weight's dims (stored innermost first as u64) patched to 2^40 x 2^40.
    let name = b"token_embd.weight";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    assert_eq!(&bytes[at..at + 4], &2u32.to_le_bytes());
    let mut huge = bytes.clone();
    huge[at + 4..at + 12].copy_from_slice(&(1u64 << 40).to_le_bytes());
    huge[at + 12..at + 20].copy_from_slice(&(1u64 << 40).to_le_bytes());
    let huge_path = dir.join("huge.gguf");
    std::fs::write(&huge_path, &huge).unwrap();
    let e = open_err_at(&huge_path);
    assert!(
        e.contains("token_embd.weight") && e.contains("overflows"),
        "{e}"
    );

    // Same tensor, plausible dims, offset (the u64 after the dtype) far past the end.
    let mut far = bytes.clone();
    far[at + 24..at + 32].copy_from_slice(&(1u64 << 50).to_le_bytes());
    let far_path = dir.join("far.gguf");
    std::fs::write(&far_path, &far).unwrap();
    let e = open_err_at(&far_path);
    assert!(e.contains("past the end of the file"), "{e}");

    let mut parts = parts;
    parts.set("general.alignment", Value::U32(0));
    let e = open_err(&parts, "alignment0");
    assert!(e.contains("not a readable GGUF file"), "{e}");
    let path = root().join("target/test-scratch/gguf-evil-alignment0/evil.gguf");
    let e = Tokenizer::open(&path).unwrap_err().to_string();
    assert!(e.contains("not a readable GGUF file"), "{e}");
}

#[test]
fn gguf_rope_freqs_that_are_not_llama3_are_refused() {
    let (_, mut parts) = convert("llama", true);
    for (n, t) in parts.tensors.iter_mut() {
        if n == "rope_freqs.weight" {
            *t = Tensor::new(&[1f32, 2.0, 1.0, 3.0, 1.0, 5.0, 1.0, 8.0], &Device::Cpu).unwrap();
        }
    }
    let e = open_err(&parts, "rope-freqs");
    assert!(e.contains("does not match Llama 3 rope scaling"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Tokenizers and token files.

#[test]
fn gguf_sentencepiece_tokenizers_are_refused_clearly() {
    let mut md = HashMap::new();
    md.insert(
        "tokenizer.ggml.model".to_string(),
        Value::String("llama".into()),
    );
    let e = Tokenizer::from_gguf_metadata(&md, Path::new("m.gguf")).unwrap_err();
    assert!(
        e.to_string()
            .contains("m.gguf: GGUF tokenizer.ggml.model `llama` is not supported"),
        "{e}"
    );
    md.insert(
        "tokenizer.ggml.model".to_string(),
        Value::String("gpt2".into()),
    );
    let e = Tokenizer::from_gguf_metadata(&md, Path::new("m.gguf")).unwrap_err();
    assert!(
        e.to_string().contains("tokenizer.ggml.tokens` is missing"),
        "{e}"
    );
}

/// A tiny byte-level BPE in GGUF metadata: merges apply in rank order, the pre-tokenizer keeps
/// spaces attached to the following word, control tokens are matched whole, BOS is added only
/// when `add_bos_token` says so.
#[test]
fn gguf_gpt2_tokenizer_from_metadata() {
    let tokens = ["<s>", "a", "b", "Ġ", "ab", "Ġab", "1", "2", "12"];
    let mut md = HashMap::new();
    let s = |x: &str| Value::String(x.into());
    md.insert("tokenizer.ggml.model".to_string(), s("gpt2"));
    md.insert("tokenizer.ggml.pre".to_string(), s("smollm"));
    md.insert(
        "tokenizer.ggml.tokens".to_string(),
        Value::Array(tokens.iter().map(|t| s(t)).collect()),
    );
    md.insert(
        "tokenizer.ggml.merges".to_string(),
        Value::Array(vec![s("a b"), s("Ġ ab"), s("1 2")]),
    );
    md.insert(
        "tokenizer.ggml.token_type".to_string(),
        Value::Array([3, 1, 1, 1, 1, 1, 1, 1, 1].map(Value::I32).to_vec()),
    );
    md.insert("tokenizer.ggml.bos_token_id".to_string(), Value::U32(0));
    let path = Path::new("tiny.gguf");
    let tok = Tokenizer::from_gguf_metadata(&md, path).unwrap();
    assert_eq!(tok.encode("ab ab").unwrap(), vec![4, 5]);
    assert_eq!(tok.encode("<s>ab").unwrap(), vec![0, 4]);
    // smollm splits digits one by one before BPE, so the "1 2" merge never applies.
    assert_eq!(tok.encode("12").unwrap(), vec![6, 7]);
    assert_eq!(tok.decode(&[4, 5]).unwrap(), "ab ab");
    assert!(tok.decode(&[9]).is_err());
    md.insert(
        "tokenizer.ggml.add_bos_token".to_string(),
        Value::Bool(true),
    );
    let tok = Tokenizer::from_gguf_metadata(&md, path).unwrap();
    assert_eq!(tok.encode("ab").unwrap(), vec![0, 4]);
    assert_eq!(tok.encode_plain("ab").unwrap(), vec![4]);

    md.insert("tokenizer.ggml.pre".to_string(), s("gpt2"));
    let tok = Tokenizer::from_gguf_metadata(&md, path).unwrap();
    assert_eq!(
        tok.encode("12").unwrap(),
        vec![0, 8],
        "gpt2 keeps digit runs whole"
    );
    md.insert("tokenizer.ggml.pre".to_string(), s("falcon"));
    let e = Tokenizer::from_gguf_metadata(&md, path).unwrap_err();
    assert!(e.to_string().contains("`falcon` is not supported"), "{e}");
    md.insert("tokenizer.ggml.pre".to_string(), s("gpt2"));
    md.insert(
        "tokenizer.ggml.merges".to_string(),
        Value::Array(vec![s("a b c")]),
    );
    let e = Tokenizer::from_gguf_metadata(&md, path).unwrap_err();
    assert!(e.to_string().contains("merges[0]"), "{e}");
}

/// An HF `tokenizer.json` (byte-level BPE, Llama-3-style template that adds BOS): `encode`
/// follows the file's post-processor, `encode_plain` adds nothing.
#[test]
fn tokenizer_json_follows_its_post_processor() {
    let json = serde_json::json!({
        "version": "1.0",
        "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                          "use_regex": true},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": {"<s>": 0, "a": 1, "b": 2, "Ġ": 3, "ab": 4, "Ġab": 5},
                  "merges": ["a b", "Ġ ab"]}
    });
    let dir = scratch("tokenizer-json");
    std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
    let tok = Tokenizer::open(&dir).unwrap();
    assert_eq!(tok.encode("ab ab").unwrap(), vec![0, 4, 5]);
    assert_eq!(tok.encode_plain("ab ab").unwrap(), vec![4, 5]);
    assert_eq!(tok.decode(&[4, 5]).unwrap(), "ab ab");
    std::fs::write(dir.join("tokenizer.json"), "{").unwrap();
    let e = Tokenizer::open(&dir).unwrap_err().to_string();
    assert!(
        e.contains("tokenizer.json: not a usable tokenizer.json"),
        "{e}"
    );
}

/// An `.npy` (format 1.0) as `numpy.save` writes it: header padded to a multiple of 64.
fn npy(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

#[test]
fn token_files_read_as_text_or_npy() {
    let dir = scratch("token-files");
    let txt = dir.join("ids.txt");
    std::fs::write(&txt, "504\n 3575\n\n282\n").unwrap();
    assert_eq!(read_token_file(&txt).unwrap(), vec![504, 3575, 282]);
    let bad = dir.join("bad.txt");
    std::fs::write(&bad, "504\n-1\n").unwrap();
    let e = read_token_file(&bad).unwrap_err().to_string();
    assert!(e.contains("bad.txt: line 2: `-1` is not a token id"), "{e}");

    let write = |name: &str, bytes: &[u8]| {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let le = |xs: &[i64], size: usize| -> Vec<u8> {
        xs.iter()
            .flat_map(|x| x.to_le_bytes()[..size].to_vec())
            .collect()
    };
    let ids = [504i64, 3575, 282];
    for (descr, size) in [("<i8", 8), ("<i4", 4), ("<i2", 2)] {
        let path = write("ids.npy", &npy(descr, "(3,)", &le(&ids, size)));
        assert_eq!(
            read_token_file(&path).unwrap(),
            vec![504, 3575, 282],
            "{descr}"
        );
    }
    let refused = [
        (
            "negative",
            npy("<i4", "(2,)", &le(&[1, -1], 4)),
            "element 1 = -1",
        ),
        (
            "too-big",
            npy("<i8", "(1,)", &le(&[1 << 40], 8)),
            "element 0 = 1099511627776",
        ),
        ("float", npy("<f4", "(1,)", &[0; 4]), "not an integer type"),
        ("2d", npy("<i4", "(1, 2)", &le(&[1, 2], 4)), "not 1-D"),
        ("empty", npy("<i4", "(0,)", &[]), "empty"),
        ("lying", npy("<i8", "(4,)", &le(&ids, 8)), "declares"),
        (
            "huge",
            npy("<i8", "(4611686018427387904,)", &[]),
            "overflow",
        ),
    ];
    for (name, bytes, want) in refused {
        let path = write(&format!("{name}.npy"), &bytes);
        let e = read_token_file(&path).unwrap_err().to_string();
        assert!(e.starts_with(&path.display().to_string()), "{name}: {e}");
        assert!(e.contains(want), "{name}: {e}");
    }
}

// ---------------------------------------------------------------------------------------------
// SmolLM2-135M-Instruct Q4_1: a real llama.cpp file.

const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// `EAGLE_CHECK_SMOLLM2`, else target/models/. The tests that need it are `#[ignore]`d, so a
/// plain `cargo test` counts them as ignored in its summary; `-- --include-ignored` (the
/// README's and CI's command, after fixtures/smollm2/fetch.sh) runs them, and a missing file
/// then fails them.
fn smollm2() -> PathBuf {
    let path = std::env::var_os("EAGLE_CHECK_SMOLLM2")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/models").join(SMOLLM2_FILE));
    assert!(
        path.is_file(),
        "{} not found: run `bash fixtures/smollm2/fetch.sh` (or set EAGLE_CHECK_SMOLLM2)",
        path.display()
    );
    path
}

fn smollm2_reference() -> (HashMap<String, Tensor>, HashMap<String, String>) {
    let path = fixture("smollm2/reference.safetensors");
    let tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let md = st.1.metadata().clone().unwrap_or_default();
    (tensors, md.into_iter().collect())
}

fn ids_of(t: &Tensor) -> Vec<u32> {
    t.to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect()
}

fn load_smollm2(path: &Path) -> (ModelConfig, GgufSource, Box<dyn Target>) {
    let (cfg, src) = open_gguf(path).unwrap();
    let model = load_target(&cfg, &src, DType::F32, &Device::Cpu).unwrap();
    (cfg, src, model)
}

#[test]
#[ignore = "needs the SmolLM2 GGUF: bash fixtures/smollm2/fetch.sh"]
fn smollm2_config_comes_from_gguf_metadata() {
    let path = smollm2();
    let (cfg, src) = open_gguf(&path).unwrap();
    assert_eq!(src.arch(), "llama");
    assert_eq!(
        (
            cfg.num_layers,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.vocab_size
        ),
        (30, 576, 1536, 49152)
    );
    assert_eq!((cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), (9, 3, 64));
    assert_eq!(cfg.rope.theta, 100000.0);
    assert_eq!(cfg.rope.scaling, RopeScaling::None);
    assert!(cfg.tie_word_embeddings && !cfg.attention_bias);
    assert_eq!(cfg.rms_norm_eps, 1e-5f32 as f64);
    assert_eq!(src.names().count(), 272, "30 layers x 9 + embedding + norm");
}

#[test]
#[ignore = "needs the SmolLM2 GGUF: bash fixtures/smollm2/fetch.sh"]
fn smollm2_tokenizer_matches_transformers() {
    let path = smollm2();
    let (r, md) = smollm2_reference();
    let tok = Tokenizer::open(&path).unwrap();
    let texts: Vec<String> = serde_json::from_str(&md["tokenizer_texts"]).unwrap();
    for (k, text) in texts.iter().enumerate() {
        let got = tok.encode(text).unwrap();
        assert_eq!(got, ids_of(&r[&format!("tokenizer.{k}.ids")]), "{text:?}");
        assert_eq!(&tok.decode(&got).unwrap(), text);
    }
    assert_eq!(
        tok.encode(&md["parity_text"]).unwrap(),
        ids_of(&r["input_ids"])
    );
}

#[test]
#[ignore = "needs the SmolLM2 GGUF: bash fixtures/smollm2/fetch.sh"]
fn smollm2_greedy_continuation_is_sensible_text() {
    let path = smollm2();
    let (r, md) = smollm2_reference();
    let (_, src, model) = load_smollm2(&path);
    let tok = Tokenizer::from_gguf_metadata(src.metadata(), &path).unwrap();
    let prompt = &md["prompt"];
    let mut ids = tok.encode(prompt).unwrap();
    assert_eq!(ids, ids_of(&r["greedy.prompt_ids"]));
    let want = ids_of(&r["greedy.ids"]);
    ids.extend(greedy_continuation(model.as_ref(), &ids, want.len()).unwrap());
    let prompt_len = r["greedy.prompt_ids"].dim(0).unwrap();
    let text = tok.decode(&ids).unwrap();
    eprintln!("SmolLM2 greedy: {text:?}");
    assert!(
        tok.decode(&ids[prompt_len..]).unwrap().contains("Paris"),
        "{text:?}"
    );
    // Every greedy step had a top-1/top-2 margin >= 0.2 in the reference (see
    // `greedy.margins`), far above the ~1e-4 logit differences, so the tokens must agree.
    assert_eq!(
        &ids[prompt_len..],
        want.as_slice(),
        "vs transformers: {:?}",
        md["greedy_text"]
    );
}

/// The README's real-model check through the binary: a GGUF target, --prompt through its own
/// tokenizer, and a greedy continuation that makes sense.
#[test]
#[ignore = "needs the SmolLM2 GGUF: bash fixtures/smollm2/fetch.sh"]
fn smollm2_runs_from_the_command_line_with_a_prompt() {
    let path = smollm2();
    let out = crate::support::eagle_check([
        "run",
        "--target",
        &crate::support::p(&path),
        "--engine",
        "sglang",
        "--prompt",
        "The capital of France is",
        "--generate",
        "8",
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let json = out.json();
    let text = json["subject"]["greedy_continuation"].as_str().unwrap();
    assert!(text.contains("Paris"), "{text}");
    assert_eq!(json["subject"]["fed_b"], "[2, 15, 27]");
}

#[test]
#[ignore = "needs the SmolLM2 GGUF: bash fixtures/smollm2/fetch.sh"]
fn smollm2_boundaries_match_transformers() {
    let path = smollm2();
    let (r, md) = smollm2_reference();
    let (cfg, _, model) = load_smollm2(&path);
    let ids = ids_of(&r["input_ids"]);
    let boundaries: Vec<usize> = serde_json::from_str(&md["boundaries"]).unwrap();
    let cap = model
        .forward(&ids, &CaptureRequest::all(), &mut Progress::hidden())
        .unwrap();
    assert_eq!(cap.hidden.len(), cfg.num_layers + 1);
    let mut worst = 0f64;
    let mut report = |what: &str, got: &Tensor, want: &Tensor| {
        let c = closeness(got, want).unwrap();
        assert_eq!(c.non_finite, 0, "{what}");
        eprintln!(
            "SmolLM2 {what}: max rel {:.2e} (max abs {:.2e} at {}: {} vs {})",
            c.max_rel, c.max_abs, c.worst_index, c.worst_got, c.worst_ref
        );
        worst = worst.max(c.max_rel);
    };
    for b in boundaries {
        report(
            &format!("b={b}"),
            &cap.hidden[&b],
            &r[&format!("hidden_states.{b}")],
        );
    }
    report(
        "final_pre_norm",
        cap.final_pre_norm.as_ref().unwrap(),
        &r["final_pre_norm"],
    );
    let logits = cap.logits.unwrap();
    let t = ids.len();
    report(
        "logits.last",
        &logits.get(t - 1).unwrap(),
        &r["logits.last"],
    );
    let top_ids = r["logits.topk_ids"].to_dtype(DType::U32).unwrap();
    let top = logits.gather(&top_ids, 1).unwrap();
    report("logits.topk_values", &top, &r["logits.topk_values"]);
    let argmax = logits.argmax(1).unwrap().to_vec1::<u32>().unwrap();
    let ref_argmax: Vec<u32> = top_ids
        .narrow(1, 0, 1)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(argmax, ref_argmax, "top-1 token at every position");
    // Both sides dequantise the same Q4_1/Q8_0 blocks to the same f32 weights; what is left is
    // f32 summation order over 30 layers (measured ~1e-5, see fixtures/smollm2/README.md).
    const TOL: f64 = 1e-4;
    assert!(worst <= TOL, "SmolLM2 worst rel err {worst:.3e}");
}

/// llama.cpp's pre-tokenizers (src/llama-vocab.cpp), chunk by chunk on a string that touches
/// every alternative of their regexes: case-insensitive contractions, a letter run with its
/// leading space, digits (qwen2 one at a time, llama-bpe in runs of up to three, gpt2 whole),
/// punctuation carrying its newlines, and whitespace before a word. The expected chunks were
/// worked out by hand from the regexes.
#[test]
fn gguf_pre_tokenizers_cut_like_llama_cpp() {
    let text = "Hello  world's 12345!!\n\nDON'T YOU'LLAMA";
    let s = |x: &str| Value::String(x.into());
    let tokens = ["a", "b"];
    let chunks = |pre: &str| -> Vec<String> {
        let mut md = HashMap::new();
        md.insert("tokenizer.ggml.model".to_string(), s("gpt2"));
        md.insert("tokenizer.ggml.pre".to_string(), s(pre));
        md.insert(
            "tokenizer.ggml.tokens".to_string(),
            Value::Array(tokens.iter().map(|t| s(t)).collect()),
        );
        md.insert("tokenizer.ggml.merges".to_string(), Value::Array(vec![]));
        Tokenizer::from_gguf_metadata(&md, Path::new("pre.gguf"))
            .unwrap()
            .pre_tokenize(text)
            .unwrap()
    };
    let words = |w: &[&str]| -> Vec<String> { w.iter().map(|x| x.to_string()).collect() };
    assert_eq!(
        chunks("qwen2"),
        words(&[
            "Hello", "Ġ", "Ġworld", "'s", "Ġ", "1", "2", "3", "4", "5", "!!ĊĊ", "DON", "'T",
            "ĠYOU", "'LL", "AMA"
        ])
    );
    assert_eq!(
        chunks("llama-bpe"),
        words(&[
            "Hello", "Ġ", "Ġworld", "'s", "Ġ", "123", "45", "!!ĊĊ", "DON", "'T", "ĠYOU", "'LL",
            "AMA"
        ])
    );
    // GPT-2's contractions are case-sensitive and it keeps digit runs and newlines apart.
    assert_eq!(
        chunks("gpt2"),
        words(&[
            "Hello", "Ġ", "Ġworld", "'s", "Ġ12345", "!!", "Ċ", "Ċ", "DON", "'", "T", "ĠYOU", "'",
            "LLAMA"
        ])
    );
}

/// gpt-oss as llama.cpp's converter writes it (`fixtures/gen_gpt_oss_gguf.py`: the MXFP4
/// experts as ggml type 39, split into gate and up, with their biases; sinks, the biased
/// router, the yarn metadata), against transformers' forward of the safetensors checkpoint it
/// was converted from.
#[test]
fn gpt_oss_mxfp4_gguf_matches_transformers() {
    let path = fixture("gguf/gpt_oss_mxfp4.gguf");
    let (cfg, src) = open_gguf(&path).unwrap();
    let hf = ModelConfig::load(&fixture("models/gpt_oss_mxfp4")).unwrap();
    assert_same_config(&cfg, &hf);
    assert_eq!(cfg.sliding_window, hf.sliding_window);
    assert_eq!(cfg.sliding_layers, hf.sliding_layers);
    assert_eq!(cfg.attn_sinks, hf.attn_sinks);
    assert_eq!(cfg.moe, hf.moe);
    assert_eq!(
        src.gguf_name("model.layers.2.mlp.experts.up_proj"),
        Some("blk.2.ffn_up_exps.weight")
    );
    assert_eq!(
        src.shape("model.layers.0.mlp.experts.down_proj"),
        Some(vec![8, 64, 32])
    );
    let worst = parity("gpt_oss_mxfp4", &cfg, &src);
    assert!(worst <= F32_TOL, "gpt-oss GGUF: worst rel err {worst:.3e}");
    // And through the binary: `run` on the .gguf alone.
    let out = crate::support::eagle_check([
        "run",
        "--target",
        &crate::support::p(&path),
        "--engine",
        "sglang",
        "--tokens",
        "3,1,4,1,5,9,2,6",
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let target = out.json()["subject"]["target"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(target.starts_with("gpt_oss"), "{target}");
}

// ---------------------------------------------------------------------------------------------
// Gemma-3, Llama-4 and Phi-3 as llama.cpp's converter writes them
// (fixtures/gen_gguf_families.py), against the transformers reference of the HF fixture each was
// converted from.

/// (file stem under fixtures/gguf/, the HF fixture it was converted from).
pub(crate) const FAMILIES: &[(&str, &str)] = &[
    ("gemma3", "gemma3_gguf"),
    ("llama4", "llama4_gguf"),
    ("phi3", "phi3"),
];

fn family_file(stem: &str, q8_0: bool) -> PathBuf {
    fixture(&format!(
        "gguf/{stem}{}.gguf",
        if q8_0 { ".q8_0" } else { "" }
    ))
}

/// Equal, up to the f32 the GGUF stores numbers in (LongRoPE's factors and attention factor).
fn assert_same_rope(gguf: &Rope, hf: &Rope) {
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
    assert!(close(gguf.theta, hf.theta), "{gguf:?} vs {hf:?}");
    match (&gguf.scaling, &hf.scaling) {
        (
            RopeScaling::LongRope {
                short_factor: s1,
                long_factor: l1,
                original_max_position_embeddings: o1,
                attention_factor: a1,
            },
            RopeScaling::LongRope {
                short_factor: s2,
                long_factor: l2,
                original_max_position_embeddings: o2,
                attention_factor: a2,
            },
        ) => {
            let same = |x: &[f64], y: &[f64]| {
                x.len() == y.len() && x.iter().zip(y).all(|(a, b)| close(*a, *b))
            };
            assert!(same(s1, s2) && same(l1, l2), "{gguf:?} vs {hf:?}");
            assert!(o1 == o2 && close(*a1, *a2), "{gguf:?} vs {hf:?}");
        }
        (a, b) => assert_eq!(a, b),
    }
}

/// What the GGUF's metadata and llama.cpp's fixed settings resolve to is the checkpoint's config.
fn assert_family_config(gguf: &ModelConfig, hf: &ModelConfig) {
    assert_eq!(gguf.arch, hf.arch);
    assert_eq!(
        (gguf.hidden_size, gguf.num_layers, gguf.vocab_size),
        (hf.hidden_size, hf.num_layers, hf.vocab_size)
    );
    assert_eq!(
        (
            gguf.num_heads,
            gguf.num_kv_heads,
            gguf.head_dim,
            gguf.rotary_dim
        ),
        (hf.num_heads, hf.num_kv_heads, hf.head_dim, hf.rotary_dim)
    );
    assert_eq!(gguf.intermediate_size, hf.intermediate_size);
    assert_eq!(
        (gguf.tie_word_embeddings, gguf.attention_bias, gguf.qk_norm),
        (hf.tie_word_embeddings, hf.attention_bias, hf.qk_norm)
    );
    assert_eq!(
        (gguf.sliding_window, &gguf.sliding_layers),
        (hf.sliding_window, &hf.sliding_layers)
    );
    assert_eq!(gguf.gemma, hf.gemma);
    assert_eq!(gguf.llama4, hf.llama4);
    assert_eq!(gguf.moe, hf.moe);
    assert_same_rope(&gguf.rope, &hf.rope);
    assert!((gguf.rms_norm_eps - hf.rms_norm_eps).abs() <= 1e-6 * hf.rms_norm_eps);
}

/// One family: the f32 file resident and streamed, the Q8_0 file, and `run --dump` through the
/// binary, each against the HF fixture's transformers reference.
fn family_matches(stem: &str, hf: &str) -> GgufSource {
    let hf_cfg = ModelConfig::load(&fixture(&format!("models/{hf}"))).unwrap();
    let path = family_file(stem, false);
    let (cfg, src) = open_gguf(&path).unwrap();
    assert_family_config(&cfg, &hf_cfg);
    let worst = parity(hf, &cfg, &src);
    assert!(worst <= F32_TOL, "{stem}: worst rel err {worst:.3e}");

    let streamed = load_streamed(
        &cfg,
        Box::new(open_gguf(&path).unwrap().1),
        DType::F32,
        &Device::Cpu,
        StreamOptions::default(),
    )
    .unwrap();
    let r = crate::support::families::reference(hf);
    let cap = streamed
        .forward(
            &ids_of(&r["input_ids"]),
            &CaptureRequest::all(),
            &mut Progress::hidden(),
        )
        .unwrap();
    let worst = crate::support::parity::worst_error(&format!("{stem} streamed"), &cfg, &cap, &r);
    assert!(worst <= F32_TOL, "{stem} streamed: {worst:.3e}");
    assert_eq!(
        streamed.stream_stats().unwrap().layers_loaded,
        cfg.num_layers
    );

    // The Q8_0 file against transformers run on the weights its blocks decode to (gguf-py's
    // decoder; fixtures/gen_gguf_families.py): both sides hold the same f32 weights, so this is
    // f32 parity, F32_TOL. What Q8_0 itself costs, against the f32 reference, is only reported:
    // a quantised router may pick another expert (Llama-4's top-1), which is the quantised
    // model's right answer, not a loader's fault.
    let (q_cfg, q_src) = open_gguf(&family_file(stem, true)).unwrap();
    assert_family_config(&q_cfg, &hf_cfg);
    let q_ref = format!("gguf/{stem}.q8_0.reference.safetensors");
    let worst = parity_with(&format!("{stem}.q8_0"), &q_ref, &q_cfg, &q_src);
    assert!(worst <= F32_TOL, "{stem} q8_0: worst rel err {worst:.3e}");
    let cost = parity(hf, &q_cfg, &q_src);
    eprintln!("{stem} q8_0 against the f32 reference (the quantisation's cost): {cost:.2e}");

    // The binary on the .gguf alone: exit 0, and its dump is transformers' states.
    let dump = scratch(&format!("gguf-run-{stem}")).join("dump.safetensors");
    let tokens: Vec<String> = ids_of(&r["input_ids"]).iter().map(u32::to_string).collect();
    let out = crate::support::eagle_check([
        "run",
        "--target",
        &crate::support::p(&path),
        "--engine",
        "sglang",
        "--tokens",
        &tokens.join(","),
        "--dump",
        &crate::support::p(&dump),
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let target = out.json()["subject"]["target"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(target.starts_with(&hf_cfg.model_type), "{target}");
    let got = candle_core::safetensors::load(&dump, &Device::Cpu).unwrap();
    for b in 0..=cfg.num_layers {
        let key = format!("hidden_states.{b}");
        let c = closeness(&got[&key], &r[&key]).unwrap();
        assert!(
            c.max_rel <= F32_TOL,
            "{stem} run --dump {key}: {:.2e}",
            c.max_rel
        );
    }
    src
}

/// Gemma-3: sandwich norms stored as `1 + w` (taken off on load), every 6th layer full with the
/// sliding layers on base 1e4, 1/sqrt(head_dim), final softcap, tied head.
#[test]
fn gemma3_gguf_matches_transformers() {
    let src = family_matches("gemma3", "gemma3_gguf");
    assert_eq!(
        src.gguf_name("model.layers.0.pre_feedforward_layernorm.weight"),
        Some("blk.0.ffn_norm.weight")
    );
    assert_eq!(
        src.gguf_name("model.layers.5.post_feedforward_layernorm.weight"),
        Some("blk.5.post_ffw_norm.weight")
    );
    assert!(src.shape("lm_head.weight").is_none());
}

/// Llama-4: MoE every 2nd layer from `interleave_moe_layer_step` (stacked experts split and
/// transposed by the converter, the router, the shared expert), NoPE on layer 3 as llama.cpp
/// fixes it, q/k L2 norm, llama3 rope from `rope_freqs.weight` (low = high = 1), Q/K rows as
/// they are (no permutation).
#[test]
fn llama4_gguf_matches_transformers() {
    let src = family_matches("llama4", "llama4_gguf");
    let (cfg, _) = open_gguf(&family_file("llama4", false)).unwrap();
    let l4 = cfg.llama4.as_ref().unwrap();
    assert_eq!(l4.rope_layers, vec![true, true, true, false]);
    let moe = cfg.moe.as_ref().unwrap();
    assert_eq!(
        (0..4).map(|l| moe.is_moe_layer(l)).collect::<Vec<_>>(),
        vec![false, true, false, true]
    );
    assert_eq!(
        src.shape("model.layers.1.feed_forward.experts.down_proj"),
        Some(vec![4, 32, 32])
    );
    assert_eq!(
        src.gguf_name("model.layers.3.feed_forward.shared_expert.up_proj.weight"),
        Some("blk.3.ffn_up_shexp.weight")
    );
}

/// Phi-3 (Phi-4-mini's shape): fused `attn_qkv` and `ffn_up` (gate | up), 12 of 16 head dims
/// rotated, LongRoPE from `rope_factors_long` / `rope_factors_short`, tied head.
#[test]
fn phi3_gguf_matches_transformers() {
    let src = family_matches("phi3", "phi3");
    assert_eq!(
        src.gguf_name("model.layers.2.mlp.gate_up_proj.weight"),
        Some("blk.2.ffn_up.weight")
    );
    assert_eq!(
        src.shape("model.layers.0.self_attn.qkv_proj.weight"),
        Some(vec![128, 64])
    );
}

/// A fixture GGUF rewritten with `edit` applied to its metadata and tensors, through candle's
/// reader and writer (the blocks are copied as they are).
fn rewritten(
    file: &str,
    tag: &str,
    edit: impl Fn(&mut Vec<(String, Value)>, &mut Vec<(String, QTensor)>),
) -> PathBuf {
    let src = fixture(&format!("gguf/{file}"));
    let mut f = std::fs::File::open(&src).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut md: Vec<(String, Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    md.sort_by(|a, b| a.0.cmp(&b.0));
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut ts: Vec<(String, QTensor)> = names
        .into_iter()
        .map(|n| (n.clone(), content.tensor(&mut f, n, &Device::Cpu).unwrap()))
        .collect();
    edit(&mut md, &mut ts);
    let path = scratch(&format!("gguf-family-{tag}")).join(file);
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = ts.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut std::fs::File::create(&path).unwrap(), &md, &ts).unwrap();
    path
}

fn set(md: &mut Vec<(String, Value)>, key: &str, v: Value) {
    md.retain(|(k, _)| k != key);
    md.push((key.to_string(), v));
}

/// What llama.cpp's GGUF of these families cannot say, or says otherwise than the runner would
/// need, is refused with one line naming the file and the key (or tensor), exit 2 from the CLI.
#[test]
fn family_gguf_settings_llama_cpp_does_not_carry_are_refused() {
    type Edit = Box<dyn Fn(&mut Vec<(String, Value)>, &mut Vec<(String, QTensor)>)>;
    let with =
        |key: &'static str, v: Value| -> Edit { Box::new(move |md, _| set(md, key, v.clone())) };
    let without = |key: &'static str| -> Edit {
        Box::new(move |md, ts| {
            md.retain(|(k, _)| k != key);
            ts.retain(|(k, _)| k != key);
        })
    };
    let split_qkv: Edit = Box::new(|_, ts| {
        let t = ts[0].1.dequantize(&Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::F32).unwrap();
        ts.push(("blk.0.attn_q.weight".into(), q));
    });
    let cases: Vec<(&str, &str, Edit, &str)> = vec![
        (
            "gemma3.gguf",
            "pattern",
            with("gemma3.attention.sliding_window_pattern", Value::U32(4)),
            "`gemma3.attention.sliding_window_pattern` is U32(4)",
        ),
        (
            "gemma3.gguf",
            "attn-softcap",
            with("gemma3.attn_logit_softcapping", Value::F32(50.0)),
            "`gemma3.attn_logit_softcapping` is 50",
        ),
        (
            "llama4.gguf",
            "step",
            with("llama4.interleave_moe_layer_step", Value::U32(1)),
            "`llama4.interleave_moe_layer_step` is 1, which makes layer 0 MoE, but blk.0 holds no ffn_gate_inp",
        ),
        (
            "llama4.gguf",
            "window",
            with("llama4.attention.sliding_window", Value::U32(4096)),
            "`llama4.attention.sliding_window` is 4096",
        ),
        (
            "llama4.gguf",
            "no-experts",
            without("llama4.expert_count"),
            "`llama4.expert_count` is missing",
        ),
        (
            "phi3.gguf",
            "short-factors",
            without("rope_factors_short.weight"),
            "`rope_factors_short.weight` is missing",
        ),
        (
            "phi3.gguf",
            "orig-ctx",
            without("phi3.rope.scaling.original_context_length"),
            "`phi3.rope.scaling.original_context_length` is missing",
        ),
        (
            "phi3.gguf",
            "yarn",
            with("phi3.rope.scaling.type", Value::String("yarn".into())),
            "`phi3.rope.scaling.type` is `yarn`",
        ),
        (
            "phi3.gguf",
            "odd-rotary",
            with("phi3.rope.dimension_count", Value::U32(7)),
            "`phi3.rope.dimension_count` is 7",
        ),
        (
            "phi3.gguf",
            "split-qkv",
            split_qkv,
            "`blk.0.attn_q.weight` has no HF counterpart in a phi3 model",
        ),
    ];
    for (file, tag, edit, want) in &cases {
        let path = rewritten(file, tag, edit);
        let e = open_err_at(&path);
        assert!(e.contains(want), "{tag}: {e}");
        assert!(!e.contains('\n'), "{tag}: {e}");
    }
    // Through the binary: exit 2 ("could not check"), the one line on stderr.
    for (file, tag, _, want) in cases
        .iter()
        .filter(|c| ["pattern", "step", "yarn"].contains(&c.1))
    {
        let path = root().join(format!("target/test-scratch/gguf-family-{tag}/{file}"));
        let out = crate::support::eagle_check([
            "run",
            "--target",
            &crate::support::p(&path),
            "--engine",
            "sglang",
            "--tokens",
            "1,2,3",
        ]);
        assert_eq!(out.code, 2, "{tag}: {}\n{}", out.stdout, out.stderr);
        assert!(out.stderr.contains(want), "{tag}: {}", out.stderr);
        assert!(
            out.stderr.contains(&path.display().to_string()),
            "{}",
            out.stderr
        );
    }
}

/// llama.cpp's other readings of these keys: Gemma-3 without a window runs every layer full;
/// Llama-4 with `attention.sliding_window` 0 (MobileLLM) rotates every layer over everything,
/// without the temperature; Llama-4 with 128 experts (Maverick) has no q/k norm.
#[test]
fn family_gguf_keys_resolve_as_llama_cpp_reads_them() {
    let path = rewritten("gemma3.gguf", "no-window", |md, _| {
        md.retain(|(k, _)| k != "gemma3.attention.sliding_window")
    });
    let (cfg, _) = open_gguf(&path).unwrap();
    assert_eq!(cfg.sliding_layers, Some(vec![false; 6]));

    let path = rewritten("llama4.gguf", "mobilellm", |md, _| {
        set(md, "llama4.attention.sliding_window", Value::U32(0))
    });
    let (cfg, _) = open_gguf(&path).unwrap();
    let l4 = cfg.llama4.unwrap();
    assert_eq!(
        (
            l4.rope_layers,
            l4.chunked_layers,
            l4.temperature,
            l4.l2_qk_norm
        ),
        (vec![true; 4], vec![false; 4], None, true)
    );

    let (cfg, _) = open_gguf(&family_file("llama4", false)).unwrap();
    let l4 = cfg.llama4.unwrap();
    assert_eq!(l4.chunked_layers, vec![true, true, true, false]);
    assert_eq!((l4.chunk, l4.temperature), (8192, Some((0.1, 8192.0))));
}
