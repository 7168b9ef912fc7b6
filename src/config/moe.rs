//! The mixture-of-experts settings of every MoE family, resolved from `config.json` into one
//! [`MoeConfig`]: the routing ([`Routing`]), the experts' shape and activation, the shared
//! experts, and which layers are sparse. Each family's keys and defaults are transformers 5.24's
//! (`models/<family>/configuration_<family>.py`), cited where they are read.

use super::{Arch, ConfigFile, need};
use crate::error::{Error, Result};
use crate::routing::{Routing, Scoring};
use std::path::Path;

/// Which decoder layers hold the experts (the others a dense MLP).
#[derive(Debug, Clone, PartialEq)]
pub enum MoeLayers {
    /// DeepSeek-V3 / GLM-4.5: layer `i` is sparse when `i >= first_k_dense_replace` and
    /// `i % moe_layer_freq == 0`.
    FirstDense { first_k_dense: usize, freq: usize },
    /// Qwen2/3-MoE: sparse unless listed in `mlp_only_layers`, and only when
    /// `(i + 1) % decoder_sparse_step == 0` (`Qwen3MoeDecoderLayer.__init__`).
    SparseStep { step: usize, mlp_only: Vec<usize> },
    /// GLM-4.7-Flash (`glm4_moe_lite`): `mlp_layer_types`, one `dense` / `sparse` per layer.
    Listed(Vec<bool>),
    /// gpt-oss, MiniMax-M2: every layer.
    All,
}

/// The routed experts' activation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertsAct {
    /// `down(silu(gate(x)) * up(x))`.
    SiluMul,
    /// Gemma-4 (`Gemma4TextExperts`, `hidden_activation` `gelu_pytorch_tanh`):
    /// `down(gelu_tanh(gate(x)) * up(x))`.
    GeluTanhMul,
    /// gpt-oss (`GptOssExperts._apply_gate`): `gate = min(gate, limit)`,
    /// `up = clamp(up, -limit, limit)`, `(up + 1) * gate * sigmoid(alpha * gate)`, with biases
    /// on both projections.
    ClampedSwiglu { alpha: f32, limit: f32 },
}

/// One MoE family's experts, as the forward reads them.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub n_routed_experts: usize,
    pub routing: Routing,
    /// Each routed expert's intermediate width.
    pub moe_intermediate_size: usize,
    /// The shared experts' total intermediate width (0: none). DeepSeek and GLM:
    /// `n_shared_experts * moe_intermediate_size` as one MLP; Qwen2-MoE:
    /// `shared_expert_intermediate_size`.
    pub shared_intermediate: usize,
    /// Qwen2-MoE: the shared expert's output times `sigmoid(shared_expert_gate(x))`.
    pub shared_gate: bool,
    pub layers: MoeLayers,
    pub act: ExpertsAct,
    /// Llama-4: each routed expert takes its input already scaled by its router weight
    /// (`Llama4TextMoe.forward`: `routed_in = hidden_states * router_scores`), and its output
    /// is summed unweighted; everywhere else the weight scales the expert's output.
    pub weights_on_input: bool,
}

impl MoeConfig {
    /// Whether decoder layer `layer` holds the experts.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        match &self.layers {
            MoeLayers::FirstDense {
                first_k_dense,
                freq,
            } => layer >= *first_k_dense && layer.is_multiple_of((*freq).max(1)),
            MoeLayers::SparseStep { step, mlp_only } => {
                !mlp_only.contains(&layer) && (layer + 1).is_multiple_of((*step).max(1))
            }
            MoeLayers::Listed(sparse) => sparse.get(layer).copied().unwrap_or(false),
            MoeLayers::All => true,
        }
    }

    /// Experts per token.
    pub fn k(&self) -> usize {
        self.routing.k
    }
}

fn bad(path: &Path, msg: String) -> Error {
    Error::config(path, msg)
}

/// The scoring function a config names (`scoring_func`), or the family's own.
fn scoring(raw: &ConfigFile, path: &Path, default: Scoring) -> Result<Scoring> {
    match raw.scoring_func.as_deref() {
        None => Ok(default),
        Some("sigmoid") => Ok(Scoring::Sigmoid),
        Some("softmax") => Ok(Scoring::Softmax),
        Some(f) => Err(bad(
            path,
            format!("scoring_func `{f}` is not supported (sigmoid, softmax)"),
        )),
    }
}

