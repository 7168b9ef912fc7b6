//! Target and draft `config.json`: a serde mirror of the file, resolved once into plain structs.
//!
//! The mirror ([`ConfigFile`]) takes every key the supported families use as an `Option`; the
//! resolved [`ModelConfig`] is what the forward code reads, with no `Option` left where a
//! default is well defined. transformers 5 writes rope settings as `rope_parameters`
//! (with `rope_theta` inside); older files use `rope_theta` + `rope_scaling`. Both resolve here.

pub mod draft;
pub mod family;
pub mod moe;

pub use draft::{DraftConfig, DraftIds, DraftKind};
pub use family::Family;
pub use moe::{ExpertsAct, MoeConfig, MoeLayers};

use crate::error::{Error, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};

/// Mirror of an HF `config.json` for the families eagle-check runs. Unknown keys are ignored.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ConfigFile {
    pub model_type: Option<String>,
    /// transformers writes `"architectures": null` for a config built in code; it reads as none.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub architectures: Vec<String>,
    pub text_config: Option<Box<ConfigFile>>,
    pub hidden_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub vocab_size: Option<usize>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    pub rope_scaling: Option<serde_json::Value>,
    pub rope_parameters: Option<serde_json::Value>,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    pub hidden_act: Option<String>,
    pub sliding_window: Option<usize>,
    pub use_sliding_window: Option<bool>,
    pub max_position_embeddings: Option<usize>,
    /// Phi-3/4's pretraining length, outside `rope_parameters` (LongRoPE reads it first).
    pub original_max_position_embeddings: Option<usize>,
    // DeepSeek-V3 / Kimi-K2 (MLA + MoE).
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: Option<usize>,
    pub qk_nope_head_dim: Option<usize>,
    pub qk_rope_head_dim: Option<usize>,
    pub v_head_dim: Option<usize>,
    pub rope_interleave: Option<bool>,
    pub n_routed_experts: Option<usize>,
    pub n_shared_experts: Option<usize>,
    pub num_experts_per_tok: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    pub first_k_dense_replace: Option<usize>,
    pub moe_layer_freq: Option<usize>,
    pub n_group: Option<usize>,
    pub topk_group: Option<usize>,
    pub norm_topk_prob: Option<bool>,
    pub routed_scaling_factor: Option<f64>,
    pub scoring_func: Option<String>,
    pub topk_method: Option<String>,
    pub quantization_config: Option<serde_json::Value>,
    // Qwen2/3-MoE, MiniMax-M2, GLM-4.5, gpt-oss.
    pub num_experts: Option<usize>,
    pub num_local_experts: Option<usize>,
    /// gpt-oss's released config writes it beside `num_experts_per_tok`.
    pub experts_per_token: Option<usize>,
    pub shared_expert_intermediate_size: Option<usize>,
    pub decoder_sparse_step: Option<usize>,
    #[serde(default, deserialize_with = "null_as_none")]
    pub mlp_only_layers: Option<Vec<usize>>,
    #[serde(default, deserialize_with = "null_as_none")]
    pub mlp_layer_types: Option<Vec<String>>,
    #[serde(default, deserialize_with = "null_as_none")]
    pub layer_types: Option<Vec<String>>,
    pub max_window_layers: Option<usize>,
    pub qkv_bias: Option<bool>,
    pub use_qk_norm: Option<bool>,
    pub qk_norm_type: Option<String>,
    pub partial_rotary_factor: Option<f64>,
    pub rotary_dim: Option<usize>,
    pub swiglu_alpha: Option<f64>,
    pub swiglu_limit: Option<f64>,
    // Llama-4.
    pub intermediate_size_mlp: Option<usize>,
    #[serde(default, deserialize_with = "null_as_none")]
    pub moe_layers: Option<Vec<usize>>,
    pub interleave_moe_layer_step: Option<usize>,
    #[serde(default, deserialize_with = "null_as_none")]
    pub no_rope_layers: Option<Vec<u8>>,
    pub no_rope_layer_interval: Option<usize>,
    /// Absent: `Llama4TextConfig`'s 8192; `null`: no chunking.
    #[serde(default, deserialize_with = "present")]
    pub attention_chunk_size: Option<Option<usize>>,
    pub attn_temperature_tuning: Option<bool>,
    pub floor_scale: Option<f64>,
    pub attn_scale: Option<f64>,
    // Gemma-3.
    pub hidden_activation: Option<String>,
    pub query_pre_attn_scalar: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    pub attn_logit_softcapping: Option<f64>,
    pub rope_local_base_freq: Option<f64>,
    pub sliding_window_pattern: Option<usize>,
    /// `true` / `false` (Gemma-3), or a string naming where it applies (Gemma-4's
    /// `"vision"`): kept as written.
    pub use_bidirectional_attention: Option<serde_json::Value>,
    // Qwen3.5 / Qwen3-Next linear attention.
    pub linear_conv_kernel_dim: Option<usize>,
    pub linear_key_head_dim: Option<usize>,
    pub linear_value_head_dim: Option<usize>,
    pub linear_num_key_heads: Option<usize>,
    pub linear_num_value_heads: Option<usize>,
    pub full_attention_interval: Option<usize>,
    pub attn_output_gate: Option<bool>,
    // Gemma-4 (`Gemma4TextConfig`).
    pub global_head_dim: Option<usize>,
    pub num_global_key_value_heads: Option<usize>,
    pub attention_k_eq_v: Option<bool>,
    /// transformers 5.24 writes the full layers' shape here, by layer index (`"5": {"head_dim":
    /// 512, ...}`), instead of `global_head_dim` / `num_global_key_value_heads`.
    #[serde(default, deserialize_with = "null_as_none")]
    pub per_layer_config: Option<std::collections::BTreeMap<String, serde_json::Value>>,
    pub hidden_size_per_layer_input: Option<usize>,
    pub num_kv_shared_layers: Option<usize>,
    pub enable_moe_block: Option<bool>,
    pub use_double_wide_mlp: Option<bool>,
    pub top_k_experts: Option<usize>,
    /// Gemma-4's published 5.5 configs spell `moe_intermediate_size` so.
    pub expert_intermediate_size: Option<usize>,
}

/// An optional value that may be written as `null`.
fn null_as_none<'de, D, T>(de: D) -> std::result::Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(de)
}

/// A key that may be written as `null`, told apart from an absent one (`#[serde(default)]`
/// gives `None` for absent; this gives `Some(None)` for `null`).
fn present<'de, D, T>(de: D) -> std::result::Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Some(Option::<T>::deserialize(de)?))
}

/// A list that may be written as `null`: read as empty.
fn null_as_empty<'de, D, T>(de: D) -> std::result::Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Option::<Vec<T>>::deserialize(de)?.unwrap_or_default())
}

/// The architectures the runner knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    /// `deepseek_v3` and `kimi_k2` (the same architecture).
    DeepseekV3,
    Qwen3Moe,
    Qwen2Moe,
    #[serde(rename = "minimax_m2")]
    MiniMaxM2,
    /// GLM-4.5 / 4.6.
    Glm4Moe,
    /// GLM-4.7-Flash: DeepSeek-V3's MLA and MoE under another name.
    Glm4MoeLite,
    GptOss,
    /// Llama-4 Scout / Maverick text (`llama4_text`, and `llama4`'s `text_config`).
    Llama4,
    /// Phi-3 / Phi-4 (fused `qkv_proj` and `gate_up_proj`, partial rotary, LongRoPE).
    Phi3,
    /// Gemma-3's text model (`gemma3_text`, and the `gemma3` wrapper's).
    Gemma3,
    /// Qwen3.5-MoE (`qwen3_5_moe_text`, and `qwen3_5_moe`'s `text_config`): gated DeltaNet
    /// layers between gated-attention layers, every layer MoE.
    #[serde(rename = "qwen3_5_moe")]
    Qwen35Moe,
    /// Qwen3-Next (`qwen3_next`): Qwen3.5-MoE's hybrid decoder with head-grouped fused
    /// DeltaNet projections, dense layers where `mlp_only_layers` / `decoder_sparse_step` say.
    Qwen3Next,
    /// Qwen3-VL-MoE's text tower (`qwen3_vl_moe`, `qwen3_vl_moe_text`): Qwen3-MoE's decoder.
    #[serde(rename = "qwen3_vl_moe")]
    Qwen3VlMoe,
    /// Gemma-4's text model (`gemma4_text`, and the `gemma4` wrapper's).
    Gemma4,
}

