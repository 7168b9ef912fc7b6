//! Gemma's text models, run on text: Gemma-3's, `gemma3_text` (`Gemma3ForCausalLM`) and the text
//! model of the `gemma3` wrapper (`Gemma3ForConditionalGeneration`, its weights under
//! `model.language_model.*`), and Gemma-4's (`gemma4_text`, `gemma4`), whose layers differ in
//! what [`crate::model::gemma4`] loads: the decoder layer, the embedding scale and the softcap
//! below are the same in both (`modeling_gemma4.py` `Gemma4TextDecoderLayer.forward` adds only
//! the `layer_scalar`).
//!
//! Reference: transformers 5.24 `models/gemma3/modeling_gemma3.py`.
//! - `Gemma3TextScaledWordEmbedding.forward`: the rows times `embed_scale` = sqrt(H) cast to the
//!   weights' dtype. HF's `hidden_states[0]` is that scaled output, so b = 0 is too
//!   ([`Decoder::embed`]).
//! - `Gemma3RMSNorm`: `norm(x) * (1 + w)` in f32; every norm (the four of a layer, q/k, the
//!   final one) is loaded with its weight plus one ([`offset_norm`]). In f32 this is HF's
//!   computation exactly; in bf16 the `1 + w` is rounded to bf16 once, where HF keeps it in f32.
//! - `Gemma3DecoderLayer.forward`: sandwich norms, `x + post_attn(attn(input(x)))`, then
//!   `+ post_ff(mlp(pre_ff(.)))`.
//! - `Gemma3Attention`: q/k/v/o biased with `attention_bias`, per-head q/k norm before rope,
//!   softmax scale `query_pre_attn_scalar ** -0.5`, `sliding_window` on the layers
//!   `layer_types` marks `sliding_attention` ([`crate::model::llama::Attention`] with this data).
//! - `Gemma3RotaryEmbedding`: one rope per layer type (the full layers' `rope_parameters`, the
//!   sliding layers' local base), rotate-half (`apply_rotary_pos_emb`).
//! - `Gemma3MLP`: `down(act(gate(x)) * up(x))` with `hidden_activation` (`gelu_pytorch_tanh`).
//! - `Gemma3ForCausalLM.forward`: `final_logit_softcapping` on the logits only (b = L is the
//!   final norm's output, before the head); the 5.24 wrapper applies none
//!   ([`crate::config::GemmaConfig::final_logit_softcapping`]).

use crate::config::{GeluKind, GemmaConfig, ModelConfig};
use crate::error::{CandleContext, Error, Result};
use crate::kernels::attention::GENERIC_MAX_HEAD_DIM;
use crate::model::gemma4;
use crate::model::llama::Attention;
use crate::model::moe::get_f32;
use crate::model::nn::{Linear, RmsNorm, RopeTables, causal_mask};
use crate::model::source::Vb;
use crate::model::{ComputePath, Decoder, LayerStep};
use candle_core::{DType, Device, Tensor};

/// A Gemma norm: `w + 1` from the store in f32, then in the compute dtype.
pub(crate) fn offset_norm(vb: &Vb, size: usize, eps: f64, dtype: DType) -> Result<RmsNorm> {
    let w = get_f32(vb, "weight", &[size])?;
    let weight = (w + 1.0)
        .and_then(|w| w.to_dtype(dtype))
        .ctx(|| vb.path("weight + 1"))?;
    Ok(RmsNorm { weight, eps })
}

/// `down(act(gate(x)) * up(x))`.
pub(crate) struct GeluMlp {
    gate: Linear,
    up: Linear,
    down: Linear,
    act: GeluKind,
}

