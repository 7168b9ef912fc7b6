//! Qwen3.5-MoE's text model (`qwen3_5_moe_text`, and the `qwen3_5_moe` wrapper's, its weights
//! under `model.language_model.*`): gated DeltaNet (linear attention) layers between
//! gated-attention layers, every layer's MLP the MoE block ([`MoeBlock`]: softmax top-k
//! renormalised, a shared expert behind its sigmoid gate). The boundary index is unchanged:
//! `b = 0` the embedding, `b = i + 1` the residual stream after layer `i` whatever its mixer,
//! `b = L` after the final norm.
//!
//! References, transformers 5.24 `models/qwen3_5_moe/modeling_qwen3_5_moe.py`:
//! - `Qwen3_5MoeRMSNorm`: `norm(x) * (1 + w)` in f32: the layer norms, q/k norms and the final
//!   norm are loaded with their weight plus one ([`offset_norm`]; exact in f32, the `1 + w`
//!   rounded once to the compute dtype otherwise).
//! - `Qwen3_5MoeAttention`: `q_proj` gives each head its query and an output gate
//!   (`chunk(2)` over `2 * head_dim`); per-head q/k norm, rotate-half rope on the first
//!   `head_dim * partial_rotary_factor` dims (M-RoPE on text is the plain rope:
//!   `recomposition_frequencies` rebuilds it from three equal position rows), softmax scale
//!   `head_dim^-0.5`, the output times `sigmoid(gate)` before `o_proj`.
//! - `Qwen3_5MoeGatedDeltaNet`: `in_proj_qkv`, a depthwise causal `conv1d` of
//!   `linear_conv_kernel_dim` taps and SiLU (`causal_conv1d_fn`), q/k/v split, `beta =
//!   sigmoid(in_proj_b)`, `g = -exp(A_log) * softplus(in_proj_a + dt_bias)`, the gated delta
//!   rule (`torch_recurrent_gated_delta_rule`: q and k L2-normalised with eps 1e-6, q times
//!   `k_dim^-0.5`, each key head serving `value_heads / key_heads` consecutive value heads; in
//!   f32), `Qwen3_5MoeRMSNormGated` (`w * norm(x)` rounded to the dtype, times `silu(z)`), then
//!   `out_proj`. transformers' prefill takes `torch_chunk_gated_delta_rule`, the same
//!   recurrence evaluated chunk by chunk in f32; we run the recurrence token by token.
//!
//! Qwen3-Next (`qwen3_next`, transformers 5.24 `models/qwen3_next/modeling_qwen3_next.py`) is
//! this decoder with its data laid out otherwise, which the config resolves
//! ([`DeltaNet::grouped_projections`], its MoE layers):
//! - `Qwen3NextGatedDeltaNet` holds q, k, v and z in one `in_proj_qkvz` and b, a in one
//!   `in_proj_ba`, grouped by key head (`fix_query_key_value_ordering`: per key head `[q (dk),
//!   k (dk), v (per dv), z (per dv)]` and `[b (per), a (per)]`, `per` = value heads per key
//!   head); its rows are regrouped on load into Qwen3.5's four projections, whose forward is
//!   the same (`torch.cat((query, key, value))` into the conv, `Qwen3NextRMSNormGated`,
//!   `Qwen3NextRMSNorm`'s `1 + w`, `Qwen3NextAttention`'s output gate, the default rope on
//!   `partial_rotary_factor` (0.25) of each head).
//! - `Qwen3NextDecoderLayer`: `Qwen3NextSparseMoeBlock` (softmax top-k, renormalised with
//!   `norm_topk_prob`, a shared expert behind its sigmoid gate) unless the layer is in
//!   `mlp_only_layers` or off the `decoder_sparse_step`, then `Qwen3NextMLP` of
//!   `intermediate_size`.