/// The checks every family's routing must pass before a weight is read.
fn checked(moe: MoeConfig, path: &Path) -> Result<MoeConfig> {
    if let Some(problem) = moe.routing.problem(moe.n_routed_experts) {
        return Err(bad(path, format!("MoE routing: {problem}")));
    }
    if moe.moe_intermediate_size == 0 {
        return Err(bad(
            path,
            "MoE experts with an intermediate size of 0".into(),
        ));
    }
    Ok(moe)
}

/// The MoE settings of `arch`'s config, `None` for a dense one.
pub(super) fn resolve(arch: Arch, raw: &ConfigFile, path: &Path) -> Result<Option<MoeConfig>> {
    let moe = match arch {
        Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 | Arch::Phi3 | Arch::Gemma3 => {
            return Ok(None);
        }
        Arch::Gemma4 if raw.enable_moe_block != Some(true) => return Ok(None),
        Arch::Gemma4 => gemma4(raw, path)?,
        Arch::Llama4 => llama4(raw, path)?,
        Arch::Qwen35Moe => qwen35(raw, path)?,
        Arch::DeepseekV3 | Arch::Glm4Moe | Arch::Glm4MoeLite => match raw.n_routed_experts {
            Some(n) if n > 0 => deepseek_style(arch, raw, path, n)?,
            _ => return Ok(None),
        },
        Arch::Qwen3Moe | Arch::Qwen2Moe | Arch::Qwen3VlMoe | Arch::Qwen3Next => {
            // `Qwen3MoeConfig.num_experts` defaults to 128, `Qwen2MoeConfig`'s and
            // `Qwen3VLMoeTextConfig`'s to 60, `Qwen3NextConfig`'s to 512; 0 is a dense model
            // (`Qwen3MoeDecoderLayer.__init__`: `config.num_experts > 0`). transformers 5
            // writes it as `num_local_experts` (its `attribute_map`).
            let n = raw
                .num_experts
                .or(raw.num_local_experts)
                .unwrap_or(match arch {
                    Arch::Qwen3Moe => 128,
                    Arch::Qwen3Next => 512,
                    _ => 60,
                });
            if n == 0 {
                return Ok(None);
            }
            qwen_style(arch, raw, path, n)?
        }
        // `MiniMaxM2Config`: num_local_experts (alias num_experts), the experts' width is
        // `intermediate_size`; `MiniMaxM2TopKRouter` renormalises always.
        Arch::MiniMaxM2 => every_layer(
            raw,
            path,
            Scoring::Sigmoid,
            raw.num_experts_per_tok,
            ExpertsAct::SiluMul,
        )?,
        // `GptOssConfig`: num_local_experts, num_experts_per_tok (the released config also
        // writes `experts_per_token`), swiglu_limit 7.0; `GptOssExperts.alpha` is 1.702
        // (`swiglu_alpha`). Its router's softmax over the top k is a renormalised softmax.
        Arch::GptOss => every_layer(
            raw,
            path,
            Scoring::Softmax,
            raw.num_experts_per_tok.or(raw.experts_per_token),
            ExpertsAct::ClampedSwiglu {
                alpha: raw.swiglu_alpha.unwrap_or(1.702) as f32,
                limit: raw.swiglu_limit.unwrap_or(7.0) as f32,
            },
        )?,
    };
    checked(moe, path).map(Some)
}

/// MiniMax-M2 and gpt-oss: experts in every layer, `num_local_experts` of `intermediate_size`
/// each, plain top-k renormalised, no shared expert. `scoring_func` may override `default`.
fn every_layer(
    raw: &ConfigFile,
    path: &Path,
    default: Scoring,
    k: Option<usize>,
    act: ExpertsAct,
) -> Result<MoeConfig> {
    Ok(MoeConfig {
        n_routed_experts: need(
            raw.num_local_experts.or(raw.num_experts),
            path,
            "num_local_experts",
        )?,
        routing: Routing::top_k(
            scoring(raw, path, default)?,
            need(k, path, "num_experts_per_tok")?,
            true,
        ),
        moe_intermediate_size: need(raw.intermediate_size, path, "intermediate_size")?,
        shared_intermediate: 0,
        shared_gate: false,
        layers: MoeLayers::All,
        act,
        weights_on_input: false,
    })
}