/// The `model_type`s the runner executes, in the order a refusal lists them.
pub const RUNNABLE_MODEL_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "deepseek_v3",
    "kimi_k2",
    "qwen3_moe",
    "qwen2_moe",
    "minimax_m2",
    "glm4_moe",
    "glm4_moe_lite",
    "gpt_oss",
    "llama4",
    "llama4_text",
    "phi3",
    "gemma3_text",
    "gemma3",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_next",
    "qwen3_vl_moe",
    "qwen3_vl_moe_text",
    "gemma4_text",
    "gemma4",
];

impl Arch {
    fn from_model_type(model_type: &str) -> Option<Arch> {
        Some(match model_type {
            "llama" => Arch::Llama,
            "mistral" => Arch::Mistral,
            // The vision-language models' text towers on text-only prompts: Qwen2-VL's and
            // Qwen2.5-VL's decoder is Qwen2's (`Qwen2_5_VLAttention`: q/k/v biased, o_proj not),
            // Qwen3-VL's is Qwen3's (`Qwen3VLTextAttention`: per-head q/k norm, o_proj biased
            // with `attention_bias`), and M-RoPE is the default rope there ([`resolve_rope`]).
            // Image tokens and Qwen3-VL's deepstack features never arise without an image.
            "qwen2" | "qwen2_vl" | "qwen2_vl_text" | "qwen2_5_vl" | "qwen2_5_vl_text" => {
                Arch::Qwen2
            }
            "qwen3" | "qwen3_vl" | "qwen3_vl_text" => Arch::Qwen3,
            "deepseek_v3" | "kimi_k2" => Arch::DeepseekV3,
            "qwen3_moe" => Arch::Qwen3Moe,
            "qwen2_moe" => Arch::Qwen2Moe,
            "minimax_m2" => Arch::MiniMaxM2,
            "glm4_moe" => Arch::Glm4Moe,
            "glm4_moe_lite" => Arch::Glm4MoeLite,
            "gpt_oss" => Arch::GptOss,
            "llama4_text" | "llama4" => Arch::Llama4,
            "phi3" => Arch::Phi3,
            "gemma3_text" | "gemma3" => Arch::Gemma3,
            "qwen3_5_moe" | "qwen3_5_moe_text" => Arch::Qwen35Moe,
            "qwen3_next" => Arch::Qwen3Next,
            // Qwen3-VL-MoE's tower on text: Qwen3-MoE's decoder (`Qwen3VLMoeTextAttention`:
            // per-head q/k norm, o_proj biased with `attention_bias`), M-RoPE the default rope.
            "qwen3_vl_moe" | "qwen3_vl_moe_text" => Arch::Qwen3VlMoe,
            "gemma4_text" | "gemma4" => Arch::Gemma4,
            _ => return None,
        })
    }

    /// Whether its attention is DeepSeek's multi-head latent attention.
    pub fn is_mla(self) -> bool {
        matches!(self, Arch::DeepseekV3 | Arch::Glm4MoeLite)
    }
}

/// Rotary position embedding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f64,
    pub scaling: RopeScaling,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    Linear {
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN as transformers computes it (`_compute_yarn_parameters`), DeepSeek-V3's mscale
    /// terms and gpt-oss's `truncate: false` included.
    Yarn {
        factor: f64,
        beta_fast: f64,
        beta_slow: f64,
        mscale: f64,
        mscale_all_dim: f64,
        original_max_position_embeddings: f64,
        /// Round the correction range outwards to whole dimensions (transformers' default).
        truncate: bool,
        /// `attention_factor` when the config sets it (else derived from the mscale terms).
        attention_factor: Option<f64>,
    },
    /// LongRoPE (Phi-3/4, transformers `_compute_longrope_parameters`): each frequency divided
    /// by its factor, the short ones up to `original_max_position_embeddings` tokens and the
    /// long ones past it (`longrope_frequency_update`), cos/sin times `attention_factor`.
    /// Gemma-4's full-attention layers (transformers `_compute_proportional_rope_parameters`):
    /// the first `floor(partial_rotary_factor * dim / 2)` frequencies are the default ones over
    /// the whole head (`theta ** (-2i / dim)`), the others 0 (their dims pass unrotated), each
    /// divided by `factor`; rope then rotates halves of the whole head. Not partial rotary: the
    /// rotated pairs are `(i, i + dim / 2)`, not `(i, i + rot / 2)`.
    Proportional {
        factor: f64,
        partial_rotary_factor: f64,
    },
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: f64,
        attention_factor: f64,
    },
}

/// Multi-head latent attention (DeepSeek-V2/V3).
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Rope on interleaved pairs (transformers' `DeepseekV3Config.rope_interleave`, default true,
    /// matching DeepSeek's own `apply_rotary_emb` on complex pairs).
    pub rope_interleave: bool,
}

/// How a target normalises its queries and keys before rope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// One RMSNorm over each head's `head_dim` (Qwen3, Qwen3-MoE, GLM-4.5 with `use_qk_norm`).
    PerHead,
    /// One RMSNorm over the whole projection, `heads * head_dim` (MiniMax-M2's
    /// `qk_norm_type: per_layer`; `MiniMaxM2Attention`).
    Full,
}

/// Gemma's MLP activation (`hidden_activation`): transformers' `gelu_pytorch_tanh` (the tanh
/// approximation, every released Gemma-3) or the exact `gelu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GeluKind {
    Tanh,
    Erf,
}

/// What Gemma's text model adds to a Llama-shaped config (`Gemma3TextConfig`,
/// `Gemma4TextConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct GemmaConfig {
    /// The sliding layers' rope (`rope_parameters.sliding_attention`, or the legacy
    /// `rope_local_base_freq`); [`ModelConfig::rope`] is the full layers'.
    pub local_rope: Rope,
    /// The softmax scale is `query_pre_attn_scalar ** -0.5` (default 256), not `head_dim`'s.
    pub query_pre_attn_scalar: f64,
    /// `tanh(logits / cap) * cap` on the logits (only them): `Gemma3ForCausalLM` applies it,
    /// transformers 5.24's `Gemma3ForConditionalGeneration.forward` does not, so a Gemma-3
    /// wrapper's is `None` (`Gemma4ForConditionalGeneration.forward` does apply it).
    pub final_logit_softcapping: Option<f64>,
    pub act: GeluKind,
    /// Gemma-4's layers; `None` for Gemma-3.
    pub v4: Option<Gemma4Layers>,
}

/// What Gemma-4 (`Gemma4TextConfig`, transformers 5.24) changes per layer. Its attention's
/// softmax scale is 1 (`Gemma4TextAttention.scaling`), its norms are `w`, not `1 + w`, values
/// are RMS-normalised without a weight (`v_norm`), and each layer's output is multiplied by its
/// `layer_scalar`.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Layers {
    /// Per layer: its head dim and KV heads (`per_layer_config`, by default the full layers'
    /// `global_head_dim`, 512, and with `attention_k_eq_v` `num_global_key_value_heads`).
    pub head_dims: Vec<usize>,
    pub kv_heads: Vec<usize>,
    /// `attention_k_eq_v`: the full layers have no `v_proj`; their values are the key
    /// projection's output, before `k_norm` (`Gemma4TextAttention.use_alternative_attention`).
    pub k_eq_v: bool,
}