use crate::config::{DeltaNet, ModelConfig};
use crate::error::{CandleContext, Error, Result};
use crate::model::gemma::offset_norm;
use crate::model::moe::{Ffn, MoeBlock, QWEN_NAMES, get_f32, residual_step};
use crate::model::nn::{Linear, Mlp, RmsNorm, RopeTables, attention, causal_mask, sigmoid};
use crate::model::source::Vb;
use crate::model::{ComputePath, Decoder, LayerStep};
use candle_core::{D, DType, Device, Tensor};

/// A full-attention layer's mixer: attention with a per-head output gate.
struct GatedAttention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    rot_dim: usize,
}

impl GatedAttention {
    fn load(cfg: &ModelConfig, vb: &Vb, dtype: DType) -> Result<GatedAttention> {
        let (h, nh, nkv, hd) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let bias = cfg.attention_bias;
        let eps = cfg.rms_norm_eps;
        Ok(GatedAttention {
            q: Linear::load(&vb.pp("q_proj"), 2 * nh * hd, h, bias)?,
            k: Linear::load(&vb.pp("k_proj"), nkv * hd, h, bias)?,
            v: Linear::load(&vb.pp("v_proj"), nkv * hd, h, bias)?,
            o: Linear::load(&vb.pp("o_proj"), h, nh * hd, bias)?,
            q_norm: offset_norm(&vb.pp("q_norm"), hd, eps, dtype)?,
            k_norm: offset_norm(&vb.pp("k_norm"), hd, eps, dtype)?,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            rot_dim: cfg.rotary_dim,
        })
    }

    /// `xs`: [T, H] -> [T, H].
    fn forward(&self, xs: &Tensor, ctx: &Ctx) -> candle_core::Result<Tensor> {
        let t = xs.dim(0)?;
        let (nh, nkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let qg = self.q.forward(xs)?.reshape((t, nh, 2 * hd))?;
        let query = qg.narrow(2, 0, hd)?.contiguous()?;
        let gate = qg.narrow(2, hd, hd)?.contiguous()?.reshape((t, nh * hd))?;
        let heads = |x: Tensor| x.transpose(0, 1)?.contiguous();
        let q = heads(self.q_norm.forward(&query)?)?;
        let k = heads(
            self.k_norm
                .forward(&self.k.forward(xs)?.reshape((t, nkv, hd))?)?,
        )?;
        let v = heads(self.v.forward(xs)?.reshape((t, nkv, hd))?)?;
        let rotate = |x: &Tensor| ctx.rope.apply_half_partial(x, self.rot_dim);
        let (q, k) = (rotate(&q)?, rotate(&k)?);
        let out = attention(&q, &k, &v, &ctx.mask, 1.0 / (hd as f64).sqrt())?;
        let gated = out.mul(&sigmoid(&gate)?)?;
        self.o.forward(&gated)
    }
}

fn silu(xs: &Tensor) -> candle_core::Result<Tensor> {
    xs.mul(&sigmoid(xs)?)
}

/// `log(1 + e^x)` as torch's `softplus` computes it (beta 1, `log1p(exp(x))`, linear above
/// the threshold 20), element by element on the host: candle has no `log1p`, and
/// `log(1 + e^x)` loses the digits of a small `e^x`. `xs`: f32 [T, heads].
fn softplus(xs: &Tensor) -> candle_core::Result<Tensor> {
    let v: Vec<f32> = xs.flatten_all()?.to_vec1()?;
    let soft: Vec<f32> = v
        .iter()
        .map(|&x| if x > 20.0 { x } else { x.exp().ln_1p() })
        .collect();
    Tensor::from_vec(soft, xs.shape(), xs.device())
}

/// A linear-attention layer's mixer.
struct DeltaNetMixer {
    in_qkv: Linear,
    in_z: Linear,
    in_b: Linear,
    in_a: Linear,
    /// [channels, taps]
    conv: Tensor,
    /// [value heads] f32
    dt_bias: Tensor,
    /// [value heads] f32: `-exp(A_log)`.
    neg_a: Tensor,
    norm: RmsNorm,
    out: Linear,
    net: DeltaNet,
}

impl DeltaNetMixer {
    fn load(cfg: &ModelConfig, net: &DeltaNet, vb: &Vb) -> Result<DeltaNetMixer> {
        let h = cfg.hidden_size;
        let (kd, vd) = (net.key_heads * net.key_dim, net.value_heads * net.value_dim);
        let channels = 2 * kd + vd;
        let conv = vb
            .get("conv1d.weight", &[channels, 1, net.conv_kernel])?
            .squeeze(1)
            .ctx(|| vb.path("conv1d.weight"))?;
        let a_log = get_f32(vb, "A_log", &[net.value_heads])?;
        let [in_qkv, in_z, in_b, in_a] = if net.grouped_projections {
            Self::ungroup(net, vb, h)?
        } else {
            [
                Linear::load(&vb.pp("in_proj_qkv"), channels, h, false)?,
                Linear::load(&vb.pp("in_proj_z"), vd, h, false)?,
                Linear::load(&vb.pp("in_proj_b"), net.value_heads, h, false)?,
                Linear::load(&vb.pp("in_proj_a"), net.value_heads, h, false)?,
            ]
        };
        Ok(DeltaNetMixer {
            in_qkv,
            in_z,
            in_b,
            in_a,
            conv,
            dt_bias: vb
                .get("dt_bias", &[net.value_heads])?
                .to_dtype(DType::F32)
                .ctx(|| vb.path("dt_bias"))?,
            neg_a: a_log.exp().and_then(|a| a.neg()).ctx(|| vb.path("A_log"))?,
            norm: RmsNorm::load(&vb.pp("norm"), net.value_dim, cfg.rms_norm_eps)?,
            out: Linear::load(&vb.pp("out_proj"), h, vd, false)?,
            net: net.clone(),
        })
    }

