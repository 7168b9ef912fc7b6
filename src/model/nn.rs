//! The building blocks every supported model shares, on candle-core tensors of any device:
//! RMSNorm, linear layers, rotary tables (default, linear, llama3, YaRN, LongRoPE, proportional),
//! causal attention.

use crate::config::{Rope, RopeScaling};
use crate::error::{CandleContext, Result};
use crate::model::source::Vb;
use candle_core::{D, DType, Device, Tensor};

/// RMSNorm as HF computes it: in f32, then back to the input dtype, times the weight.
#[derive(Clone)]
pub struct RmsNorm {
    pub weight: Tensor,
    pub eps: f64,
}

impl RmsNorm {
    pub fn load(vb: &Vb, size: usize, eps: f64) -> Result<RmsNorm> {
        Ok(RmsNorm {
            weight: vb.get("weight", &[size])?,
            eps,
        })
    }

    /// `xs`: [.., size]. One pass of the `rmsnorm` kernel (kernels/rmsnorm.cu; its CPU
    /// reference on the CPU): normalise in f32, round to the dtype, times the weight.
    pub fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let dims = xs.dims().to_vec();
        if dims.len() == 2 {
            return crate::kernels::rms_norm(xs, &self.weight, self.eps);
        }
        let size = dims.last().copied().unwrap_or(0);
        let flat = xs.contiguous()?.reshape(((), size))?;
        crate::kernels::rms_norm(&flat, &self.weight, self.eps)?.reshape(dims)
    }

    /// `xs + delta` (rounded to the dtype, as HF adds) and its norm, in one pass: the residual
    /// add of a decoder layer fused with the next norm. `[T, size]` each.
    pub fn add_forward(
        &self,
        xs: &Tensor,
        delta: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor)> {
        crate::kernels::add_rms_norm(xs, Some(delta), &self.weight, self.eps)
    }
}

/// `y = x W^T + b`, W: [out, in].
#[derive(Clone)]
pub struct Linear {
    pub weight: Tensor,
    pub bias: Option<Tensor>,
}

impl Linear {
    pub fn load(vb: &Vb, out_dim: usize, in_dim: usize, bias: bool) -> Result<Linear> {
        Ok(Linear {
            weight: vb.get("weight", &[out_dim, in_dim])?,
            bias: if bias {
                Some(vb.get("bias", &[out_dim])?)
            } else {
                None
            },
        })
    }

    /// The projections `parts` as one: their weights (and biases, when every part has one)
    /// stacked along the outputs, `[sum of outs, in]`. With [`Linear::rows`] each part can be
    /// a view of the fused weight.
    pub fn concat(parts: &[&Linear]) -> candle_core::Result<Linear> {
        let weights: Vec<&Tensor> = parts.iter().map(|l| &l.weight).collect();
        let biases: Option<Vec<&Tensor>> = parts.iter().map(|l| l.bias.as_ref()).collect();
        if biases.is_none() && parts.iter().any(|l| l.bias.is_some()) {
            candle_core::bail!("concat: some projections have a bias and some do not");
        }
        Ok(Linear {
            weight: Tensor::cat(&weights, 0)?,
            bias: biases.map(|b| Tensor::cat(&b, 0)).transpose()?,
        })
    }

    /// Outputs `start..start + len` of this projection, sharing its storage.
    pub fn rows(&self, start: usize, len: usize) -> candle_core::Result<Linear> {
        Ok(Linear {
            weight: self.weight.narrow(0, start, len)?,
            bias: self
                .bias
                .as_ref()
                .map(|b| b.narrow(0, start, len))
                .transpose()?,
        })
    }