/// A resolved model config: what the target forward (and the gate) reads.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub path: PathBuf,
    pub arch: Arch,
    pub model_type: String,
    /// The family the engines' rules are keyed on ([`Family::of`]).
    pub family: Family,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub vocab_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub rms_norm_eps: f64,
    pub rope: Rope,
    pub tie_word_embeddings: bool,
    /// Biases on q/k/v (Qwen2 always; Llama and Qwen3 when `attention_bias`).
    pub attention_bias: bool,
    /// A bias on o_proj: transformers' Llama and Qwen3 build it from `attention_bias`, Qwen2
    /// and Mistral never (`modeling_{llama,qwen2,qwen3,mistral}.py`).
    pub o_bias: bool,
    /// Biases on the MLP projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    pub qk_norm: QkNorm,
    pub sliding_window: Option<usize>,
    /// Per layer, whether it attends through `sliding_window` (`layer_types`); `None`: every
    /// layer does when `sliding_window` is set.
    pub sliding_layers: Option<Vec<bool>>,
    /// The leading dims of each head that rope rotates (partial rotary: GLM-4.5 half,
    /// MiniMax-M2 `rotary_dim`); `head_dim` otherwise.
    pub rotary_dim: usize,
    /// gpt-oss: a learned per-head logit in every softmax denominator (`self_attn.sinks`).
    pub attn_sinks: bool,
    pub mla: Option<MlaConfig>,
    /// Llama-4's per-layer attention (NoPE layers, chunked attention, temperature tuning).
    pub llama4: Option<Llama4Attention>,
    /// Qwen3.5's gated DeltaNet layers.
    pub delta_net: Option<DeltaNet>,
    pub moe: Option<MoeConfig>,
    /// FP8 block-quantised weights: the `weight_block_size` of `quantization_config`.
    pub fp8_block: Option<[usize; 2]>,
    /// Gemma-3: the local rope, the softmax scale, the logit softcap, the activation.
    pub gemma: Option<GemmaConfig>,
}

/// What the static checks need of a target, from any `config.json` that states its layer count
/// and hidden size: the gate needs no runner for an architecture (gpt-oss, MiniMax, GLM, Gemma...),
/// only these numbers and the `model_type` that picks an engine's per-architecture rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetInfo {
    pub path: PathBuf,
    /// The text model's `model_type` (a wrapper's `text_config` wins), for reports.
    pub model_type: String,
    /// The family the engines' rules are keyed on ([`Family::of`]).
    pub family: Family,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: Option<usize>,
}

impl TargetInfo {
    /// Loads a target config leniently (a directory or a `config.json`).
    pub fn load(path: &Path) -> Result<TargetInfo> {
        let (file, raw) = read_config_file(path)?;
        TargetInfo::resolve(&raw, &file)
    }

    pub fn resolve(raw: &ConfigFile, path: &Path) -> Result<TargetInfo> {
        raw.check_sizes(path)?;
        // The gate needs only the family: a config that names its class but no model_type
        // (the class table in `family`) still gates, and reports the family as its type.
        let family = Family::of(raw).ok_or_else(|| {
            Error::config(
                path,
                "missing required key `model_type` (and no architectures class eagle-check knows)",
            )
        })?;
        let raw = match &raw.text_config {
            Some(text) => merged_text_config(raw, text),
            None => raw.clone(),
        };
        Ok(TargetInfo {
            path: path.to_path_buf(),
            model_type: raw
                .model_type
                .clone()
                .unwrap_or_else(|| family.name.clone()),
            family,
            num_layers: positive(
                need(raw.num_hidden_layers, path, "num_hidden_layers")?,
                path,
                "num_hidden_layers",
            )?,
            hidden_size: positive(
                need(raw.hidden_size, path, "hidden_size")?,
                path,
                "hidden_size",
            )?,
            vocab_size: raw.vocab_size,
        })
    }
}

impl From<&ModelConfig> for TargetInfo {
    fn from(cfg: &ModelConfig) -> TargetInfo {
        TargetInfo {
            path: cfg.path.clone(),
            model_type: cfg.model_type.clone(),
            family: cfg.family.clone(),
            num_layers: cfg.num_layers,
            hidden_size: cfg.hidden_size,
            vocab_size: Some(cfg.vocab_size),
        }
    }
}

/// Reads a `config.json`, or the `config.json` inside a directory.
pub fn read_config_file(path: &Path) -> Result<(PathBuf, ConfigFile)> {
    let file = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    let text = std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?;
    let parsed: ConfigFile = serde_json::from_str(&text).map_err(|error| Error::Json {
        path: file.clone(),
        error,
    })?;
    Ok((file, parsed))
}

/// Largest width eagle-check takes from a config or spec (hidden size, heads, head dim,
/// intermediate size, vocabulary, experts, ranks): far above any real model (hidden sizes reach
/// ~32k, vocabularies ~260k), and small enough that the products the checks and loaders form
/// from a few of them cannot overflow.
pub const MAX_DIM: usize = 1 << 24;
/// Largest layer count, boundary or layer id: real models have at most a few hundred layers.
pub const MAX_LAYERS: usize = 1 << 16;

/// Refuses a size past its bound (`MAX_LAYERS` for layer counts, `MAX_DIM` for the rest).
pub(crate) fn within(value: usize, path: &Path, key: &str) -> Result<usize> {
    let max = if key.contains("layer") && !key.contains("lora") {
        MAX_LAYERS
    } else {
        MAX_DIM
    };
    if value > max {
        return Err(Error::config(
            path,
            format!("`{key}` is {value}, more than eagle-check accepts ({max})"),
        ));
    }
    Ok(value)
}

impl ConfigFile {
    /// Every size the file states, within its bound, before any is used (nested
    /// `text_config` included).
    pub(crate) fn check_sizes(&self, path: &Path) -> Result<()> {
        let sizes = [
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
            ("sliding_window", self.sliding_window),
            ("q_lora_rank", self.q_lora_rank),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("n_routed_experts", self.n_routed_experts),
            ("n_shared_experts", self.n_shared_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("moe_intermediate_size", self.moe_intermediate_size),
            ("expert_intermediate_size", self.expert_intermediate_size),
            ("top_k_experts", self.top_k_experts),
            ("global_head_dim", self.global_head_dim),
            (
                "num_global_key_value_heads",
                self.num_global_key_value_heads,
            ),
            ("first_k_dense_replace", self.first_k_dense_replace),
            ("moe_layer_freq", self.moe_layer_freq),
            ("n_group", self.n_group),
            ("topk_group", self.topk_group),
            ("num_experts", self.num_experts),
            ("num_local_experts", self.num_local_experts),
            ("experts_per_token", self.experts_per_token),
            (
                "shared_expert_intermediate_size",
                self.shared_expert_intermediate_size,
            ),
            ("decoder_sparse_step", self.decoder_sparse_step),
            ("rotary_dim", self.rotary_dim),
            ("intermediate_size_mlp", self.intermediate_size_mlp),
            ("attention_chunk_size", self.attention_chunk_size.flatten()),
            ("no_rope_layer_interval", self.no_rope_layer_interval),
            ("interleave_moe_layer_step", self.interleave_moe_layer_step),
            ("linear_conv_kernel_dim", self.linear_conv_kernel_dim),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
            ("full_attention_interval", self.full_attention_interval),
        ];
        for (key, value) in sizes {
            if let Some(v) = value {
                within(v, path, key)?;
            }
        }
        if let Some(text) = &self.text_config {
            text.check_sizes(path)?;
        }
        Ok(())
    }
}

fn need<T>(value: Option<T>, path: &Path, key: &str) -> Result<T> {
    value.ok_or_else(|| Error::config(path, format!("missing required key `{key}`")))
}

fn positive(value: usize, path: &Path, key: &str) -> Result<usize> {
    if value == 0 {
        return Err(Error::config(
            path,
            format!("`{key}` must be positive, found 0"),
        ));
    }
    Ok(value)
}

impl ModelConfig {
    /// The sliding window decoder layer `layer` attends through, if any.
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        match &self.sliding_layers {
            Some(sliding) if !sliding.get(layer).copied().unwrap_or(false) => None,
            _ => self.sliding_window,
        }
    }

