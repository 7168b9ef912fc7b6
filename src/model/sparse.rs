//! The grouped-query-attention MoE families: Qwen3-MoE, Qwen2-MoE, MiniMax-M2, GLM-4.5,
//! gpt-oss and Qwen3-VL-MoE's text tower. Each layer is `x + attn(norm(x))`, then `+ ffn(norm(.))` with the FFN dense or
//! sparse ([`MoeBlock`]) as the config says; what differs between the families is data the
//! config resolves (q/k norm, partial rotary, biases, windows, sinks, the routing, the experts'
//! activation) and where each family keeps its MoE tensors ([`MoeNames`]).
//!
//! References, transformers 5.24 (`models/<family>/modeling_<family>.py`):
//! - Qwen3-MoE `Qwen3MoeAttention` (per-head q/k RMSNorm before rope, o_proj biased with
//!   `attention_bias`), `Qwen3MoeDecoderLayer` (sparse unless in `mlp_only_layers`, every
//!   `decoder_sparse_step`-th layer), `Qwen3MoeTopKRouter` (softmax top-k).
//! - Qwen3-VL-MoE `Qwen3VLMoeTextDecoderLayer` (Qwen3-MoE's layer; on text the M-RoPE sections
//!   coincide, [`crate::config::resolve_rope`]), `Qwen3VLMoeTextTopKRouter` (softmax top-k,
//!   always renormalised), `Qwen3VLMoeTextExperts` (fused experts, stored either way:
//!   [`crate::model::moe::QWEN_VL_NAMES`]).
//! - Qwen2-MoE `Qwen2MoeAttention` (q/k/v biased with `qkv_bias`, a window on the
//!   `layer_types` sliding layers), `Qwen2MoeSparseMoeBlock` (the shared expert times
//!   `sigmoid(shared_expert_gate(x))`, added to the routed sum).
//! - MiniMax-M2 `MiniMaxM2Attention` (q_norm/k_norm over the whole projection, before the head
//!   split; rope on the first `rotary_dim` dims), `MiniMaxM2TopKRouter` (sigmoid, correction
//!   bias, renormalised).
//! - GLM-4.5 `Glm4MoeAttention` (q/k/v biased with `attention_bias`, o_proj never; optional
//!   per-head q/k norm; `apply_rotary_pos_emb` rotate-half on the first
//!   `head_dim * partial_rotary_factor` dims), `Glm4MoeTopkRouter` (DeepSeek's `noaux_tc`),
//!   `Glm4MoeDecoderLayer` (dense below `first_k_dense_replace`), `Glm4MoeMoE` (shared experts).
//! - gpt-oss `GptOssAttention` (q/k/v/o biased, `sinks`, a window on the sliding layers of
//!   `layer_types`), `_apply_rotary_emb` (rotate-half on the halves), `GptOssTopKRouter`
//!   (biased logits, softmax over the top k), `GptOssExperts` (clamped SwiGLU with biases).
//!
//! The boundaries are HF's: `b = 0` the embedding, `b = i + 1` the residual stream after layer
//! `i`, `b = L` after the final norm.

use crate::config::{Arch, ModelConfig};
use crate::error::{CandleContext, Error, Result};
use crate::model::llama::{Attention, Packed, RopeCache};
use crate::model::moe::{
    DEEPSEEK_NAMES, Ffn, GPT_OSS_NAMES, MINIMAX_NAMES, MoeBlock, MoeNames, QWEN_NAMES,
    QWEN_VL_NAMES, residual_step,
};
use crate::model::nn::{Mlp, RmsNorm, RopeTables, causal_mask};
use crate::model::source::Vb;
use crate::model::{ComputePath, Decoder, LayerStep};
use candle_core::{DType, Device, Tensor};

pub(crate) struct Layer {
    input_norm: RmsNorm,
    attn: Attention,
    post_norm: RmsNorm,
    ffn: Ffn,
}

/// Where `arch` keeps its MoE tensors.
fn names(arch: Arch) -> &'static MoeNames {
    match arch {
        Arch::Qwen3Moe | Arch::Qwen2Moe => &QWEN_NAMES,
        Arch::Qwen3VlMoe => &QWEN_VL_NAMES,
        Arch::MiniMaxM2 => &MINIMAX_NAMES,
        Arch::GptOss => &GPT_OSS_NAMES,
        _ => &DEEPSEEK_NAMES,
    }
}