    /// Qwen3-Next's `in_proj_qkvz` / `in_proj_ba`, grouped by key head, as Qwen3.5's
    /// `[in_proj_qkv, in_proj_z, in_proj_b, in_proj_a]`: the rows regrouped so that q, k and v
    /// are each head-major over all heads, as `fix_query_key_value_ordering` and
    /// `torch.cat((query, key, value))` leave them for the conv.
    fn ungroup(net: &DeltaNet, vb: &Vb, h: usize) -> Result<[Linear; 4]> {
        let (nk, nv, dk, dv) = (net.key_heads, net.value_heads, net.key_dim, net.value_dim);
        let per = nv / nk;
        let group = 2 * dk + 2 * per * dv;
        let qkvz = Linear::load(&vb.pp("in_proj_qkvz"), nk * group, h, false)?;
        let ba = Linear::load(&vb.pp("in_proj_ba"), 2 * nv, h, false)?;
        // Rows `start..start + len` of every group of `size` rows.
        let rows = |size: usize, start: usize, len: usize| -> Vec<u32> {
            (0..nk)
                .flat_map(|g| (g * size + start..g * size + start + len).map(|r| r as u32))
                .collect()
        };
        let pick = |l: &Linear, idx: Vec<u32>| -> candle_core::Result<Linear> {
            let idx = Tensor::new(idx.as_slice(), l.weight.device())?;
            Ok(Linear {
                weight: l.weight.index_select(&idx, 0)?,
                bias: None,
            })
        };
        let split = || -> candle_core::Result<[Linear; 4]> {
            let mut qkv = rows(group, 0, dk);
            qkv.extend(rows(group, dk, dk));
            qkv.extend(rows(group, 2 * dk, per * dv));
            Ok([
                pick(&qkvz, qkv)?,
                pick(&qkvz, rows(group, 2 * dk + per * dv, per * dv))?,
                pick(&ba, rows(2 * per, 0, per))?,
                pick(&ba, rows(2 * per, per, per))?,
            ])
        };
        split().ctx(|| vb.path("in_proj_qkvz|in_proj_ba"))
    }