    /// Loads and resolves a target config (a directory or a `config.json`).
    pub fn load(path: &Path) -> Result<ModelConfig> {
        let (file, raw) = read_config_file(path)?;
        ModelConfig::resolve(&raw, &file)
    }

    /// Resolves a mirror; a nested `text_config` (multimodal wrappers) wins over the top level.
    pub fn resolve(raw: &ConfigFile, path: &Path) -> Result<ModelConfig> {
        raw.check_sizes(path)?;
        let family = Family::of(raw);
        let wrapped = raw.text_config.is_some();
        let raw = match &raw.text_config {
            Some(text) => merged_text_config(raw, text),
            None => raw.clone(),
        };
        let mut raw = raw;
        let model_type = need(raw.model_type.clone(), path, "model_type")?;
        // `Family::of` reads the same `model_type` (the wrapper's first), so it found one.
        let family = family.unwrap_or_default();
        let arch = Arch::from_model_type(&model_type).ok_or_else(|| {
            Error::config(
                path,
                format!(
                    "model_type `{model_type}` is not supported (supported: {})",
                    RUNNABLE_MODEL_TYPES.join(", ")
                ),
            )
        })?;
        if arch == Arch::Gemma4 && raw.rope_parameters.is_none() {
            // `Gemma4TextConfig.__post_init__`'s default: proportional rope with a quarter of
            // each full layer's head rotated, the sliding layers' default rope.
            raw.rope_parameters = Some(serde_json::json!({
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0},
            }));
        }
        let hidden_size = positive(
            need(raw.hidden_size, path, "hidden_size")?,
            path,
            "hidden_size",
        )?;
        let num_layers = positive(
            need(raw.num_hidden_layers, path, "num_hidden_layers")?,
            path,
            "num_hidden_layers",
        )?;
        let num_heads = positive(
            need(raw.num_attention_heads, path, "num_attention_heads")?,
            path,
            "num_attention_heads",
        )?;
        // Gemma3TextConfig's and Gemma4TextConfig's defaults differ from Llama's (4 KV heads,
        // head_dim 256); Qwen3NextConfig's are 2 KV heads of 256.
        let gemma = matches!(arch, Arch::Gemma3 | Arch::Gemma4);
        let num_kv_heads = positive(
            raw.num_key_value_heads.unwrap_or(match arch {
                _ if gemma => 4,
                Arch::Qwen3Next => 2,
                _ => num_heads,
            }),
            path,
            "num_key_value_heads",
        )?;
        if num_heads % num_kv_heads != 0 {
            return Err(Error::config(
                path,
                format!(
                    "num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
                ),
            ));
        }
        let head_dim = positive(
            raw.head_dim.unwrap_or(if gemma || arch == Arch::Qwen3Next {
                256
            } else {
                hidden_size / num_heads
            }),
            path,
            "head_dim",
        )?;
        let sliding_layers = resolve_sliding_layers(arch, &raw, num_layers, path)?;
        let gemma = if gemma {
            let shape = (num_heads, num_kv_heads, head_dim);
            Some(resolve_gemma(
                &raw,
                arch,
                wrapped,
                shape,
                &sliding_layers,
                path,
            )?)
        } else {
            let act = raw.hidden_act.as_deref().unwrap_or("silu");
            if act != "silu" {
                return Err(Error::config(
                    path,
                    format!("hidden_act `{act}` is not supported (only silu)"),
                ));
            }
            None
        };
        let rope = match arch {
            Arch::Gemma3 | Arch::Gemma4 => {
                resolve_gemma_rope(&raw, "full_attention", 1_000_000.0, path)?
            }
            _ => resolve_rope(&raw, path)?,
        };
        let mla = if arch.is_mla() {
            Some(resolve_mla(&raw, path)?)
        } else {
            None
        };
        let moe = moe::resolve(arch, &raw, path)?;
        let llama4 = (arch == Arch::Llama4)
            .then(|| resolve_llama4(&raw, num_layers, path))
            .transpose()?;
        let delta_net = matches!(arch, Arch::Qwen35Moe | Arch::Qwen3Next)
            .then(|| resolve_delta_net(&raw, arch, num_layers, path))
            .transpose()?;
        let fp8_block = resolve_fp8(&raw, path)?;
        let sliding_window = match (arch, raw.use_sliding_window) {
            (Arch::Mistral | Arch::GptOss | Arch::Phi3, _) => raw.sliding_window,
            // Gemma3TextConfig.sliding_window defaults to 4096.
            (Arch::Gemma3, _) => Some(raw.sliding_window.unwrap_or(4096)),
            // Gemma4TextConfig.sliding_window defaults to 512.
            (Arch::Gemma4, _) => Some(raw.sliding_window.unwrap_or(512)),
            (Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen2Moe, Some(true)) => {
                raw.sliding_window
            }
            _ => None,
        };
        let rotary_dim = resolve_rotary_dim(arch, &raw, head_dim, path)?;
        if let RopeScaling::LongRope {
            short_factor,
            long_factor,
            ..
        } = &rope.scaling
        {
            for (key, list) in [("short_factor", short_factor), ("long_factor", long_factor)] {
                if list.len() != rotary_dim / 2 {
                    return Err(Error::config(
                        path,
                        format!(
                            "rope_scaling.{key} has {} entries, rope rotates {rotary_dim} dims \
                             (it needs {})",
                            list.len(),
                            rotary_dim / 2
                        ),
                    ));
                }
            }
        }
        let qk_norm = match arch {
            // Gemma-3's q_norm/k_norm are `1 + w` norms (model::gemma adds the 1).
            // Gemma-4's are plain `w` norms (model::gemma4 loads them).
            Arch::Qwen3 | Arch::Qwen3Moe | Arch::Qwen3VlMoe | Arch::Gemma3 | Arch::Gemma4 => {
                QkNorm::PerHead
            }
            // `Glm4MoeConfig.use_qk_norm` defaults to false.
            Arch::Glm4Moe if raw.use_qk_norm.unwrap_or(false) => QkNorm::PerHead,
            // `MiniMaxM2Attention` always norms the whole projection; the released configs
            // say so with `use_qk_norm: true, qk_norm_type: per_layer`.
            Arch::MiniMaxM2 => match (raw.use_qk_norm, raw.qk_norm_type.as_deref()) {
                (Some(false), _) => QkNorm::None,
                (_, None | Some("per_layer")) => QkNorm::Full,
                (_, Some("per_head")) => QkNorm::PerHead,
                (_, Some(other)) => {
                    return Err(Error::config(
                        path,
                        format!("qk_norm_type `{other}` is not supported (per_layer, per_head)"),
                    ));
                }
            },
            _ => QkNorm::None,
        };
        let attention_bias = match arch {
            // Qwen2 always has q/k/v bias (transformers' Qwen2Attention hard-codes bias=True);
            // Qwen2-MoE reads `qkv_bias` (default true).
            Arch::Qwen2 => true,
            Arch::Qwen2Moe => raw.qkv_bias.unwrap_or(true),
            Arch::Mistral | Arch::MiniMaxM2 => false,
            _ => raw.attention_bias.unwrap_or(false),
        };
        // o_proj's bias: Llama, Qwen3, Qwen3-MoE and gpt-oss build it from `attention_bias`;
        // Qwen2(-MoE), Mistral, MiniMax-M2 and GLM-4.5 never.
        let o_bias = matches!(
            arch,
            Arch::Llama
                | Arch::Qwen3
                | Arch::Qwen3Moe
                | Arch::Qwen3VlMoe
                | Arch::GptOss
                | Arch::Gemma3
                | Arch::Gemma4
        ) && raw.attention_bias.unwrap_or(false);
        Ok(ModelConfig {
            path: path.to_path_buf(),
            arch,
            model_type,
            family,
            hidden_size,
            num_layers,
            vocab_size: positive(
                need(raw.vocab_size, path, "vocab_size")?,
                path,
                "vocab_size",
            )?,
            num_heads,
            num_kv_heads,
            head_dim,
            // Llama-4's dense layers are `intermediate_size_mlp` wide (`Llama4TextDecoderLayer`).
            intermediate_size: match arch {
                Arch::Llama4 => raw.intermediate_size_mlp.unwrap_or(16384),
                _ => raw.intermediate_size.unwrap_or(0),
            },
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6),
            rope,
            // LlamaConfig, Qwen2Config and DeepseekV3Config all default to untied, Gemma's
            // configs to tied.
            tie_word_embeddings: raw
                .tie_word_embeddings
                .unwrap_or(matches!(arch, Arch::Gemma3 | Arch::Gemma4)),
            attention_bias,
            o_bias,
            mlp_bias: arch == Arch::Llama && raw.mlp_bias.unwrap_or(false),
            qk_norm,
            sliding_window,
            sliding_layers,
            rotary_dim,
            attn_sinks: arch == Arch::GptOss,
            mla,
            llama4,
            delta_net,
            moe,
            fp8_block,
            gemma,
        })
    }
}

