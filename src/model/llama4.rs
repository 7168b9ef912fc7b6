//! Llama-4 text (Scout, Maverick): `llama4_text`, and the text model of `llama4`
//! (`Llama4ForConditionalGeneration`). Each layer is `x + attn(norm(x))`, then
//! `+ feed_forward(norm(.))` with the feed-forward dense or the MoE block of every MoE family
//! ([`MoeBlock`]: sigmoid top-k, a shared expert, the router's weight on the experts' input).
//!
//! References, transformers 5.24 `models/llama4/modeling_llama4.py`:
//! - `Llama4TextAttention`: q/k/v/o (biased with `attention_bias`); on a rope layer
//!   (`no_rope_layers[i] == 1`) `apply_rotary_emb` rotates complex pairs `(x[2j], x[2j+1])`,
//!   then `Llama4TextL2Norm` (RMS over each head, no weight, `rms_norm_eps`) normalises q and k
//!   when `use_qk_norm`; on a NoPE layer with `attn_temperature_tuning` q is scaled by
//!   `log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`; softmax scale `head_dim^-0.5`.
//!   Rope here writes each rotated head de-interleaved (evens, then odds) where transformers
//!   keeps the pairs in place: one fixed permutation of the head's dims, applied to q and k
//!   alike, which no dot product and no per-head norm can see, and v is not rotated.
//! - masks (`Llama4TextModel.forward`): `chunked_attention` layers attend causally within
//!   chunks of `attention_chunk_size` positions (`create_chunked_causal_mask`), the others
//!   causally over everything.
//! - `Llama4TextDecoderLayer`: `feed_forward` is `Llama4TextMoe` on the `moe_layers`, else a
//!   `Llama4TextMLP` of `intermediate_size_mlp`.
//! - `Llama4TextMoe` / `Llama4Router` / `Llama4TextExperts`: see [`crate::config::moe`] and
//!   [`crate::model::moe::LLAMA4_NAMES`].
//!
//! The boundaries are HF's: `b = 0` the embedding, `b = i + 1` the residual stream after layer
//! `i`, `b = L` after the final norm.

use crate::config::{Llama4Attention, ModelConfig};
use crate::error::{CandleContext, Error, Result};
use crate::kernels::{self, AttnParams, RopeParams};
use crate::model::moe::{Ffn, LLAMA4_NAMES, MoeBlock, residual_step};
use crate::model::nn::{Linear, Mlp, RmsNorm, RopeTables, attention, causal_mask};
use crate::model::source::Vb;
use crate::model::{ComputePath, Decoder, LayerStep};
use candle_core::{D, DType, Device, Tensor};

/// One layer's attention.
pub(crate) struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Rotates q and k (a rope layer) or not (a NoPE layer).
    rope: bool,
    /// Normalises q and k per head after rope (`Llama4TextL2Norm`), with this epsilon.
    l2_eps: Option<f64>,
    /// Attends within chunks of this many positions.
    chunk: Option<usize>,
    /// Scales q per position (NoPE layers with temperature tuning).
    temperature: bool,
}

impl Attention {
    fn load(cfg: &ModelConfig, l4: &Llama4Attention, vb: &Vb, layer: usize) -> Result<Attention> {
        let (h, nh, nkv, hd) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let bias = cfg.attention_bias;
        let rope = l4.rope_layers[layer];
        Ok(Attention {
            q: Linear::load(&vb.pp("q_proj"), nh * hd, h, bias)?,
            k: Linear::load(&vb.pp("k_proj"), nkv * hd, h, bias)?,
            v: Linear::load(&vb.pp("v_proj"), nkv * hd, h, bias)?,
            o: Linear::load(&vb.pp("o_proj"), h, nh * hd, bias)?,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            rope,
            l2_eps: (l4.l2_qk_norm && rope).then_some(cfg.rms_norm_eps),
            chunk: l4.chunked_layers[layer].then_some(l4.chunk),
            temperature: !rope && l4.temperature.is_some(),
        })
    }

