//! Gemma-4's attention (`gemma4_text`, `Gemma4ForCausalLM`, and the text model of the `gemma4`
//! wrapper, `Gemma4ForConditionalGeneration`, its weights under `model.language_model.*`), run
//! on text through `model::gemma`'s decoder: the layer is Gemma-3's sandwich with `w` norms and
//! a `layer_scalar`, its attention is loaded here.
//!
//! Reference: transformers 5.24 `models/gemma4/modeling_gemma4.py`.
//! - `Gemma4RMSNorm`: `norm(x) * w` in f32 (not Gemma-3's `1 + w`), every norm of a layer, q/k
//!   and the final one; `with_scale=False` (the values' `v_norm`) has no weight: ones here.
//! - `Gemma4TextAttention`: each layer's head dim and KV heads from `per_layer_config`
//!   ([`crate::config::Gemma4Layers`]: the full-attention layers' `global_head_dim`); q/k/v/o
//!   biased with `attention_bias`; q and k normalised per head then rotated (rotate-half over
//!   the whole head), v normalised per head without a weight; with `attention_k_eq_v` a full
//!   layer has no `v_proj` and its values are the key projection's output before `k_norm`
//!   (`value_states = key_states` before the norms); softmax scale 1 (`self.scaling = 1.0`).
//! - `Gemma4TextRotaryEmbedding`: one rope per layer type, over that type's head dim
//!   (`config.per_layer_config[layer_type]`): the full layers' `proportional`
//!   (`_compute_proportional_rope_parameters`, [`crate::config::RopeScaling::Proportional`]),
//!   the sliding layers' default.
//! - `Gemma4TextDecoderLayer.forward`: Gemma-3's layer, then `hidden_states *= layer_scalar`
//!   (a stored `[1]` buffer); `Gemma4TextScaledWordEmbedding` (sqrt(H) as Gemma-3's),
//!   `Gemma4ForCausalLM.forward` and `Gemma4ForConditionalGeneration.forward` (both softcap the
//!   logits with `final_logit_softcapping`): `model::gemma`.
//!
//! - `Gemma4TextDecoderLayer.forward` with `enable_moe_block` ([`Gemma4Moe`]): the dense
//!   MLP's output through `post_feedforward_layernorm_1`, plus the experts' through
//!   `post_feedforward_layernorm_2`, both before `post_feedforward_layernorm`; the experts read
//!   `pre_feedforward_layernorm_2(residual)`, the router (`Gemma4TextRouter`) its own input:
//!   the residual RMS-normalised without a weight, times `router.scale`, times `H^-0.5`, then
//!   `router.proj`, a softmax top-k renormalised and each weight times the expert's
//!   `per_expert_scale` ([`crate::model::moe::GEMMA4_NAMES`]); GELU-tanh experts.
//!
//! What the runner does not compute (per-layer inputs, KV sharing) is refused when the config
//! is read ([`crate::config::Gemma4Layers`]).

use crate::config::{Gemma4Layers, ModelConfig};
use crate::error::{CandleContext, Result};
use crate::model::ComputePath;
use crate::model::llama::{Attention, AttnShape};
use crate::model::moe::{GEMMA4_NAMES, MoeBlock, routing_extras};
use crate::model::nn::{Linear, RmsNorm};
use crate::model::source::Vb;
use candle_core::{DType, Tensor};

/// The head dims the full layers' and the sliding layers' ropes span (each type's own; a
/// model without one of the types gets the base head dim for it).
pub(crate) fn rope_dims(cfg: &ModelConfig, v4: &Gemma4Layers) -> (usize, usize) {
    let of = |full: bool| {
        (0..cfg.num_layers)
            .find(|&l| (cfg.window_of(l).is_none()) == full)
            .map_or(cfg.head_dim, |l| v4.head_dims[l])
    };
    (of(true), of(false))
}

