//! Gemma-3's text model: `gemma3_text` (`Gemma3ForCausalLM`) and the text model of the
//! `gemma3` wrapper (`Gemma3ForConditionalGeneration`, its weights under
//! `model.language_model.*`), run on text.
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
}

/// The Gemma-3 text decoder ([`Decoder`]).
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
        let norm = |name: &str, size: usize| offset_norm(&l.pp(name), size, eps, self.dtype);
        let mut attn = Attention::load(cfg, &l.pp("self_attn"), false, i)?;
        let a = l.pp("self_attn");
        attn.q_norm = Some(offset_norm(&a.pp("q_norm"), hd, eps, self.dtype)?);
        attn.k_norm = Some(offset_norm(&a.pp("k_norm"), hd, eps, self.dtype)?);
        Ok(Layer {
            input_norm: norm("input_layernorm", h)?,
            attn,
            post_attn_norm: norm("post_attention_layernorm", h)?,
            pre_ff_norm: norm("pre_feedforward_layernorm", h)?,
            post_ff_norm: norm("post_feedforward_layernorm", h)?,
            mlp: GeluMlp::load(&l.pp("mlp"), h, cfg.intermediate_size, self.gemma.act)?,
        })
    }

    fn context(&self, t: usize, device: &Device) -> Result<Ctx> {
        let cfg = &self.cfg;
        let global = RopeTables::new(&cfg.rope, cfg.rotary_dim, t, self.dtype, device)?;
        let local = RopeTables::new(
            &self.gemma.local_rope,
            cfg.rotary_dim,
            t,
            self.dtype,
            device,
        )?;
        let (full, sliding) = match self.path {
            ComputePath::Candle => (
                causal_mask(t, None, self.dtype, device)?,
                causal_mask(t, cfg.sliding_window, self.dtype, device)?,
            ),
            ComputePath::Kernels | ComputePath::Fused => {
                let none = Tensor::zeros(1, self.dtype, device).ctx(|| "mask".into())?;
                (none.clone(), none)
            }
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
        let step = || -> candle_core::Result<LayerStep> {
            let normed = layer.input_norm.forward(xs)?;
            let a = match self.path {
                ComputePath::Candle => layer.attn.forward(&normed, rope, mask)?,
                ComputePath::Kernels | ComputePath::Fused => {
                    layer.attn.forward_kernels(&normed, rope)?
                }
            };
            let (xs, normed) = layer
                .pre_ff_norm
                .add_forward(xs, &layer.post_attn_norm.forward(&a)?)?;
            let m = layer.post_ff_norm.forward(&layer.mlp.forward(&normed)?)?;
            Ok(LayerStep {
                next: (xs + &m)?,
                ffn_out: m,
                extras: Vec::new(),
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
        offset_norm(&m.pp("norm"), cfg.hidden_size, cfg.rms_norm_eps, self.dtype)
    }

    fn logits(&self, logits: Tensor) -> Result<Tensor> {
        let Some(cap) = self.gemma.final_logit_softcapping else {
            return Ok(logits);
        };
        let capped = || (logits / cap)?.tanh()? * cap;
        capped().ctx(|| "final logit softcapping".into())
    }
}