impl GeluMlp {
    fn load(vb: &Vb, hidden: usize, inter: usize, act: GeluKind) -> Result<GeluMlp> {
        Ok(GeluMlp {
            gate: Linear::load(&vb.pp("gate_proj"), inter, hidden, false)?,
            up: Linear::load(&vb.pp("up_proj"), inter, hidden, false)?,
            down: Linear::load(&vb.pp("down_proj"), hidden, inter, false)?,
            act,
        })
    }

    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let g = self.gate.forward(xs)?;
        let g = match self.act {
            GeluKind::Tanh => g.gelu()?,
            GeluKind::Erf => g.gelu_erf()?,
        };
        self.down.forward(&(g * self.up.forward(xs)?)?)
    }
}

pub(crate) struct Layer {
    input_norm: RmsNorm,
    attn: Attention,
    post_attn_norm: RmsNorm,
    pre_ff_norm: RmsNorm,
    post_ff_norm: RmsNorm,
    mlp: GeluMlp,
    /// Gemma-4: the layer's output times this `[1]` (`layer_scalar`).
    scalar: Option<Tensor>,
    /// Gemma-4's MoE block beside the dense MLP.
    moe: Option<Box<gemma4::Gemma4Moe>>,
}

/// The Gemma text decoder ([`Decoder`]).
pub(crate) struct GemmaDecoder {
    cfg: ModelConfig,
    gemma: GemmaConfig,
    dtype: DType,
    path: ComputePath,
}

impl GemmaDecoder {
    /// Checks the config before any weight is read.
    pub(crate) fn new(cfg: &ModelConfig, dtype: DType, path: ComputePath) -> Result<Self> {
        let gemma = cfg.gemma.clone().ok_or_else(|| {
            Error::config(
                &cfg.path,
                format!("{} is not a Gemma config", cfg.model_type),
            )
        })?;
        Ok(GemmaDecoder {
            cfg: cfg.clone(),
            gemma,
            dtype,
            path,
        })
    }
}

/// The two ropes (full layers', sliding layers') and the two masks (placeholders on the kernel
/// path, whose flash attention masks by position).
pub(crate) struct Ctx {
    global: RopeTables,
    local: RopeTables,
    full: Tensor,
    sliding: Tensor,
}

impl Decoder for GemmaDecoder {
    type Layer = Layer;
    type Ctx = Ctx;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn load_layer(&self, m: &Vb, i: usize) -> Result<Layer> {
        let cfg = &self.cfg;
        let (h, eps, hd) = (cfg.hidden_size, cfg.rms_norm_eps, cfg.head_dim);
        let l = m.pp(format!("layers.{i}"));
        let v4 = self.gemma.v4.as_ref();
        // Gemma-3's norms are `1 + w`, Gemma-4's `w` (`Gemma4RMSNorm`).
        let norm = |name: &str, size: usize| match v4 {
            Some(_) => RmsNorm::load(&l.pp(name), size, eps),
            None => offset_norm(&l.pp(name), size, eps, self.dtype),
        };
        let a = l.pp("self_attn");
        let attn = match v4 {
            Some(v4) => gemma4::load_attention(cfg, v4, &a, i, self.dtype)?,
            None => {
                let mut attn = Attention::load(cfg, &a, false, i)?;
                attn.q_norm = Some(norm("self_attn.q_norm", hd)?);
                attn.k_norm = Some(norm("self_attn.k_norm", hd)?);
                attn
            }
        };
        Ok(Layer {
            input_norm: norm("input_layernorm", h)?,
            attn,
            post_attn_norm: norm("post_attention_layernorm", h)?,
            pre_ff_norm: norm("pre_feedforward_layernorm", h)?,
            post_ff_norm: norm("post_feedforward_layernorm", h)?,
            mlp: GeluMlp::load(&l.pp("mlp"), h, cfg.intermediate_size, self.gemma.act)?,
            scalar: v4.map(|_| l.get("layer_scalar", &[1])).transpose()?,
            moe: gemma4::Gemma4Moe::load(cfg, &l, self.dtype)?.map(Box::new),
        })
    }