/// DeepSeek-V3, Kimi-K2, GLM-4.5 and GLM-4.7-Flash: grouped sigmoid routing with a correction
/// bias (`DeepseekV3TopkRouter`, `Glm4MoeTopkRouter`), shared experts, dense first layers.
fn deepseek_style(arch: Arch, raw: &ConfigFile, path: &Path, n: usize) -> Result<MoeConfig> {
    let n_group = raw.n_group.unwrap_or(1).max(1);
    if !n.is_multiple_of(n_group) {
        return Err(bad(
            path,
            format!("n_routed_experts {n} is not a multiple of n_group {n_group}"),
        ));
    }
    let inter = need(raw.moe_intermediate_size, path, "moe_intermediate_size")?;
    let layers = match (arch, &raw.mlp_layer_types) {
        (Arch::Glm4MoeLite, Some(types)) => MoeLayers::Listed(
            types
                .iter()
                .map(|t| match t.as_str() {
                    "sparse" => Ok(true),
                    "dense" => Ok(false),
                    other => Err(bad(
                        path,
                        format!("mlp_layer_types: `{other}` is neither `dense` nor `sparse`"),
                    )),
                })
                .collect::<Result<_>>()?,
        ),
        // `Glm4MoeLiteConfig.__post_init__`: dense first, then sparse.
        (Arch::Glm4MoeLite, None) => MoeLayers::FirstDense {
            first_k_dense: 1,
            freq: 1,
        },
        _ => MoeLayers::FirstDense {
            // `Glm4MoeConfig.first_k_dense_replace` defaults to 1, DeepSeek-V3's to 3; a
            // DeepSeek config without the key is a V2-style one with none dense.
            first_k_dense: raw
                .first_k_dense_replace
                .unwrap_or(if arch == Arch::Glm4Moe { 1 } else { 0 }),
            freq: raw.moe_layer_freq.unwrap_or(1),
        },
    };
    Ok(MoeConfig {
        n_routed_experts: n,
        routing: Routing {
            scoring: scoring(raw, path, Scoring::Sigmoid)?,
            k: need(raw.num_experts_per_tok, path, "num_experts_per_tok")?,
            n_group,
            topk_group: raw.topk_group.unwrap_or(n_group),
            norm_topk: raw.norm_topk_prob.unwrap_or(true),
            scaling: raw.routed_scaling_factor.unwrap_or(1.0),
        },
        moe_intermediate_size: inter,
        shared_intermediate: inter * raw.n_shared_experts.unwrap_or(0),
        shared_gate: false,
        layers,
        act: ExpertsAct::SiluMul,
        weights_on_input: false,
    })
}

/// Qwen3-MoE, Qwen2-MoE, Qwen3-VL-MoE's tower and Qwen3-Next: softmax top-k (Qwen2/3-MoE's
/// configs default `norm_topk_prob` to false, Qwen3's released configs set it true;
/// `Qwen3NextConfig` defaults it to true; `Qwen3VLMoeTextTopKRouter` renormalises whatever the
/// config says). Qwen2-MoE and Qwen3-Next add a shared expert behind its sigmoid gate
/// (`Qwen2MoeSparseMoeBlock`, `Qwen3NextSparseMoeBlock`).
fn qwen_style(arch: Arch, raw: &ConfigFile, path: &Path, n: usize) -> Result<MoeConfig> {
    let shared = match arch {
        Arch::Qwen2Moe => raw.shared_expert_intermediate_size.unwrap_or(0),
        Arch::Qwen3Next => raw.shared_expert_intermediate_size.unwrap_or(512),
        _ => 0,
    };
    let norm_topk = match arch {
        Arch::Qwen3VlMoe => true,
        Arch::Qwen3Next => raw.norm_topk_prob.unwrap_or(true),
        _ => raw.norm_topk_prob.unwrap_or(false),
    };
    Ok(MoeConfig {
        n_routed_experts: n,
        routing: Routing::top_k(
            Scoring::Softmax,
            need(raw.num_experts_per_tok, path, "num_experts_per_tok")?,
            norm_topk,
        ),
        moe_intermediate_size: need(raw.moe_intermediate_size, path, "moe_intermediate_size")?,
        shared_intermediate: shared,
        shared_gate: shared > 0,
        layers: MoeLayers::SparseStep {
            step: raw.decoder_sparse_step.unwrap_or(1),
            mlp_only: raw.mlp_only_layers.clone().unwrap_or_default(),
        },
        act: ExpertsAct::SiluMul,
        weights_on_input: false,
    })
}