    /// `xs`: [tokens, in] -> [tokens, out]
    pub fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let y = xs.matmul(&self.weight.t()?)?;
        match &self.bias {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
#[derive(Clone)]
pub struct Mlp {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

impl Mlp {
    pub fn load(vb: &Vb, hidden: usize, inter: usize) -> Result<Mlp> {
        Mlp::load_biased(vb, hidden, inter, false)
    }

    /// With `bias`, each projection carries one (Llama's `mlp_bias`).
    pub fn load_biased(vb: &Vb, hidden: usize, inter: usize, bias: bool) -> Result<Mlp> {
        Ok(Mlp {
            gate: Linear::load(&vb.pp("gate_proj"), inter, hidden, bias)?,
            up: Linear::load(&vb.pp("up_proj"), inter, hidden, bias)?,
            down: Linear::load(&vb.pp("down_proj"), hidden, inter, bias)?,
        })
    }

    /// `down(silu(gate(x)) * up(x))`, the activation in one pass (kernels/silu_mul.cu).
    pub fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let act = crate::kernels::silu_mul(&self.gate.forward(xs)?, &self.up.forward(xs)?)?;
        self.down.forward(&act)
    }
}

/// Inverse frequencies for `dim` rotary dimensions and the attention scale YaRN applies to
/// cos/sin. Mirrors transformers' `modeling_rope_utils` (`_compute_llama3_parameters`,
/// `_compute_yarn_parameters`), computed in f64 and rounded once. LongRoPE's short factors
/// ([`inv_freq_for`] picks by length).
pub fn inv_freq(rope: &Rope, dim: usize) -> (Vec<f64>, f64) {
    inv_freq_for(rope, dim, 0)
}

/// [`inv_freq`] for a forward of `seq_len` tokens: LongRoPE takes its long factors past
/// `original_max_position_embeddings` (transformers `longrope_frequency_update`: the longest
/// position + 1 against it); every other rope is the same at every length.
pub fn inv_freq_for(rope: &Rope, dim: usize, seq_len: usize) -> (Vec<f64>, f64) {
    let base: Vec<f64> = (0..dim / 2)
        .map(|i| 1.0 / rope.theta.powf((2 * i) as f64 / dim as f64))
        .collect();
    match rope.scaling {
        RopeScaling::None => (base, 1.0),
        RopeScaling::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
        RopeScaling::Proportional {
            factor,
            partial_rotary_factor,
        } => {
            // `int(rope_proportion * head_dim // 2)` rotated frequencies, the rest 0.
            let rotated = (partial_rotary_factor * dim as f64 / 2.0).floor() as usize;
            let freqs = base
                .iter()
                .enumerate()
                .map(|(i, f)| if i < rotated { f / factor } else { 0.0 })
                .collect();
            (freqs, 1.0)
        }
        RopeScaling::LongRope {
            ref short_factor,
            ref long_factor,
            original_max_position_embeddings: orig,
            attention_factor,
        } => {
            let ext = if seq_len as f64 > orig {
                long_factor
            } else {
                short_factor
            };
            // `1 / (ext * base ** (2i / dim))`: each frequency divided by its factor.
            let freqs = base
                .iter()
                .zip(ext.iter().chain(std::iter::repeat(&1.0)))
                .map(|(f, e)| f / e)
                .collect();
            (freqs, attention_factor)
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: orig,
        } => {
            let low_wavelen = orig / low_freq_factor;
            let high_wavelen = orig / high_freq_factor;
            let scaled = base
                .iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (orig / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect();
            (scaled, 1.0)
        }
        RopeScaling::Yarn {
            factor,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            original_max_position_embeddings: orig,
            truncate,
            attention_factor,
        } => {
            let d = dim as f64;
            // The dimension whose wavelength completes `rotations` turns over the original context.
            let correction_dim = |rotations: f64| {
                d * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * rope.theta.ln())
            };
            // transformers `find_correction_range`: rounded outwards unless `truncate: false`
            // (gpt-oss), then clamped to the dims.
            let (low, high) = (correction_dim(beta_fast), correction_dim(beta_slow));
            let (low, high) = if truncate {
                (low.floor(), high.ceil())
            } else {
                (low, high)
            };
            let (low, high) = (low.max(0.0), high.min(d - 1.0));
            let high = if low == high { high + 0.001 } else { high };
            let extrapolated = base.clone();
            let interpolated: Vec<f64> = base.iter().map(|f| f / factor).collect();
            let freqs = (0..dim / 2)
                .map(|i| {
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation_factor = 1.0 - ramp;
                    interpolated[i] * (1.0 - extrapolation_factor)
                        + extrapolated[i] * extrapolation_factor
                })
                .collect();
            let get_mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            // transformers: the ratio when both mscale terms are set (DeepSeek), else mscale(factor).
            let attention_factor = match attention_factor {
                Some(f) => f,
                None if mscale != 0.0 && mscale_all_dim != 0.0 => {
                    get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                }
                None => get_mscale(factor, 1.0),
            };
            (freqs, attention_factor)
        }
    }
}

/// cos/sin tables for positions `0..seq_len`: [seq_len, dim / 2] each, already scaled; in the
/// compute dtype for the candle path and in f32 for the rope kernel.
#[derive(Clone)]
pub struct RopeTables {
    pub cos: Tensor,
    pub sin: Tensor,
    pub cos32: Tensor,
    pub sin32: Tensor,
}

impl RopeTables {
    pub fn new(
        rope: &Rope,
        dim: usize,
        seq_len: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<RopeTables> {
        let (freqs, scale) = inv_freq_for(rope, dim, seq_len);
        // HF rounds inv_freq to f32 before the outer product; so do we.
        let freqs: Vec<f32> = freqs.iter().map(|&f| f as f32).collect();
        let half = dim / 2;
        let mut cos = Vec::with_capacity(seq_len * half);
        let mut sin = Vec::with_capacity(seq_len * half);
        for pos in 0..seq_len {
            for &f in &freqs {
                let angle = pos as f32 * f;
                cos.push(angle.cos() * scale as f32);
                sin.push(angle.sin() * scale as f32);
            }
        }
        let f32s = |v: Vec<f32>| {
            Tensor::from_vec(v, (seq_len, half), device).ctx(|| "rope tables".to_string())
        };
        let (cos32, sin32) = (f32s(cos)?, f32s(sin)?);
        let cast = |t: &Tensor| t.to_dtype(dtype).ctx(|| "rope tables".to_string());
        Ok(RopeTables {
            cos: cast(&cos32)?,
            sin: cast(&sin32)?,
            cos32,
            sin32,
        })
    }

    /// The tables of positions `start..start + len`.
    pub fn rows(&self, start: usize, len: usize) -> Result<RopeTables> {
        let cut = |t: &Tensor| t.narrow(0, start, len).ctx(|| "rope tables".to_string());
        Ok(RopeTables {
            cos: cut(&self.cos)?,
            sin: cut(&self.sin)?,
            cos32: cut(&self.cos32)?,
            sin32: cut(&self.sin32)?,
        })
    }

    /// Rotates `xs`: [heads, seq, dim] in the "rotate half" layout (Llama, Qwen).
    pub fn apply_half(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let dim = xs.dim(D::Minus1)?;
        let cos = Tensor::cat(&[&self.cos, &self.cos], D::Minus1)?;
        let sin = Tensor::cat(&[&self.sin, &self.sin], D::Minus1)?;
        let x1 = xs.narrow(D::Minus1, 0, dim / 2)?;
        let x2 = xs.narrow(D::Minus1, dim / 2, dim / 2)?;
        let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
        xs.broadcast_mul(&cos)?
            .broadcast_add(&rotated.broadcast_mul(&sin)?)
    }

    /// Rope on the leading `rot_dim` dims of each head of `xs` [heads, T, head_dim]
    /// (rotate-half); the rest pass through (transformers `apply_rotary_pos_emb` with a partial
    /// `rotary_dim`: GLM-4.5, MiniMax-M2, Phi-4-mini, Qwen3.5).
    pub fn apply_half_partial(&self, xs: &Tensor, rot_dim: usize) -> candle_core::Result<Tensor> {
        let head_dim = xs.dim(D::Minus1)?;
        if rot_dim == head_dim {
            return self.apply_half(xs);
        }
        let rot = self.apply_half(&xs.narrow(D::Minus1, 0, rot_dim)?.contiguous()?)?;
        let pass = xs.narrow(D::Minus1, rot_dim, head_dim - rot_dim)?;
        Tensor::cat(&[&rot, &pass], D::Minus1)
    }

    /// Rotates `xs`: [heads, seq, dim] whose pairs are interleaved `(x0, x1), (x2, x3), ...`
    /// (DeepSeek's complex-number rope). transformers de-interleaves and rotates halves; the
    /// result is returned in the de-interleaved order, exactly as transformers does
    /// (`apply_rotary_pos_emb_interleave` in modeling_deepseek_v3.py).
    pub fn apply_interleaved(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let (h, s, d) = xs.dims3()?;
        let pairs = xs.reshape((h, s, d / 2, 2))?;
        let even = pairs.narrow(3, 0, 1)?.squeeze(3)?;
        let odd = pairs.narrow(3, 1, 1)?.squeeze(3)?;
        let deinterleaved = Tensor::cat(&[&even, &odd], D::Minus1)?.contiguous()?;
        self.apply_half(&deinterleaved)
    }
}

/// Additive causal mask [seq, seq] (0 allowed, -inf masked), with an optional sliding window
/// (Mistral: key j is visible from query i when `i - j < window`).
pub fn causal_mask(
    seq: usize,
    window: Option<usize>,
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let mut m = vec![0f32; seq * seq];
    for i in 0..seq {
        for j in 0..seq {
            let future = j > i;
            let outside = window.is_some_and(|w| i - j.min(i) >= w);
            if future || outside {
                m[i * seq + j] = f32::NEG_INFINITY;
            }
        }
    }
    Tensor::from_vec(m, (seq, seq), device)
        .and_then(|t| t.to_dtype(dtype))
        .ctx(|| "causal mask".to_string())
}

/// `1 / (1 + e^-x)` elementwise, in the tensor's dtype.
pub fn sigmoid(xs: &Tensor) -> candle_core::Result<Tensor> {
    (xs.neg()?.exp()? + 1.0)?.recip()
}

/// Softmax over the last axis, computed in f32.
pub fn softmax_last(xs: &Tensor) -> candle_core::Result<Tensor> {
    let dtype = xs.dtype();
    let x = xs.to_dtype(DType::F32)?;
    let max = x.max_keepdim(D::Minus1)?;
    let e = x.broadcast_sub(&max)?.exp()?;
    let sum = e.sum_keepdim(D::Minus1)?;
    e.broadcast_div(&sum)?.to_dtype(dtype)
}

/// Scaled dot-product attention with grouped KV heads.
/// `q`: [heads, seq, d], `k`: [kv_heads, seq, d], `v`: [kv_heads, seq, dv], `mask`: [seq, seq].
/// Returns [seq, heads * dv].
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
) -> candle_core::Result<Tensor> {
    attention_with_sinks(q, k, v, mask, scale, None)
}

/// [`attention`] with gpt-oss's attention sinks: `sinks` [heads] joins every softmax row as one
/// more logit with no value (transformers `models/gpt_oss/modeling_gpt_oss.py`
/// `eager_attention_forward`: the sink concatenated to the scores, the row max subtracted, the
/// softmax taken, the sink's column dropped).
pub fn attention_with_sinks(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
    sinks: Option<&Tensor>,
) -> candle_core::Result<Tensor> {
    let (heads, seq, _) = q.dims3()?;
    let kv_heads = k.dim(0)?;
    let (k, v) = if kv_heads != heads {
        let rep = heads / kv_heads;
        let expand = |t: &Tensor| -> candle_core::Result<Tensor> {
            let (kh, s, d) = t.dims3()?;
            t.unsqueeze(1)?
                .broadcast_as((kh, rep, s, d))?
                .reshape((kh * rep, s, d))
        };
        (expand(k)?, expand(v)?)
    } else {
        (k.clone(), v.clone())
    };
    let scores = (q.contiguous()?.matmul(&k.t()?.contiguous()?)? * scale)?;
    let scores = scores.broadcast_add(mask)?;
    let probs = match sinks {
        None => softmax_last(&scores)?,
        Some(s) => {
            let sink = s
                .to_dtype(scores.dtype())?
                .reshape((heads, 1, 1))?
                .broadcast_as((heads, seq, 1))?;
            softmax_last(&Tensor::cat(&[&scores, &sink], D::Minus1)?)?.narrow(D::Minus1, 0, seq)?
        }
    };
    let out = probs.matmul(&v.contiguous()?)?; // [heads, seq, dv]
    let dv = out.dim(2)?;
    out.transpose(0, 1)?
        .contiguous()?
        .reshape((seq, heads * dv))
}