impl Layer {
    fn load(cfg: &ModelConfig, m: &Vb, i: usize) -> Result<Layer> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let l = m.pp(format!("layers.{i}"));
        let ffn = match &cfg.moe {
            Some(moe) if moe.is_moe_layer(i) => {
                // MiniMax's own checkpoints keep the block as `block_sparse_moe`.
                let prefix = if l.contains("block_sparse_moe.gate.weight") {
                    "block_sparse_moe"
                } else {
                    "mlp"
                };
                Ffn::Moe(Box::new(MoeBlock::load(
                    cfg,
                    moe,
                    &l.pp(prefix),
                    names(cfg.arch),
                )?))
            }
            _ => Ffn::Dense(Mlp::load(&l.pp("mlp"), h, cfg.intermediate_size)?),
        };
        Ok(Layer {
            input_norm: RmsNorm::load(&l.pp("input_layernorm"), h, eps)?,
            attn: Attention::load(cfg, &l.pp("self_attn"), false, i)?,
            post_norm: RmsNorm::load(&l.pp("post_attention_layernorm"), h, eps)?,
            ffn,
        })
    }
}

/// The decoder of the GQA MoE families ([`Decoder`]).
pub(crate) struct SparseDecoder {
    cfg: ModelConfig,
    dtype: DType,
    path: ComputePath,
    rope: RopeCache,
}

impl SparseDecoder {
    /// Checks the config before any weight is read.
    pub(crate) fn new(cfg: &ModelConfig, dtype: DType, path: ComputePath) -> Result<Self> {
        if !matches!(
            cfg.arch,
            Arch::Qwen3Moe
                | Arch::Qwen2Moe
                | Arch::Qwen3VlMoe
                | Arch::MiniMaxM2
                | Arch::Glm4Moe
                | Arch::GptOss
        ) {
            return Err(Error::config(
                &cfg.path,
                format!("{} is not a GQA MoE family", cfg.model_type),
            ));
        }
        Ok(SparseDecoder {
            cfg: cfg.clone(),
            dtype,
            path,
            rope: RopeCache::default(),
        })
    }
}

/// Rope tables, the causal mask, and the sliding-window mask when a layer has a window (the
/// masks are placeholders on the kernel path, whose flash attention masks by position).
pub(crate) struct Ctx {
    rope: RopeTables,
    full: Tensor,
    sliding: Option<Tensor>,
    /// The sequences packed in the forward, with each one's causal and sliding masks.
    packed_full: Packed,
    packed_sliding: Packed,
}

impl SparseDecoder {
    /// The candle path's causal mask of `t` tokens and, when a layer has a window, its
    /// sliding one (placeholders on the kernel path, whose flash attention masks by position).
    fn masks(&self, t: usize, device: &Device) -> Result<(Tensor, Option<Tensor>)> {
        let window = (0..self.cfg.num_layers).find_map(|i| self.cfg.window_of(i));
        Ok(match self.path {
            ComputePath::Candle => (
                causal_mask(t, None, self.dtype, device)?,
                window
                    .map(|w| causal_mask(t, Some(w), self.dtype, device))
                    .transpose()?,
            ),
            ComputePath::Kernels | ComputePath::Fused => (
                Tensor::zeros(1, self.dtype, device).ctx(|| "mask".into())?,
                None,
            ),
        })
    }
}

impl Decoder for SparseDecoder {
    type Layer = Layer;
    type Ctx = Ctx;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn load_layer(&self, m: &Vb, i: usize) -> Result<Layer> {
        Layer::load(&self.cfg, m, i)
    }

    fn context(&self, t: usize, device: &Device) -> Result<Ctx> {
        let rope = self.rope.packed(
            &self.cfg.rope,
            self.cfg.rotary_dim,
            &[t],
            self.dtype,
            device,
        )?;
        let (full, sliding) = self.masks(t, device)?;
        Ok(Ctx {
            rope,
            full,
            sliding,
            packed_full: Packed::default(),
            packed_sliding: Packed::default(),
        })
    }

    fn context_packed(&self, lens: &[usize], device: &Device) -> Result<Option<Ctx>> {
        let cfg = &self.cfg;
        let rope = self
            .rope
            .packed(&cfg.rope, cfg.rotary_dim, lens, self.dtype, device)?;
        let (full, sliding) = self.masks(1, device)?;
        let packed_full = Packed::new(lens, |t| Ok(self.masks(t, device)?.0))?;
        let packed_sliding = Packed::new(lens, |t| {
            let (full, sliding) = self.masks(t, device)?;
            Ok(sliding.unwrap_or(full))
        })?;
        Ok(Some(Ctx {
            rope,
            full,
            sliding,
            packed_full,
            packed_sliding,
        }))
    }

    fn step(&self, layer: &Layer, i: usize, xs: &Tensor, ctx: &Ctx) -> Result<LayerStep> {
        let (mask, packed) = match (layer.attn.window(), &ctx.sliding) {
            (Some(_), Some(sliding)) => (sliding, &ctx.packed_sliding),
            (Some(_), None) => (&ctx.full, &ctx.packed_sliding),
            _ => (&ctx.full, &ctx.packed_full),
        };
        residual_step(
            i,
            xs,
            self.path,
            &layer.input_norm,
            &layer.post_norm,
            &layer.ffn,
            |normed| layer.attn.forward_packed(normed, &ctx.rope, mask, packed),
            |normed| layer.attn.forward_kernels_packed(normed, &ctx.rope, packed),
        )
    }
}