/// Llama-4's attention, per layer (`Llama4TextAttention`, transformers 5.24).
#[derive(Debug, Clone, PartialEq)]
pub struct Llama4Attention {
    /// Per layer: whether it rotates q and k (`no_rope_layers[i] == 1`; by default every
    /// `no_rope_layer_interval`-th layer is a NoPE layer). Rope is the complex-pair
    /// (interleaved) kind (`apply_rotary_emb`, `view_as_complex`).
    pub rope_layers: Vec<bool>,
    /// Per layer: whether it attends only within its chunk of `chunk` positions
    /// (`layer_types` "chunked_attention", by default the rope layers when
    /// `attention_chunk_size` is set; `create_chunked_causal_mask`).
    pub chunked_layers: Vec<bool>,
    pub chunk: usize,
    /// q and k RMS-normalised per head without a weight (`Llama4TextL2Norm`), after rope, on
    /// the rope layers (`use_qk_norm`).
    pub l2_qk_norm: bool,
    /// NoPE layers scale q by `log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`
    /// (`attn_temperature_tuning`): `(attn_scale, floor_scale)`.
    pub temperature: Option<(f64, f64)>,
}

/// Qwen3.5's and Qwen3-Next's gated DeltaNet (`Qwen3_5MoeGatedDeltaNet`,
/// `Qwen3NextGatedDeltaNet`, transformers 5.24): which layers are linear attention, their
/// widths, and how the input projections are laid out.
#[derive(Debug, Clone, PartialEq)]
pub struct DeltaNet {
    /// Per layer: `layer_types[i] == "linear_attention"` (by default all but every
    /// `full_attention_interval`-th, 4).
    pub linear_layers: Vec<bool>,
    pub conv_kernel: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    /// Qwen3-Next: q, k, v and z in one `in_proj_qkvz` and b, a in one `in_proj_ba`, grouped by
    /// key head (`fix_query_key_value_ordering`); Qwen3.5: `in_proj_qkv`, `in_proj_z`,
    /// `in_proj_b`, `in_proj_a`, each laid out by head.
    pub grouped_projections: bool,
}