    /// The depthwise causal convolution and SiLU (`causal_conv1d_fn`): `xs` [T, C] ->
    /// [T, C], output t the taps' sum over inputs t - K + 1 ..= t (zeros before the start).
    fn conv_silu(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let (t, c) = xs.dims2()?;
        let taps = self.net.conv_kernel;
        let padded = Tensor::cat(
            &[&Tensor::zeros((taps - 1, c), xs.dtype(), xs.device())?, xs],
            0,
        )?;
        let w = self.conv.t()?.contiguous()?; // [K, C]
        let mut acc = padded.narrow(0, 0, t)?.broadcast_mul(&w.narrow(0, 0, 1)?)?;
        for k in 1..taps {
            acc = (acc + padded.narrow(0, k, t)?.broadcast_mul(&w.narrow(0, k, 1)?)?)?;
        }
        silu(&acc)
    }

    /// `xs` [.., d] over `sqrt(sum x^2 + 1e-6)` (the `l2norm` of the FLA kernels).
    fn l2(xs: &Tensor) -> candle_core::Result<Tensor> {
        let n = (xs.sqr()?.sum_keepdim(D::Minus1)? + 1e-6)?.sqrt()?;
        xs.broadcast_div(&n)
    }

    /// `xs`: [T, H] -> [T, H].
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let t = xs.dim(0)?;
        let n = &self.net;
        let (nk, nv, dk, dv) = (n.key_heads, n.value_heads, n.key_dim, n.value_dim);
        let mixed = self.conv_silu(&self.in_qkv.forward(xs)?)?;
        let f32 = |x: Tensor| x.to_dtype(DType::F32);
        let q = f32(mixed.narrow(1, 0, nk * dk)?)?.reshape((t, nk, dk))?;
        let k = f32(mixed.narrow(1, nk * dk, nk * dk)?)?.reshape((t, nk, dk))?;
        let v = f32(mixed.narrow(1, 2 * nk * dk, nv * dv)?)?.reshape((t, nv, dv))?;
        // Each key head serves `nv / nk` consecutive value heads (`repeat_interleave`).
        let per = nv / nk;
        let spread = |x: Tensor| -> candle_core::Result<Tensor> {
            x.unsqueeze(2)?
                .broadcast_as((t, nk, per, dk))?
                .reshape((t, nv, dk))
        };
        let q = (Self::l2(&spread(q)?)? * (1.0 / (dk as f64).sqrt()))?;
        let k = Self::l2(&spread(k)?)?;
        let beta = f32(sigmoid(&self.in_b.forward(xs)?)?)?; // [T, nv]
        let a = f32(self.in_a.forward(xs)?)?.broadcast_add(&self.dt_bias)?;
        let decay = softplus(&a)?.broadcast_mul(&self.neg_a)?.exp()?; // exp(g) [T, nv]
        let mut state = Tensor::zeros((nv, dk, dv), DType::F32, xs.device())?;
        let mut outs = Vec::with_capacity(t);
        for i in 0..t {
            let row = |x: &Tensor| x.narrow(0, i, 1)?.squeeze(0);
            let (q_t, k_t, v_t) = (row(&q)?, row(&k)?, row(&v)?);
            state = state.broadcast_mul(&row(&decay)?.reshape((nv, 1, 1))?)?;
            let k_col = k_t.unsqueeze(2)?; // [nv, dk, 1]
            let kv_mem = state.broadcast_mul(&k_col)?.sum(1)?; // [nv, dv]
            let delta = (v_t - kv_mem)?.broadcast_mul(&row(&beta)?.unsqueeze(1)?)?;
            state = (state + k_col.broadcast_mul(&delta.unsqueeze(1)?)?)?;
            outs.push(state.broadcast_mul(&q_t.unsqueeze(2)?)?.sum(1)?); // [nv, dv]
        }
        let core = Tensor::stack(&outs, 0)?.to_dtype(xs.dtype())?; // [T, nv, dv]
        // `Qwen3_5MoeRMSNormGated`: the weight times the normed rows (rounded to the dtype),
        // times silu(z) in f32, rounded once more.
        let normed = self.norm.forward(&core.reshape((t * nv, dv))?)?;
        let z = f32(self.in_z.forward(xs)?.reshape((t * nv, dv))?)?;
        let gated = f32(normed)?.mul(&silu(&z)?)?.to_dtype(xs.dtype())?;
        self.out.forward(&gated.reshape((t, nv * dv))?)
    }
}