    fn context(&self, t: usize, device: &Device) -> Result<Ctx> {
        let cfg = &self.cfg;
        // Gemma-4's ropes span each layer type's own head dim.
        let (global_dim, local_dim) = match &self.gemma.v4 {
            Some(v4) => gemma4::rope_dims(cfg, v4),
            None => (cfg.rotary_dim, cfg.rotary_dim),
        };
        let global = RopeTables::new(&cfg.rope, global_dim, t, self.dtype, device)?;
        let local = RopeTables::new(&self.gemma.local_rope, local_dim, t, self.dtype, device)?;
        // Heads wider than the GPU's flash kernel takes run as candle ops with a mask
        // (Gemma-4's 512-dim full layers, [`GemmaDecoder::step`]).
        let wide = device.is_cuda() && global_dim.max(local_dim) > GENERIC_MAX_HEAD_DIM;
        let (full, sliding) = if self.path == ComputePath::Candle || wide {
            (
                causal_mask(t, None, self.dtype, device)?,
                causal_mask(t, cfg.sliding_window, self.dtype, device)?,
            )
        } else {
            let none = Tensor::zeros(1, self.dtype, device).ctx(|| "mask".into())?;
            (none.clone(), none)
        };
        Ok(Ctx {
            global,
            local,
            full,
            sliding,
        })
    }

    fn step(&self, layer: &Layer, i: usize, xs: &Tensor, ctx: &Ctx) -> Result<LayerStep> {
        let (rope, mask) = match layer.attn.window() {
            Some(_) => (&ctx.local, &ctx.sliding),
            None => (&ctx.global, &ctx.full),
        };
        // A head wider than the GPU's flash kernel takes (Gemma-4's 512-dim full layers) runs
        // as candle ops with its mask.
        let wide = xs.device().is_cuda() && layer.attn.head_dim() > GENERIC_MAX_HEAD_DIM;
        let step = || -> candle_core::Result<LayerStep> {
            let normed = layer.input_norm.forward(xs)?;
            let a = if self.path == ComputePath::Candle || wide {
                layer.attn.forward(&normed, rope, mask)?
            } else {
                layer.attn.forward_kernels(&normed, rope)?
            };
            let (xs, normed) = layer
                .pre_ff_norm
                .add_forward(xs, &layer.post_attn_norm.forward(&a)?)?;
            let mlp = layer.mlp.forward(&normed)?;
            let (mlp, extras) = match &layer.moe {
                Some(moe) => moe.forward(i, self.path, &xs, &mlp)?,
                None => (mlp, Vec::new()),
            };
            let m = layer.post_ff_norm.forward(&mlp)?;
            let next = (xs + &m)?;
            let next = match &layer.scalar {
                Some(s) => next.broadcast_mul(s)?,
                None => next,
            };
            Ok(LayerStep {
                next,
                ffn_out: m,
                extras,
            })
        };
        step().ctx(|| format!("decoder layer {i}"))
    }

    /// `Gemma3TextScaledWordEmbedding`: times sqrt(H) as a scalar of the weights' dtype.
    fn embed(&self, rows: Tensor) -> Result<Tensor> {
        let scale = (self.cfg.hidden_size as f64).sqrt() as f32;
        let scaled = || -> candle_core::Result<Tensor> {
            let s = Tensor::new(scale, rows.device())?.to_dtype(rows.dtype())?;
            rows.broadcast_mul(&s)
        };
        scaled().ctx(|| "embedding scale".into())
    }

    fn final_norm(&self, m: &Vb) -> Result<RmsNorm> {
        let cfg = &self.cfg;
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        match self.gemma.v4 {
            Some(_) => RmsNorm::load(&m.pp("norm"), h, eps),
            None => offset_norm(&m.pp("norm"), h, eps, self.dtype),
        }
    }

    fn logits(&self, logits: Tensor) -> Result<Tensor> {
        let Some(cap) = self.gemma.final_logit_softcapping else {
            return Ok(logits);
        };
        let capped = || (logits / cap)?.tanh()? * cap;
        capped().ctx(|| "final logit softcapping".into())
    }
}