fn resolve_delta_net(raw: &ConfigFile, arch: Arch, layers: usize, path: &Path) -> Result<DeltaNet> {
    let linear_layers: Vec<bool> = match &raw.layer_types {
        Some(types) => types
            .iter()
            .take(layers)
            .map(|t| match t.as_str() {
                "linear_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(Error::config(
                    path,
                    format!(
                        "layer_types: `{other}` is not supported (linear_attention, full_attention)"
                    ),
                )),
            })
            .collect::<Result<_>>()?,
        None => {
            let every = raw.full_attention_interval.unwrap_or(4).max(1);
            (0..layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    if linear_layers.len() < layers {
        return Err(Error::config(
            path,
            format!(
                "layer_types lists {} layers, num_hidden_layers is {layers}",
                linear_layers.len()
            ),
        ));
    }
    // `Qwen3_5MoeAttention` always gates its output (the released configs say
    // `attn_output_gate: true`); a config that turns it off describes another model.
    if raw.attn_output_gate == Some(false) {
        return Err(Error::config(
            path,
            "attn_output_gate false is not supported (Qwen3.5's attention always gates its output)",
        ));
    }
    let net = DeltaNet {
        linear_layers,
        conv_kernel: raw.linear_conv_kernel_dim.unwrap_or(4),
        key_heads: raw.linear_num_key_heads.unwrap_or(16),
        value_heads: raw.linear_num_value_heads.unwrap_or(32),
        key_dim: raw.linear_key_head_dim.unwrap_or(128),
        value_dim: raw.linear_value_head_dim.unwrap_or(128),
        grouped_projections: arch == Arch::Qwen3Next,
    };
    if net.conv_kernel == 0
        || net.key_heads == 0
        || net.key_dim == 0
        || net.value_dim == 0
        || !net.value_heads.is_multiple_of(net.key_heads)
    {
        return Err(Error::config(
            path,
            format!(
                "linear attention: {} value heads over {} key heads (dims {} / {}, conv {}) do not group",
                net.value_heads, net.key_heads, net.key_dim, net.value_dim, net.conv_kernel
            ),
        ));
    }
    Ok(net)
}

/// Llama-4's attention settings as `Llama4TextConfig.__post_init__` fills them in.
fn resolve_llama4(raw: &ConfigFile, layers: usize, path: &Path) -> Result<Llama4Attention> {
    let rope_layers: Vec<bool> = match &raw.no_rope_layers {
        Some(list) if !list.is_empty() => list.iter().map(|&x| x != 0).collect(),
        _ => {
            let every = raw.no_rope_layer_interval.unwrap_or(4).max(1);
            (0..layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    if rope_layers.len() < layers {
        return Err(Error::config(
            path,
            format!(
                "no_rope_layers lists {} layers, num_hidden_layers is {layers}",
                rope_layers.len()
            ),
        ));
    }
    let chunk = match raw.attention_chunk_size {
        None => Some(8192),
        Some(c) => c.filter(|&c| c > 0),
    };
    let chunked_layers = match &raw.layer_types {
        Some(types) => {
            if types.len() < layers {
                return Err(Error::config(
                    path,
                    format!(
                        "layer_types lists {} layers, num_hidden_layers is {layers}",
                        types.len()
                    ),
                ));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    "chunked_attention" if chunk.is_some() => Ok(true),
                    "full_attention" => Ok(false),
                    other => Err(Error::config(
                        path,
                        format!(
                            "layer_types: `{other}` is not supported here (chunked_attention with \
                             an attention_chunk_size, full_attention)"
                        ),
                    )),
                })
                .collect::<Result<Vec<bool>>>()?
        }
        None => rope_layers.iter().map(|&r| r && chunk.is_some()).collect(),
    };
    let tuning = raw.attn_temperature_tuning.unwrap_or(true);
    Ok(Llama4Attention {
        rope_layers,
        chunked_layers,
        chunk: chunk.unwrap_or(usize::MAX),
        l2_qk_norm: raw.use_qk_norm.unwrap_or(true),
        temperature: tuning.then(|| {
            (
                raw.attn_scale.unwrap_or(0.1),
                raw.floor_scale.unwrap_or(8192.0),
            )
        }),
    })
}

/// `text_config` keys override the wrapper's; the wrapper fills what the inner one lacks.
fn merged_text_config(outer: &ConfigFile, inner: &ConfigFile) -> ConfigFile {
    let mut merged = inner.clone();
    if merged.model_type.is_none() {
        merged.model_type = outer.model_type.clone();
    }
    if merged.tie_word_embeddings.is_none() {
        merged.tie_word_embeddings = outer.tie_word_embeddings;
    }
    if merged.vocab_size.is_none() {
        merged.vocab_size = outer.vocab_size;
    }
    // A wrapper's checkpoint is quantised as a whole (Gemma-4-31B-IT-NVFP4 says so at the top).
    if merged.quantization_config.is_none() {
        merged.quantization_config = outer.quantization_config.clone();
    }
    merged
}

fn json_f64(v: &serde_json::Value, key: &str) -> Option<f64> {
    v.get(key).and_then(serde_json::Value::as_f64)
}

/// Resolves rope from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`.
pub(crate) fn resolve_rope(raw: &ConfigFile, path: &Path) -> Result<Rope> {
    let params = raw
        .rope_parameters
        .as_ref()
        .filter(|v| v.is_object())
        .or(raw.rope_scaling.as_ref().filter(|v| v.is_object()));
    let theta = params
        .and_then(|p| json_f64(p, "rope_theta"))
        .or(raw.rope_theta)
        .unwrap_or(10000.0);
    let Some(p) = params else {
        return Ok(Rope {
            theta,
            scaling: RopeScaling::None,
        });
    };
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(serde_json::Value::as_str)
        .unwrap_or("default");
    let factor = json_f64(p, "factor").unwrap_or(1.0);
    let orig = json_f64(p, "original_max_position_embeddings");
    let scaling = match kind {
        // M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: `mrope_section`, transformers 5 writes
        // `rope_type: default` beside it) rotates three sections of the frequencies by the
        // temporal, height and width positions. For text, the three positions are the token's
        // position (`Qwen2_5_VLModel.get_rope_index` without image or video grids), so it is the
        // default rope over the same frequencies.
        "default" | "mrope" => RopeScaling::None,
        "linear" => RopeScaling::Linear { factor },
        "proportional" => RopeScaling::Proportional {
            factor,
            partial_rotary_factor: json_f64(p, "partial_rotary_factor").unwrap_or(1.0),
        },
        "llama3" => RopeScaling::Llama3 {
            factor,
            low_freq_factor: json_f64(p, "low_freq_factor").unwrap_or(1.0),
            high_freq_factor: json_f64(p, "high_freq_factor").unwrap_or(4.0),
            original_max_position_embeddings: need(
                orig,
                path,
                "rope_scaling.original_max_position_embeddings",
            )?,
        },
        "yarn" | "deepseek_yarn" => RopeScaling::Yarn {
            factor,
            beta_fast: json_f64(p, "beta_fast").unwrap_or(32.0),
            beta_slow: json_f64(p, "beta_slow").unwrap_or(1.0),
            mscale: json_f64(p, "mscale").unwrap_or(1.0),
            mscale_all_dim: json_f64(p, "mscale_all_dim").unwrap_or(0.0),
            original_max_position_embeddings: need(
                orig,
                path,
                "rope_scaling.original_max_position_embeddings",
            )?,
            truncate: p
                .get("truncate")
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(true),
            attention_factor: json_f64(p, "attention_factor"),
        },
        // Phi3Config renames the legacy `su` to `longrope` (`convert_rope_params_to_dict`).
        "longrope" | "su" => {
            // transformers gives a top-level `original_max_position_embeddings` priority
            // (`standardize_rope_params`; Phi3Config defaults it and max_position_embeddings
            // to 4096).
            let orig = raw
                .original_max_position_embeddings
                .map(|o| o as f64)
                .or(orig)
                .or(raw.max_position_embeddings.map(|m| m as f64))
                .unwrap_or(4096.0);
            let factors = |key: &str| -> Result<Vec<f64>> {
                let list = p.get(key).and_then(serde_json::Value::as_array);
                list.and_then(|l| l.iter().map(serde_json::Value::as_f64).collect())
                    .ok_or_else(|| {
                        Error::config(
                            path,
                            format!("rope type `longrope` needs `{key}`, a list of numbers"),
                        )
                    })
            };
            let factor = json_f64(p, "factor")
                .unwrap_or(raw.max_position_embeddings.unwrap_or(4096) as f64 / orig);
            let attention_factor = match json_f64(p, "attention_factor") {
                Some(f) => f,
                None if factor <= 1.0 => 1.0,
                None => (1.0 + factor.ln() / orig.ln()).sqrt(),
            };
            RopeScaling::LongRope {
                short_factor: factors("short_factor")?,
                long_factor: factors("long_factor")?,
                original_max_position_embeddings: orig,
                attention_factor,
            }
        }
        other => {
            return Err(Error::config(
                path,
                format!(
                    "rope type `{other}` is not supported (default, linear, llama3, yarn, longrope, \
                     proportional)"
                ),
            ));
        }
    };
    Ok(Rope { theta, scaling })
}

/// Gemma's settings beyond Llama's (`Gemma3TextConfig`, `Gemma4TextConfig`), refusing what the
/// runner does not compute: bidirectional attention (EmbeddingGemma, Gemma-4's `"all"`),
/// Gemma-3's attention-logit softcapping (null in every released Gemma-3), and Gemma-4's
/// settings in [`resolve_gemma4`]. `shape`: (heads, KV heads, head dim) of the sliding layers.
fn resolve_gemma(
    raw: &ConfigFile,
    arch: Arch,
    wrapped: bool,
    shape: (usize, usize, usize),
    sliding: &Option<Vec<bool>>,
    path: &Path,
) -> Result<GemmaConfig> {
    let v4 = arch == Arch::Gemma4;
    match &raw.use_bidirectional_attention {
        None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => {}
        // Gemma-4's "vision": image tokens attend both ways, text causally
        // (`Gemma4Model.forward`); a text-only prompt is causal.
        Some(serde_json::Value::String(s)) if v4 && s == "vision" => {}
        Some(other) => {
            return Err(Error::config(
                path,
                format!(
                    "use_bidirectional_attention {other} is not supported (eagle-check runs \
                     causal targets)"
                ),
            ));
        }
    }
    // `Gemma4TextAttention` has no logit softcap (Gemma4TextConfig has no such key).
    if let (false, Some(cap)) = (v4, raw.attn_logit_softcapping) {
        return Err(Error::config(
            path,
            format!("attn_logit_softcapping {cap} is not supported (Gemma-3 sets it null)"),
        ));
    }
    let name = raw
        .hidden_activation
        .as_deref()
        .or(raw.hidden_act.as_deref())
        .unwrap_or("gelu_pytorch_tanh");
    let act = match name {
        "gelu_pytorch_tanh" => GeluKind::Tanh,
        "gelu" => GeluKind::Erf,
        other => {
            return Err(Error::config(
                path,
                format!("hidden_activation `{other}` is not supported (gelu_pytorch_tanh, gelu)"),
            ));
        }
    };
    let scalar = raw.query_pre_attn_scalar.unwrap_or(256.0);
    if scalar.is_nan() || scalar <= 0.0 {
        return Err(Error::config(
            path,
            format!("query_pre_attn_scalar must be positive, found {scalar}"),
        ));
    }
    let v4 = match (v4, sliding) {
        (true, Some(sliding)) => Some(resolve_gemma4(raw, shape, sliding, path)?),
        _ => None,
    };
    Ok(GemmaConfig {
        local_rope: resolve_gemma_rope(raw, "sliding_attention", 10_000.0, path)?,
        query_pre_attn_scalar: scalar,
        final_logit_softcapping: raw
            .final_logit_softcapping
            .filter(|_| !wrapped || v4.is_some()),
        act,
        v4,
    })
}

/// Gemma-4's layers as `Gemma4TextConfig.__post_init__` fills them in (transformers 5.24),
/// refusing by name what the runner does not compute: the per-layer inputs of the small models
/// (`hidden_size_per_layer_input`, default 256), KV sharing across layers
/// (`num_kv_shared_layers`) and any `per_layer_config` key beyond the attention's shape.
/// `sliding`: each layer's type.
fn resolve_gemma4(
    raw: &ConfigFile,
    (heads, kv_heads, head_dim): (usize, usize, usize),
    sliding: &[bool],
    path: &Path,
) -> Result<Gemma4Layers> {
    let refuse = |what: String| Err(Error::config(path, what));
    if let Some(n) = Some(raw.hidden_size_per_layer_input.unwrap_or(256)).filter(|&n| n > 0) {
        return refuse(format!(
            "hidden_size_per_layer_input {n} is not supported (Gemma-4's per-layer inputs, \
             E2B/E4B; set 0 in the 31B and 26B-A4B configs)"
        ));
    }
    if let Some(n) = raw.num_kv_shared_layers.filter(|&n| n > 0) {
        return refuse(format!(
            "num_kv_shared_layers {n} is not supported (Gemma-4's layers sharing keys and values)"
        ));
    }
    let k_eq_v = raw.attention_k_eq_v.unwrap_or(false);
    let mut head_dims = vec![head_dim; sliding.len()];
    let mut kvs = vec![kv_heads; sliding.len()];
    match &raw.per_layer_config {
        // `__post_init__`: the full layers take `global_head_dim` (512) and, with
        // `attention_k_eq_v`, `num_global_key_value_heads`.
        None => {
            for (l, _) in sliding.iter().enumerate().filter(|(_, s)| !**s) {
                head_dims[l] = raw.global_head_dim.unwrap_or(512);
                kvs[l] = match (k_eq_v, raw.num_global_key_value_heads) {
                    (true, Some(n)) => n,
                    _ => kv_heads,
                };
            }
        }
        Some(layers) => {
            for (key, overrides) in layers {
                let layer = key.parse::<usize>().ok().filter(|&l| l < sliding.len());
                let (Some(l), Some(map)) = (layer, overrides.as_object()) else {
                    return refuse(format!(
                        "per_layer_config: `{key}` is not a layer of {} with its overrides",
                        sliding.len()
                    ));
                };
                for (name, value) in map {
                    let n = value.as_u64().filter(|&n| n > 0).map(|n| n as usize);
                    match (name.as_str(), n) {
                        ("head_dim", Some(n)) => head_dims[l] = within(n, path, "head_dim")?,
                        ("num_key_value_heads", Some(n)) => kvs[l] = n,
                        _ => {
                            return refuse(format!(
                                "per_layer_config.{key}.{name} {value} is not supported \
                                 (head_dim, num_key_value_heads)"
                            ));
                        }
                    }
                }
            }
        }
    }
    // `Gemma4TextRotaryEmbedding` takes one head dim per layer type
    // (`per_layer_config[layer_type]` refuses a type whose layers differ).
    for kind in [true, false] {
        let dims: Vec<usize> = (0..sliding.len())
            .filter(|&l| sliding[l] == kind)
            .map(|l| head_dims[l])
            .collect();
        if dims.windows(2).any(|w| w[0] != w[1]) {
            return refuse(format!(
                "per_layer_config: the {} layers have head dims {dims:?}, one rope needs one",
                if kind { "sliding" } else { "full-attention" }
            ));
        }
    }
    if let Some(l) = (0..kvs.len()).find(|&l| !heads.is_multiple_of(kvs[l])) {
        return refuse(format!(
            "layer {l}: num_attention_heads {heads} is not a multiple of its {} KV heads",
            kvs[l]
        ));
    }
    Ok(Gemma4Layers {
        head_dims,
        kv_heads: kvs,
        k_eq_v,
    })
}

/// One of Gemma-3's two ropes (`Gemma3TextConfig.convert_rope_params_to_dict`): transformers 5
/// nests them in `rope_parameters` by layer type; older files give the full layers'
/// `rope_theta` + `rope_scaling` and the sliding layers' `rope_local_base_freq` (no scaling).
/// `default_theta`: 1e6 global, 1e4 local (`Gemma3TextConfig.default_theta`).
fn resolve_gemma_rope(
    raw: &ConfigFile,
    layer_type: &str,
    default_theta: f64,
    path: &Path,
) -> Result<Rope> {
    let nested = raw
        .rope_parameters
        .as_ref()
        .and_then(|p| p.get(layer_type))
        .filter(|v| v.is_object());
    let legacy_theta = if layer_type == "sliding_attention" {
        raw.rope_local_base_freq
    } else {
        raw.rope_theta
    };
    let one = match nested {
        Some(p) => ConfigFile {
            rope_parameters: Some(p.clone()),
            rope_theta: legacy_theta.or(Some(default_theta)),
            ..ConfigFile::default()
        },
        None if layer_type == "sliding_attention" => ConfigFile {
            rope_theta: legacy_theta.or(Some(default_theta)),
            ..ConfigFile::default()
        },
        None => ConfigFile {
            rope_scaling: raw.rope_scaling.clone(),
            rope_theta: legacy_theta.or(Some(default_theta)),
            max_position_embeddings: raw.max_position_embeddings,
            ..ConfigFile::default()
        },
    };
    resolve_rope(&one, path)
}

/// DeepSeek-V3's multi-head latent attention fields (also GLM-4.7-Flash's).
fn resolve_mla(raw: &ConfigFile, path: &Path) -> Result<MlaConfig> {
    Ok(MlaConfig {
        q_lora_rank: raw.q_lora_rank,
        kv_lora_rank: need(raw.kv_lora_rank, path, "kv_lora_rank")?,
        qk_nope_head_dim: need(raw.qk_nope_head_dim, path, "qk_nope_head_dim")?,
        qk_rope_head_dim: need(raw.qk_rope_head_dim, path, "qk_rope_head_dim")?,
        v_head_dim: need(raw.v_head_dim, path, "v_head_dim")?,
        rope_interleave: raw.rope_interleave.unwrap_or(true),
    })
}

/// FP8 block quantisation (`quantization_config.quant_method: fp8`): its block size. NVIDIA
/// Model-Optimizer's formats (`quant_method: modelopt`, e.g. Gemma-4-31B-IT-NVFP4's `NVFP4`) are
/// refused by name: their packed weights and scales are not read.
fn resolve_fp8(raw: &ConfigFile, path: &Path) -> Result<Option<[usize; 2]>> {
    let method = |q: &serde_json::Value, key: &str| {
        q.get(key)
            .and_then(|m| m.as_str())
            .map(str::to_string)
            .unwrap_or_default()
    };
    if let Some(q) = &raw.quantization_config
        && method(q, "quant_method") == "modelopt"
    {
        return Err(Error::config(
            path,
            format!(
                "quantization_config: modelopt {} weights are not supported (run the \
                 unquantised checkpoint)",
                method(q, "quant_algo")
            ),
        ));
    }
    match &raw.quantization_config {
        Some(q) if q.get("quant_method").and_then(|m| m.as_str()) == Some("fp8") => {
            let block = q.get("weight_block_size").and_then(|b| b.as_array());
            match block.map(|b| b.iter().filter_map(|x| x.as_u64()).collect::<Vec<_>>()) {
                Some(b) if b.len() == 2 && b[0] > 0 && b[1] > 0 => {
                    Ok(Some([b[0] as usize, b[1] as usize]))
                }
                _ => Err(Error::config(
                    path,
                    "quantization_config: fp8 without a two-entry weight_block_size",
                )),
            }
        }
        _ => Ok(None),
    }
}

/// Which layers use the sliding window: `layer_types` where the family reads it (gpt-oss,
/// Qwen2-MoE), else every layer (`None`). gpt-oss without `layer_types` alternates, sliding
/// first (`GptOssConfig.__post_init__`); Qwen2-MoE's default marks the even layers below
/// `max_window_layers` when `use_sliding_window` (`Qwen2MoeConfig.__post_init__`).
fn resolve_sliding_layers(
    arch: Arch,
    raw: &ConfigFile,
    layers: usize,
    path: &Path,
) -> Result<Option<Vec<bool>>> {
    if !matches!(
        arch,
        Arch::GptOss | Arch::Qwen2Moe | Arch::Gemma3 | Arch::Gemma4
    ) {
        return Ok(None);
    }
    let listed = match &raw.layer_types {
        Some(types) => types
            .iter()
            .map(|t| match t.as_str() {
                "sliding_attention" => Ok(true),
                "full_attention" => Ok(false),
                other => Err(Error::config(
                    path,
                    format!("layer_types: `{other}` is not supported (sliding_attention, full_attention)"),
                )),
            })
            .collect::<Result<Vec<bool>>>()?,
        None if arch == Arch::GptOss => (0..layers).map(|i| i % 2 == 0).collect(),
        // Gemma3TextConfig.__post_init__: every `sliding_window_pattern`-th layer (default 6)
        // is full, the others slide.
        None if arch == Arch::Gemma3 => {
            let every = raw.sliding_window_pattern.unwrap_or(6).max(1);
            (0..layers).map(|i| (i + 1) % every != 0).collect()
        }
        // Gemma4TextConfig.__post_init__: every 6th layer full.
        None if arch == Arch::Gemma4 => (0..layers).map(|i| (i + 1) % 6 != 0).collect(),
        None => {
            let max = raw.max_window_layers.unwrap_or(28);
            let on = raw.use_sliding_window.unwrap_or(false);
            (0..layers).map(|i| on && i % 2 == 0 && i < max).collect()
        }
    };
    if listed.len() < layers {
        return Err(Error::config(
            path,
            format!(
                "layer_types lists {} layers, num_hidden_layers is {layers}",
                listed.len()
            ),
        ));
    }
    let mut listed = listed;
    if arch == Arch::Gemma4 {
        // `Gemma4TextConfig.__post_init__` forces the last layer to full attention.
        listed.truncate(layers);
        if let Some(last) = listed.last_mut() {
            *last = false;
        }
    }
    Ok(Some(listed))
}

/// How many leading dims of each head rope rotates: `partial_rotary_factor` (in
/// `rope_parameters` or at the top level; GLM-4.5 defaults it to 0.5,
/// `Glm4MoeConfig.__post_init__`) or MiniMax-M2's legacy `rotary_dim`
/// (`MiniMaxM2Config.convert_rope_params_to_dict`). transformers takes
/// `int(head_dim * partial_rotary_factor)` (`_compute_default_rope_parameters`).
fn resolve_rotary_dim(arch: Arch, raw: &ConfigFile, head_dim: usize, path: &Path) -> Result<usize> {
    let in_params = raw
        .rope_parameters
        .as_ref()
        .or(raw.rope_scaling.as_ref())
        .and_then(|p| json_f64(p, "partial_rotary_factor"));
    let factor = match (in_params.or(raw.partial_rotary_factor), raw.rotary_dim) {
        (Some(f), _) => f,
        (None, Some(d)) if arch == Arch::MiniMaxM2 => d as f64 / head_dim as f64,
        (None, _) if arch == Arch::Glm4Moe => 0.5,
        // `Qwen3_5MoeTextConfig.__post_init__` and `Qwen3NextConfig.__post_init__`:
        // `kwargs.setdefault("partial_rotary_factor", 0.25)`.
        (None, _) if matches!(arch, Arch::Qwen35Moe | Arch::Qwen3Next) => 0.25,
        _ => 1.0,
    };
    let dim = (head_dim as f64 * factor) as usize;
    if dim == 0 || dim > head_dim || !dim.is_multiple_of(2) {
        return Err(Error::config(
            path,
            format!(
                "rope rotates {dim} of {head_dim} head dims (partial_rotary_factor {factor}): \
                 it must be even and in 2..={head_dim}"
            ),
        ));
    }
    Ok(dim)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// M-RoPE on a text-only prompt is the default rope (the three position rows coincide):
    /// SpecForge's Qwen2.5-VL draft writes `type: mrope`, transformers 5 `rope_type: default`
    /// with `mrope_section`; both resolve, with the same theta. A rope type nobody defined is
    /// still refused, by name.
    /// The gate needs only L, H and the family: a config naming its class but no `model_type`
    /// gates as that class's family; one naming neither is refused, saying what is missing.
    #[test]
    fn a_target_config_without_model_type_gates_by_its_class() {
        let path = Path::new("config.json");
        let raw: ConfigFile = serde_json::from_str(
            r#"{"architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 26, "hidden_size": 1152}"#,
        )
        .unwrap();
        let t = TargetInfo::resolve(&raw, path).unwrap();
        assert_eq!(
            (t.family.name.as_str(), t.model_type.as_str()),
            ("gemma3", "gemma3")
        );
        let raw: ConfigFile =
            serde_json::from_str(r#"{"num_hidden_layers": 26, "hidden_size": 1152}"#).unwrap();
        let err = TargetInfo::resolve(&raw, path).unwrap_err().to_string();
        assert!(err.contains("`model_type`"), "{err}");
    }

    /// Gemma-3's two ropes as transformers reads them (`convert_rope_params_to_dict`): a legacy
    /// `rope_scaling` (Gemma-3-4B's linear x8) is the full layers' only, the sliding layers keep
    /// `rope_local_base_freq` unscaled; transformers 5 nests both by layer type.
    #[test]
    fn gemma3_ropes_resolve_per_layer_type() {
        let path = Path::new("config.json");
        for json in [
            r#"{"rope_theta": 1000000, "rope_local_base_freq": 10000,
                "rope_scaling": {"rope_type": "linear", "factor": 8.0}}"#,
            r#"{"rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000}}}"#,
        ] {
            let raw: ConfigFile = serde_json::from_str(json).unwrap();
            let full = resolve_gemma_rope(&raw, "full_attention", 1e6, path).unwrap();
            let local = resolve_gemma_rope(&raw, "sliding_attention", 1e4, path).unwrap();
            assert_eq!(full.scaling, RopeScaling::Linear { factor: 8.0 }, "{json}");
            assert_eq!((full.theta, local.theta), (1e6, 1e4), "{json}");
            assert_eq!(local.scaling, RopeScaling::None, "{json}");
        }
        // Neither base written: Gemma3TextConfig's defaults, 1e6 global and 1e4 local.
        let raw = ConfigFile::default();
        let full = resolve_gemma_rope(&raw, "full_attention", 1e6, path).unwrap();
        let local = resolve_gemma_rope(&raw, "sliding_attention", 1e4, path).unwrap();
        assert_eq!((full.theta, local.theta), (1e6, 1e4));
    }

    #[test]
    fn mrope_resolves_as_the_default_rope_for_text() {
        let path = Path::new("config.json");
        for json in [
            r#"{"rope_theta": 1000000, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}}"#,
            r#"{"rope_parameters": {"rope_type": "default", "rope_theta": 1000000, "mrope_section": [16, 24, 24]}}"#,
        ] {
            let raw: ConfigFile = serde_json::from_str(json).unwrap();
            let rope = resolve_rope(&raw, path).unwrap();
            assert_eq!(rope.scaling, RopeScaling::None, "{json}");
            assert_eq!(rope.theta, 1_000_000.0, "{json}");
        }
        let raw: ConfigFile =
            serde_json::from_str(r#"{"rope_scaling": {"type": "spiral"}}"#).unwrap();
        let err = resolve_rope(&raw, path).unwrap_err().to_string();
        assert!(err.contains("`spiral`"), "{err}");
    }
}