    /// `xs` [.., d] RMS-normalised over the last dim without a weight, in f32
    /// (`Llama4TextL2Norm.forward`: `_norm(x.float()).type_as(x)`).
    fn l2(xs: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
        let x = xs.to_dtype(DType::F32)?;
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        x.broadcast_div(&(ms + eps)?.sqrt()?)?.to_dtype(xs.dtype())
    }

    /// `q` times the per-position temperature `scales` [T, 1] f32, in f32 and rounded back
    /// (`(query_states * attn_scales).to(query_states.dtype)`). `q`: [T, ..] token-major.
    fn temper(q: &Tensor, scales: &Tensor) -> candle_core::Result<Tensor> {
        q.to_dtype(DType::F32)?
            .broadcast_mul(scales)?
            .to_dtype(q.dtype())
    }

    /// The candle path: head-major with explicit masks. `xs`: [T, H] -> [T, H].
    fn forward(&self, xs: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let t = xs.dim(0)?;
        let hd = self.head_dim;
        let mut q = self.q.forward(xs)?;
        if self.temperature {
            q = Self::temper(&q, &ctx.temperature)?;
        }
        let split = |y: Tensor, n: usize| y.reshape((t, n, hd))?.transpose(0, 1)?.contiguous();
        let mut q = split(q, self.heads)?;
        let mut k = split(self.k.forward(xs)?, self.kv_heads)?;
        let v = split(self.v.forward(xs)?, self.kv_heads)?;
        if self.rope {
            q = ctx.rope.apply_interleaved(&q)?;
            k = ctx.rope.apply_interleaved(&k)?;
        }
        if let Some(eps) = self.l2_eps {
            q = Self::l2(&q, eps)?;
            k = Self::l2(&k, eps)?;
        }
        let mask = match (self.chunk, &ctx.chunked) {
            (Some(_), Some(m)) => m,
            _ => &ctx.full,
        };
        let out = attention(&q, &k, &v, mask, 1.0 / (hd as f64).sqrt())?;
        self.o.forward(&out)
    }