/// Llama-4 (`Llama4TextConfig`, transformers 5.24): `num_local_experts` (16) routed experts of
/// `intermediate_size` and one shared expert as wide (`Llama4TextMoe`: `Llama4TextMLP(config)`),
/// `Llama4Router`: top-k (`num_experts_per_tok`, 1) of the raw logits, each weight the sigmoid
/// of its logit, unnormalised; the experts in `moe_layers`, else every
/// `interleave_moe_layer_step`-th layer from `step - 1` (`__post_init__`).
fn llama4(raw: &ConfigFile, path: &Path) -> Result<MoeConfig> {
    let layers = need(raw.num_hidden_layers, path, "num_hidden_layers")?;
    let listed = match &raw.moe_layers {
        Some(l) => l.clone(),
        None => {
            let step = raw.interleave_moe_layer_step.unwrap_or(1).max(1);
            (step - 1..layers).step_by(step).collect()
        }
    };
    if let Some(bad_layer) = listed.iter().find(|&&l| l >= layers) {
        return Err(bad(
            path,
            format!("moe_layers lists layer {bad_layer}, the model has {layers}"),
        ));
    }
    let inter = need(raw.intermediate_size, path, "intermediate_size")?;
    Ok(MoeConfig {
        n_routed_experts: raw.num_local_experts.unwrap_or(16),
        routing: Routing::top_k(
            Scoring::Sigmoid,
            raw.num_experts_per_tok.unwrap_or(1),
            false,
        ),
        moe_intermediate_size: inter,
        shared_intermediate: inter,
        shared_gate: false,
        layers: MoeLayers::Listed((0..layers).map(|l| listed.contains(&l)).collect()),
        act: ExpertsAct::SiluMul,
        weights_on_input: true,
    })
}

/// Qwen3.5-MoE (`Qwen3_5MoeTextConfig`, `Qwen3_5MoeSparseMoeBlock`, transformers 5.24): every
/// layer sparse; `Qwen3_5MoeTopKRouter` is a softmax top-k always renormalised; a shared expert
/// of `shared_expert_intermediate_size` behind its sigmoid `shared_expert_gate`.
fn qwen35(raw: &ConfigFile, path: &Path) -> Result<MoeConfig> {
    let _ = path;
    let shared = raw.shared_expert_intermediate_size.unwrap_or(512);
    Ok(MoeConfig {
        n_routed_experts: raw.num_experts.or(raw.num_local_experts).unwrap_or(256),
        routing: Routing::top_k(Scoring::Softmax, raw.num_experts_per_tok.unwrap_or(8), true),
        moe_intermediate_size: raw.moe_intermediate_size.unwrap_or(512),
        shared_intermediate: shared,
        shared_gate: shared > 0,
        layers: MoeLayers::All,
        act: ExpertsAct::SiluMul,
        weights_on_input: false,
    })
}

/// Gemma-4's MoE block (`Gemma4TextConfig.enable_moe_block`, transformers 5.24
/// `Gemma4TextRouter`, `Gemma4TextExperts`): in every layer beside the dense MLP,
/// `num_experts` experts of `moe_intermediate_size` (the published 5.5 configs write
/// `expert_intermediate_size`, which 5.24 does not read: taken when the other is absent), a
/// softmax top-`top_k_experts` renormalised (each weight then times the expert's
/// `per_expert_scale`, [`crate::model::moe`]), GELU-tanh experts; no shared expert.
fn gemma4(raw: &ConfigFile, path: &Path) -> Result<MoeConfig> {
    let act = raw
        .hidden_activation
        .as_deref()
        .unwrap_or("gelu_pytorch_tanh");
    if act != "gelu_pytorch_tanh" {
        return Err(bad(
            path,
            format!(
                "enable_moe_block with hidden_activation `{act}` is not supported (gelu_pytorch_tanh)"
            ),
        ));
    }
    let inter = raw.moe_intermediate_size.or(raw.expert_intermediate_size);
    Ok(MoeConfig {
        n_routed_experts: need(raw.num_experts, path, "num_experts")?,
        routing: Routing::top_k(
            Scoring::Softmax,
            need(raw.top_k_experts, path, "top_k_experts")?,
            true,
        ),
        moe_intermediate_size: need(inter, path, "moe_intermediate_size")?,
        shared_intermediate: 0,
        shared_gate: false,
        layers: MoeLayers::All,
        act: ExpertsAct::GeluTanhMul,
        weights_on_input: false,
    })
}
