//! Llama-family targets: `llama` (incl. llama3 rope scaling), `mistral` (sliding window),
//! `qwen2` (q/k/v bias), `qwen3` (per-head q/k RMSNorm). GQA, tied embeddings.
//! Reference: transformers `models/{llama,mistral,qwen2,qwen3}/modeling_*.py`.

use crate::config::ModelConfig;
use crate::error::{CandleContext, Error, Result};
use crate::kernels::{self, AttnParams, RopeParams};
use crate::model::nn::{Linear, Mlp, RmsNorm, RopeTables, attention, causal_mask};
use crate::model::source::Vb;
use crate::model::{ComputePath, Decoder, LayerStep};
use crate::naming;
use candle_core::{DType, Device, Tensor};

pub(crate) struct Attention {
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) q_norm: Option<RmsNorm>,
    pub(crate) k_norm: Option<RmsNorm>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    window: Option<usize>,
}

impl Attention {
    fn load(cfg: &ModelConfig, vb: &Vb) -> Result<Attention> {
        let (h, nh, nkv, hd) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let bias = cfg.attention_bias;
        let (q_norm, k_norm) = if cfg.qk_norm {
            (
                Some(RmsNorm::load(&vb.pp("q_norm"), hd, cfg.rms_norm_eps)?),
                Some(RmsNorm::load(&vb.pp("k_norm"), hd, cfg.rms_norm_eps)?),
            )
        } else {
            (None, None)
        };
        Ok(Attention {
            q: Linear::load(&vb.pp("q_proj"), nh * hd, h, bias)?,
            k: Linear::load(&vb.pp("k_proj"), nkv * hd, h, bias)?,
            v: Linear::load(&vb.pp("v_proj"), nkv * hd, h, bias)?,
            o: Linear::load(&vb.pp("o_proj"), h, nh * hd, cfg.o_bias)?,
            q_norm,
            k_norm,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            window: cfg.sliding_window,
        })
    }

    /// The kernel path: token-major `[T, heads * d]` throughout, rope in place, flash
    /// attention (kernels/rope.cu, kernels/attention.cu). `xs`: [T, H] -> [T, H]
    fn forward_kernels(&self, xs: &Tensor, rope: &RopeTables) -> candle_core::Result<Tensor> {
        let t = xs.dim(0)?;
        let (nh, nkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let mut q = self.q.forward(xs)?.contiguous()?;
        let mut k = self.k.forward(xs)?.contiguous()?;
        let v = self.v.forward(xs)?;
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn
                .forward(&q.reshape((t * nh, hd))?)?
                .reshape((t, nh * hd))?;
            k = kn
                .forward(&k.reshape((t * nkv, hd))?)?
                .reshape((t, nkv * hd))?;
        }
        kernels::rope_in_place(&q, &rope.cos32, &rope.sin32, &RopeParams::half(nh, hd))?;
        kernels::rope_in_place(&k, &rope.cos32, &rope.sin32, &RopeParams::half(nkv, hd))?;
        let params = AttnParams {
            nh,
            nkv,
            dk: hd,
            dv: hd,
            scale: 1.0 / (hd as f64).sqrt(),
            window: self.window,
        };
        self.o
            .forward(&kernels::flash_attention(&q, &k, &v, &params)?)
    }

    /// `xs`: [T, H] -> [T, H]
    fn forward(
        &self,
        xs: &Tensor,
        rope: &RopeTables,
        mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        let t = xs.dim(0)?;
        let split = |y: Tensor, n: usize| y.reshape((t, n, self.head_dim))?.transpose(0, 1);
        let mut q = split(self.q.forward(xs)?, self.heads)?;
        let mut k = split(self.k.forward(xs)?, self.kv_heads)?;
        let v = split(self.v.forward(xs)?, self.kv_heads)?;
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let q = rope.apply_half(&q.contiguous()?)?;
        let k = rope.apply_half(&k.contiguous()?)?;
        let out = attention(&q, &k, &v, mask, 1.0 / (self.head_dim as f64).sqrt())?;
        self.o.forward(&out)
    }
}

pub(crate) struct Layer {
    pub(crate) input_norm: RmsNorm,
    pub(crate) attn: Attention,
    pub(crate) post_norm: RmsNorm,
    pub(crate) mlp: Mlp,
}