    /// The kernel path: token-major `[T, heads * d]`, rope in place, flash attention over each
    /// chunk alone on a chunked layer (a chunk's queries see only its own keys, causally).
    fn forward_kernels(&self, xs: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let t = xs.dim(0)?;
        let (nh, nkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let mut q = self.q.forward(xs)?.contiguous()?;
        let mut k = self.k.forward(xs)?.contiguous()?;
        let v = self.v.forward(xs)?.contiguous()?;
        if self.temperature {
            q = Self::temper(&q, &ctx.temperature)?.contiguous()?;
        }
        if self.rope {
            let rot = |heads| RopeParams {
                interleaved: true,
                ..RopeParams::half(heads, hd)
            };
            kernels::rope_in_place(&q, &ctx.rope.cos32, &ctx.rope.sin32, &rot(nh))?;
            kernels::rope_in_place(&k, &ctx.rope.cos32, &ctx.rope.sin32, &rot(nkv))?;
        }
        if let Some(eps) = self.l2_eps {
            q = Self::l2(&q.reshape((t * nh, hd))?, eps)?.reshape((t, nh * hd))?;
            k = Self::l2(&k.reshape((t * nkv, hd))?, eps)?.reshape((t, nkv * hd))?;
        }
        let params = AttnParams {
            nh,
            nkv,
            dk: hd,
            dv: hd,
            scale: 1.0 / (hd as f64).sqrt(),
            window: None,
        };
        let chunk = self.chunk.unwrap_or(t).clamp(1, t.max(1));
        let out = if chunk >= t {
            kernels::flash_attention(&q, &k, &v, &params)?
        } else {
            let parts = (0..t)
                .step_by(chunk)
                .map(|start| {
                    let len = chunk.min(t - start);
                    let rows = |x: &Tensor| x.narrow(0, start, len)?.contiguous();
                    kernels::flash_attention(&rows(&q)?, &rows(&k)?, &rows(&v)?, &params)
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::cat(&parts, 0)?
        };
        self.o.forward(&out)
    }
}

pub(crate) struct Layer {
    input_norm: RmsNorm,
    attn: Attention,
    post_norm: RmsNorm,
    ffn: Ffn,
}

/// The Llama-4 decoder ([`Decoder`]).
pub(crate) struct Llama4Decoder {
    cfg: ModelConfig,
    l4: Llama4Attention,
    dtype: DType,
    path: ComputePath,
}

impl Llama4Decoder {
    /// Checks the config before any weight is read.
    pub(crate) fn new(cfg: &ModelConfig, dtype: DType, path: ComputePath) -> Result<Self> {
        let Some(l4) = cfg.llama4.clone() else {
            return Err(Error::config(
                &cfg.path,
                format!("{} is not a Llama-4 config", cfg.model_type),
            ));
        };
        Ok(Llama4Decoder {
            cfg: cfg.clone(),
            l4,
            dtype,
            path,
        })
    }
}

/// Rope tables, the masks (placeholders on the kernel path) and the temperature per position.
pub(crate) struct Ctx {
    rope: RopeTables,
    full: Tensor,
    chunked: Option<Tensor>,
    /// [T, 1] f32: `log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1` (ones without
    /// temperature tuning).
    temperature: Tensor,
}

/// Additive mask [t, t]: key j visible from query i when j <= i in the same chunk of `chunk`.
fn chunked_mask(t: usize, chunk: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let mut m = vec![0f32; t * t];
    for i in 0..t {
        for j in 0..t {
            if j > i || i / chunk != j / chunk {
                m[i * t + j] = f32::NEG_INFINITY;
            }
        }
    }
    Tensor::from_vec(m, (t, t), device)
        .and_then(|m| m.to_dtype(dtype))
        .ctx(|| "chunked attention mask".to_string())
}

impl Decoder for Llama4Decoder {
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
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let l = m.pp(format!("layers.{i}"));
        let ff = l.pp("feed_forward");
        let ffn = match &cfg.moe {
            Some(moe) if moe.is_moe_layer(i) => {
                Ffn::Moe(Box::new(MoeBlock::load(cfg, moe, &ff, &LLAMA4_NAMES)?))
            }
            _ => Ffn::Dense(Mlp::load(&ff, h, cfg.intermediate_size)?),
        };
        Ok(Layer {
            input_norm: RmsNorm::load(&l.pp("input_layernorm"), h, eps)?,
            attn: Attention::load(cfg, &self.l4, &l.pp("self_attn"), i)?,
            post_norm: RmsNorm::load(&l.pp("post_attention_layernorm"), h, eps)?,
            ffn,
        })
    }

    fn context(&self, t: usize, device: &Device) -> Result<Ctx> {
        let rope = RopeTables::new(&self.cfg.rope, self.cfg.head_dim, t, self.dtype, device)?;
        let (full, chunked) = match self.path {
            ComputePath::Candle => (
                causal_mask(t, None, self.dtype, device)?,
                self.l4
                    .chunked_layers
                    .contains(&true)
                    .then(|| chunked_mask(t, self.l4.chunk.max(1), self.dtype, device))
                    .transpose()?,
            ),
            ComputePath::Kernels | ComputePath::Fused => (
                Tensor::zeros(1, self.dtype, device).ctx(|| "mask".into())?,
                None,
            ),
        };
        let scales: Vec<f32> = (0..t)
            .map(|pos| match self.l4.temperature {
                // In f32, as `torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale))`.
                Some((scale, floor)) => {
                    let f = ((pos as f32 + 1.0) / floor as f32).floor();
                    f.ln_1p() * scale as f32 + 1.0
                }
                None => 1.0,
            })
            .collect();
        let temperature =
            Tensor::from_vec(scales, (t, 1), device).ctx(|| "attention temperature".into())?;
        Ok(Ctx {
            rope,
            full,
            chunked,
            temperature,
        })
    }

    fn step(&self, layer: &Layer, i: usize, xs: &Tensor, ctx: &Ctx) -> Result<LayerStep> {
        residual_step(
            i,
            xs,
            self.path,
            &layer.input_norm,
            &layer.post_norm,
            &layer.ffn,
            |normed| layer.attn.forward(normed, ctx),
            |normed| layer.attn.forward_kernels(normed, ctx),
        )
    }
}