enum Mixer {
    Linear(Box<DeltaNetMixer>),
    Full(GatedAttention),
}

pub(crate) struct Layer {
    input_norm: RmsNorm,
    mixer: Mixer,
    post_norm: RmsNorm,
    ffn: Ffn,
}

/// The Qwen3.5-MoE and Qwen3-Next decoder ([`Decoder`]).
pub(crate) struct Qwen35Decoder {
    cfg: ModelConfig,
    net: DeltaNet,
    dtype: DType,
    path: ComputePath,
}

impl Qwen35Decoder {
    /// Checks the config before any weight is read.
    pub(crate) fn new(cfg: &ModelConfig, dtype: DType, path: ComputePath) -> Result<Self> {
        let Some(net) = cfg.delta_net.clone() else {
            return Err(Error::config(
                &cfg.path,
                format!("{} has no linear-attention settings", cfg.model_type),
            ));
        };
        Ok(Qwen35Decoder {
            cfg: cfg.clone(),
            net,
            dtype,
            path,
        })
    }
}

/// Rope tables and the causal mask, built on every compute path (this family's mixers run
/// as candle ops on each; its MoE blocks take the kernel path where asked).
pub(crate) struct Ctx {
    rope: RopeTables,
    mask: Tensor,
}

impl Decoder for Qwen35Decoder {
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
        let mixer = if self.net.linear_layers[i] {
            Mixer::Linear(Box::new(DeltaNetMixer::load(
                cfg,
                &self.net,
                &l.pp("linear_attn"),
            )?))
        } else {
            Mixer::Full(GatedAttention::load(cfg, &l.pp("self_attn"), self.dtype)?)
        };
        let moe = cfg.moe.as_ref().ok_or_else(|| {
            Error::config(
                &cfg.path,
                format!("{} without MoE settings", cfg.model_type),
            )
        })?;
        let ffn = if moe.is_moe_layer(i) {
            Ffn::Moe(Box::new(MoeBlock::load(
                cfg,
                moe,
                &l.pp("mlp"),
                &QWEN_NAMES,
            )?))
        } else {
            Ffn::Dense(Mlp::load(&l.pp("mlp"), h, cfg.intermediate_size)?)
        };
        Ok(Layer {
            input_norm: offset_norm(&l.pp("input_layernorm"), h, eps, self.dtype)?,
            mixer,
            post_norm: offset_norm(&l.pp("post_attention_layernorm"), h, eps, self.dtype)?,
            ffn,
        })
    }

    fn context(&self, t: usize, device: &Device) -> Result<Ctx> {
        Ok(Ctx {
            rope: RopeTables::new(&self.cfg.rope, self.cfg.rotary_dim, t, self.dtype, device)?,
            mask: causal_mask(t, None, self.dtype, device)?,
        })
    }

    fn final_norm(&self, m: &Vb) -> Result<RmsNorm> {
        offset_norm(
            &m.pp("norm"),
            self.cfg.hidden_size,
            self.cfg.rms_norm_eps,
            self.dtype,
        )
    }

    fn step(&self, layer: &Layer, i: usize, xs: &Tensor, ctx: &Ctx) -> Result<LayerStep> {
        let mix = |normed: &Tensor| match &layer.mixer {
            Mixer::Linear(net) => net.forward(normed),
            Mixer::Full(attn) => attn.forward(normed, ctx),
        };
        residual_step(
            i,
            xs,
            self.path,
            &layer.input_norm,
            &layer.post_norm,
            &layer.ffn,
            mix,
            mix,
        )
    }
}