impl Layer {
    /// Decoder layer `i` under the decoder prefix `m`.
    pub(crate) fn load(cfg: &ModelConfig, m: &Vb, i: usize) -> Result<Layer> {
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let l = m.pp(format!("layers.{i}"));
        Ok(Layer {
            input_norm: RmsNorm::load(&l.pp("input_layernorm"), h, eps)?,
            attn: Attention::load(cfg, &l.pp("self_attn"))?,
            post_norm: RmsNorm::load(&l.pp("post_attention_layernorm"), h, eps)?,
            mlp: Mlp::load_biased(&l.pp("mlp"), h, cfg.intermediate_size, cfg.mlp_bias)?,
        })
    }
}

/// The Llama-family decoder: what every layer shares ([`Decoder`]).
pub(crate) struct LlamaDecoder {
    pub(crate) cfg: ModelConfig,
    pub(crate) dtype: DType,
    path: ComputePath,
}

impl LlamaDecoder {
    pub(crate) fn new(cfg: &ModelConfig, dtype: DType, path: ComputePath) -> LlamaDecoder {
        LlamaDecoder {
            cfg: cfg.clone(),
            dtype,
            path,
        }
    }
}

/// Where the decoder lives in the checkpoint ([`naming::decoder_prefix`]); `model` when none
/// matches, so the missing embedding is reported under its usual name.
pub fn decoder_prefix<'a>(vb: &Vb<'a>) -> Vb<'a> {
    vb.pp(naming::decoder_prefix(&|n| vb.contains(n)).unwrap_or("model"))
}

/// The output head: the embeddings when tied (transformers ties `lm_head` to them and ignores
/// a stored copy), else the checkpoint's head under any [`naming::LM_HEAD_NAMES`].
pub fn output_head(cfg: &ModelConfig, vb: &Vb, embed: &Tensor) -> Result<Tensor> {
    match head_name(cfg, vb)? {
        None => Ok(embed.clone()),
        Some(name) => vb.get(name, &[cfg.vocab_size, cfg.hidden_size]),
    }
}

/// The name of the checkpoint's output head, `None` when it is tied to the embeddings.
pub fn head_name(cfg: &ModelConfig, vb: &Vb) -> Result<Option<&'static str>> {
    if cfg.tie_word_embeddings {
        return Ok(None);
    }
    match naming::lm_head_name(&|n| vb.contains(n)) {
        Some(name) => Ok(Some(name)),
        None => Err(Error::MissingTensor {
            path: vb.origin().to_path_buf(),
            name:
                "lm_head.weight (tie_word_embeddings is false, so the head is not the embeddings)"
                    .to_string(),
        }),
    }
}

impl Decoder for LlamaDecoder {
    type Layer = Layer;
    /// Rope tables and the additive causal mask (a placeholder on the kernel path, whose flash
    /// attention masks by position).
    type Ctx = (RopeTables, Tensor);

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn load_layer(&self, m: &Vb, i: usize) -> Result<Layer> {
        Layer::load(&self.cfg, m, i)
    }

    fn context(&self, t: usize, device: &Device) -> Result<Self::Ctx> {
        let rope = RopeTables::new(&self.cfg.rope, self.cfg.head_dim, t, self.dtype, device)?;
        let mask = match self.path {
            ComputePath::Candle => causal_mask(t, self.cfg.sliding_window, self.dtype, device)?,
            // Flash attention masks by position; no [T, T] matrix.
            ComputePath::Kernels | ComputePath::Fused => {
                Tensor::zeros(1, self.dtype, device).ctx(|| "mask".into())?
            }
        };
        Ok((rope, mask))
    }

    fn step(
        &self,
        layer: &Layer,
        i: usize,
        xs: &Tensor,
        (rope, mask): &Self::Ctx,
    ) -> Result<LayerStep> {
        let step = || -> candle_core::Result<LayerStep> {
            let normed = layer.input_norm.forward(xs)?;
            let (xs, normed) = match self.path {
                ComputePath::Candle => {
                    let xs = (xs + layer.attn.forward(&normed, rope, mask)?)?;
                    let normed = layer.post_norm.forward(&xs)?;
                    (xs, normed)
                }
                ComputePath::Kernels | ComputePath::Fused => {
                    let h = layer.attn.forward_kernels(&normed, rope)?;
                    layer.post_norm.add_forward(xs, &h)?
                }
            };
            let m = layer.mlp.forward(&normed)?;
            Ok(LayerStep {
                next: (xs + &m)?,
                ffn_out: m,
                extras: Vec::new(),
            })
        };
        step().ctx(|| format!("decoder layer {i}"))
    }
}