/// Layer `i`'s attention (`Gemma4TextAttention.__init__`).
pub(crate) fn load_attention(
    cfg: &ModelConfig,
    v4: &Gemma4Layers,
    a: &Vb,
    i: usize,
    dtype: DType,
) -> Result<Attention> {
    let (h, nh, eps) = (cfg.hidden_size, cfg.num_heads, cfg.rms_norm_eps);
    let (hd, nkv) = (v4.head_dims[i], v4.kv_heads[i]);
    let window = cfg.window_of(i);
    let bias = cfg.attention_bias;
    let q = Linear::load(&a.pp("q_proj"), nh * hd, h, bias)?;
    let k = Linear::load(&a.pp("k_proj"), nkv * hd, h, bias)?;
    // `use_alternative_attention = attention_k_eq_v and not is_sliding`: no `v_proj`, the
    // values are the keys' projection (then `v_norm`, where the keys take `k_norm` and rope).
    let v = match (v4.k_eq_v, window) {
        (true, None) => k.clone(),
        _ => Linear::load(&a.pp("v_proj"), nkv * hd, h, bias)?,
    };
    let o = Linear::load(&a.pp("o_proj"), h, nh * hd, cfg.o_bias)?;
    let ones = Tensor::ones(hd, dtype, &a.device).ctx(|| a.path("v_norm (no weight)"))?;
    let norms = [
        Some(RmsNorm::load(&a.pp("q_norm"), hd, eps)?),
        Some(RmsNorm::load(&a.pp("k_norm"), hd, eps)?),
        Some(RmsNorm { weight: ones, eps }),
    ];
    let shape = AttnShape {
        heads: nh,
        kv_heads: nkv,
        head_dim: hd,
        window,
        scale: 1.0,
    };
    Ok(Attention::with_shape([q, k, v, o], norms, shape))
}

/// A weightless RMSNorm (`Gemma4RMSNorm(with_scale=False)`) over `size`.
fn unweighted(vb: &Vb, size: usize, eps: f64, dtype: DType) -> Result<RmsNorm> {
    let weight = Tensor::ones(size, dtype, &vb.device).ctx(|| vb.path("norm (no weight)"))?;
    Ok(RmsNorm { weight, eps })
}

/// Gemma-4's MoE block beside a layer's dense MLP (`enable_moe_block`).
pub(crate) struct Gemma4Moe {
    block: MoeBlock,
    /// The router's input: `norm(residual) * scale * H^-0.5`.
    router_norm: RmsNorm,
    /// `router.scale` [H].
    router_scale: Tensor,
    root: f64,
    pre_experts: RmsNorm,
    post_mlp: RmsNorm,
    post_experts: RmsNorm,
}

impl Gemma4Moe {
    /// Layer `l`'s block, `None` without `enable_moe_block`.
    pub(crate) fn load(cfg: &ModelConfig, l: &Vb, dtype: DType) -> Result<Option<Gemma4Moe>> {
        let Some(moe) = &cfg.moe else {
            return Ok(None);
        };
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let norm = |name: &str| RmsNorm::load(&l.pp(name), h, eps);
        Ok(Some(Gemma4Moe {
            block: MoeBlock::load(cfg, moe, l, &GEMMA4_NAMES)?,
            router_norm: unweighted(l, h, eps, dtype)?,
            router_scale: l.get("router.scale", &[h])?,
            root: (h as f64).powf(-0.5),
            pre_experts: norm("pre_feedforward_layernorm_2")?,
            post_mlp: norm("post_feedforward_layernorm_1")?,
            post_experts: norm("post_feedforward_layernorm_2")?,
        }))
    }

    /// `residual` [T, H] (the stream after attention), `mlp` [T, H] (the dense MLP's output) ->
    /// the sum `post_feedforward_layernorm` takes, and layer `i`'s routing extras.
    pub(crate) fn forward(
        &self,
        i: usize,
        path: ComputePath,
        residual: &Tensor,
        mlp: &Tensor,
    ) -> candle_core::Result<(Tensor, Vec<(String, Tensor)>)> {
        let router_in = (self
            .router_norm
            .forward(residual)?
            .broadcast_mul(&self.router_scale)?
            * self.root)?;
        let experts_in = self.pre_experts.forward(residual)?;
        let (experts, routing) = self.block.forward_on(path, &router_in, &experts_in)?;
        let sum = (self.post_mlp.forward(mlp)? + self.post_experts.forward(&experts)?)?;
        Ok((sum, routing_extras(i, Some(routing))))
    }
}
