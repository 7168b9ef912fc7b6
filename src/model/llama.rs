//! Llama-family targets: `llama` (incl. llama3 rope scaling), `mistral` (sliding window),
//! `qwen2` (q/k/v bias), `qwen3` (per-head q/k RMSNorm), `phi3` (Phi-3/4). GQA, tied
//! embeddings.
//! Reference: transformers `models/{llama,mistral,qwen2,qwen3}/modeling_*.py`.
//!
//! Phi-3/4 is Llama with its data laid out otherwise (transformers 5.24
//! `models/phi3/modeling_phi3.py`): `Phi3Attention` holds q, k and v as one `qkv_proj` (rows
//! `[q | k | v]`, no bias), split here into views of its rows; `Phi3MLP` holds `gate_up_proj`
//! (`chunk(2)`: gate the first half, up the second) and computes `down(up * silu(gate))`;
//! `apply_rotary_pos_emb` rotates the leading `head_dim * partial_rotary_factor` dims
//! (Phi-4-mini 0.75) rotate-half and passes the rest; `Phi3Model` masks every layer with
//! `sliding_window` when set; `Phi3RotaryEmbedding` with `longrope` is
//! `_compute_longrope_parameters` ([`crate::config::RopeScaling::LongRope`]). The decoder layer
//! (`Phi3DecoderLayer`) is Llama's: the dropouts are identities at inference.

use crate::config::{Arch, ModelConfig, QkNorm};
use crate::error::{CandleContext, Error, Result};
use crate::kernels::{self, AttnParams, RopeParams};
use crate::model::cpu::{self, Held};
use crate::model::nn::{Linear, Mlp, RmsNorm, RopeTables, attention_with_sinks, causal_mask};
use crate::model::source::Vb;
use crate::model::{ComputePath, Decoder, LayerStep, phases};
use crate::naming;
use candle_core::{DType, Device, Tensor};

/// Grouped-query attention as the Llama family and the GQA MoE families compute it: q/k/v
/// projections (biases as configured), an optional q/k RMSNorm (per head, or over the whole
/// projection), rope on the leading `rot_dim` dims of each head (rotate-half), a causal mask
/// with this layer's sliding window, and gpt-oss's sinks.
pub(crate) struct Attention {
    pub(crate) q: Linear,
    pub(crate) k: Linear,
    pub(crate) v: Linear,
    pub(crate) o: Linear,
    pub(crate) q_norm: Option<RmsNorm>,
    pub(crate) k_norm: Option<RmsNorm>,
    /// Gemma-4: the values RMS-normalised per head (no weight: ones), before attention.
    pub(crate) v_norm: Option<RmsNorm>,
    /// Whether q_norm/k_norm span the whole projection ([`QkNorm::Full`]) or one head.
    full_qk_norm: bool,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// The leading dims of each head rope rotates (partial rotary when < `head_dim`).
    rot_dim: usize,
    window: Option<usize>,
    /// gpt-oss: `[heads]` f32 logits in every softmax denominator.
    sinks: Option<Tensor>,
    /// The softmax scale: `head_dim ** -0.5`, Gemma's `query_pre_attn_scalar ** -0.5`.
    scale: f64,
    /// `q|k|v` as one `[(heads + 2 kv_heads) * head_dim, H]` projection, for the CPU forward
    /// ([`cpu`]); `q`, `k` and `v` are then views of its rows.
    qkv: Option<Linear>,
}

impl Attention {
    /// Layer `layer`'s attention. With `fuse`, q, k and v are loaded into one projection
    /// ([`Attention::qkv`]).
    pub(crate) fn load(cfg: &ModelConfig, vb: &Vb, fuse: bool, layer: usize) -> Result<Attention> {
        let (h, nh, nkv, hd) = (
            cfg.hidden_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        );
        let bias = cfg.attention_bias;
        let (q_norm, k_norm) = match cfg.qk_norm {
            QkNorm::None => (None, None),
            QkNorm::PerHead => (
                Some(RmsNorm::load(&vb.pp("q_norm"), hd, cfg.rms_norm_eps)?),
                Some(RmsNorm::load(&vb.pp("k_norm"), hd, cfg.rms_norm_eps)?),
            ),
            QkNorm::Full => (
                Some(RmsNorm::load(&vb.pp("q_norm"), nh * hd, cfg.rms_norm_eps)?),
                Some(RmsNorm::load(&vb.pp("k_norm"), nkv * hd, cfg.rms_norm_eps)?),
            ),
        };
        let (q, k, v, qkv) = if cfg.arch == Arch::Phi3 {
            // Phi-3's checkpoint holds the fused projection: q, k and v are views of its rows.
            let qkv = Linear::load(&vb.pp("qkv_proj"), (nh + 2 * nkv) * hd, h, bias)?;
            let split = || -> candle_core::Result<_> {
                Ok((
                    qkv.rows(0, nh * hd)?,
                    qkv.rows(nh * hd, nkv * hd)?,
                    qkv.rows((nh + nkv) * hd, nkv * hd)?,
                ))
            };
            let (q, k, v) = split().ctx(|| vb.path("qkv_proj"))?;
            (q, k, v, fuse.then_some(qkv))
        } else {
            load_qkv(vb, (nh, nkv, hd), h, bias, fuse)?
        };
        let sinks = if cfg.attn_sinks {
            Some(crate::model::moe::get_f32(vb, "sinks", &[nh])?)
        } else {
            None
        };
        Ok(Attention {
            q,
            k,
            v,
            o: Linear::load(&vb.pp("o_proj"), h, nh * hd, cfg.o_bias)?,
            q_norm,
            k_norm,
            v_norm: None,
            full_qk_norm: cfg.qk_norm == QkNorm::Full,
            heads: nh,
            kv_heads: nkv,
            head_dim: hd,
            rot_dim: cfg.rotary_dim,
            window: cfg.window_of(layer),
            sinks,
            scale: cfg.gemma.as_ref().map_or(1.0 / (hd as f64).sqrt(), |g| {
                g.query_pre_attn_scalar.powf(-0.5)
            }),
            qkv,
        })
    }

    /// Attention from its projections and per-head norms, with this layer's own shape (Gemma-4,
    /// whose full-attention layers have other head dims and KV heads than its sliding ones):
    /// rope rotates whole heads, no sinks, q/k/v not fused.
    pub(crate) fn with_shape(
        [q, k, v, o]: [Linear; 4],
        [q_norm, k_norm, v_norm]: [Option<RmsNorm>; 3],
        shape: AttnShape,
    ) -> Attention {
        Attention {
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
            v_norm,
            full_qk_norm: false,
            heads: shape.heads,
            kv_heads: shape.kv_heads,
            head_dim: shape.head_dim,
            rot_dim: shape.head_dim,
            window: shape.window,
            sinks: None,
            scale: shape.scale,
            qkv: None,
        }
    }

    pub(crate) fn window(&self) -> Option<usize> {
        self.window
    }

    pub(crate) fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The kernel path: token-major `[T, heads * d]` throughout, rope in place, flash
    /// attention (kernels/rope.cu, kernels/attention.cu). `xs`: [T, H] -> [T, H]
    pub(crate) fn forward_kernels(
        &self,
        xs: &Tensor,
        rope: &RopeTables,
    ) -> candle_core::Result<Tensor> {
        self.forward_kernels_packed(xs, rope, &Packed::default())
    }

    /// [`Attention::forward_kernels`] over the sequences `packed` lays out in `xs`'s rows
    /// (rope `rope`'s rows restart with each): flash attention runs on each one's rows.
    pub(crate) fn forward_kernels_packed(
        &self,
        xs: &Tensor,
        rope: &RopeTables,
        packed: &Packed,
    ) -> candle_core::Result<Tensor> {
        let t = xs.dim(0)?;
        let (nh, nkv, hd) = (self.heads, self.kv_heads, self.head_dim);
        let mut q = self.q.forward(xs)?.contiguous()?;
        let mut k = self.k.forward(xs)?.contiguous()?;
        let mut v = self.v.forward(xs)?;
        if let Some(vn) = &self.v_norm {
            v = vn
                .forward(&v.reshape((t * nkv, hd))?)?
                .reshape((t, nkv * hd))?;
        }
        if let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm) {
            if self.full_qk_norm {
                q = qn.forward(&q)?;
                k = kn.forward(&k)?;
            } else {
                q = qn
                    .forward(&q.reshape((t * nh, hd))?)?
                    .reshape((t, nh * hd))?;
                k = kn
                    .forward(&k.reshape((t * nkv, hd))?)?
                    .reshape((t, nkv * hd))?;
            }
        }
        let rot = |heads| RopeParams {
            rot_dim: self.rot_dim,
            ..RopeParams::half(heads, hd)
        };
        kernels::rope_in_place(&q, &rope.cos32, &rope.sin32, &rot(nh))?;
        kernels::rope_in_place(&k, &rope.cos32, &rope.sin32, &rot(nkv))?;
        let params = AttnParams {
            nh,
            nkv,
            dk: hd,
            dv: hd,
            scale: self.scale,
            window: self.window,
        };
        let out = packed.each(t, |a, len, _| {
            let rows = |x: &Tensor| x.narrow(0, a, len);
            kernels::flash_attention_with_sinks(
                &rows(&q)?,
                &rows(&k)?,
                &rows(&v)?,
                &params,
                self.sinks.as_ref(),
            )
        })?;
        self.o.forward(&out)
    }

    /// `xs`: [T, H] -> [T, H]; `mask` is this layer's ([`Attention::window`]).
    pub(crate) fn forward(
        &self,
        xs: &Tensor,
        rope: &RopeTables,
        mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        self.forward_packed(xs, rope, mask, &Packed::default())
    }

    /// [`Attention::forward`] over the sequences `packed` lays out in `xs`'s rows: attention
    /// runs on each one's rows under its own mask (`mask` is the whole forward's when there
    /// is one sequence).
    pub(crate) fn forward_packed(
        &self,
        xs: &Tensor,
        rope: &RopeTables,
        mask: &Tensor,
        packed: &Packed,
    ) -> candle_core::Result<Tensor> {
        let t = xs.dim(0)?;
        let split = |y: Tensor, n: usize| y.reshape((t, n, self.head_dim))?.transpose(0, 1);
        let (mut q, mut k) = (self.q.forward(xs)?, self.k.forward(xs)?);
        if self.full_qk_norm
            && let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm)
        {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let mut q = split(q, self.heads)?;
        let mut k = split(k, self.kv_heads)?;
        let mut v = split(self.v.forward(xs)?, self.kv_heads)?;
        if let Some(vn) = &self.v_norm {
            v = vn.forward(&v)?;
        }
        if !self.full_qk_norm
            && let (Some(qn), Some(kn)) = (&self.q_norm, &self.k_norm)
        {
            q = qn.forward(&q)?;
            k = kn.forward(&k)?;
        }
        let q = rope.apply_half_partial(&q.contiguous()?, self.rot_dim)?;
        let k = rope.apply_half_partial(&k.contiguous()?, self.rot_dim)?;
        let out = packed.each(t, |a, len, m| {
            let rows = |x: &Tensor| x.narrow(1, a, len);
            let mask = m.unwrap_or(mask);
            attention_with_sinks(
                &rows(&q)?,
                &rows(&k)?,
                &rows(&v)?,
                mask,
                self.scale,
                self.sinks.as_ref(),
            )
        })?;
        self.o.forward(&out)
    }
}

/// The sequences packed one after another in the rows of one forward (`(first row, rows)`
/// each, with the candle path's causal mask of each); none for a forward of one sequence.
#[derive(Default)]
pub(crate) struct Packed {
    spans: Vec<(usize, usize)>,
    masks: Vec<Tensor>,
}

impl Packed {
    /// Sequences of `lens` tokens, one after another; `mask(len)` makes each one's mask.
    pub(crate) fn new(lens: &[usize], mask: impl Fn(usize) -> Result<Tensor>) -> Result<Packed> {
        let mut spans = Vec::with_capacity(lens.len());
        let mut at = 0;
        for &len in lens {
            spans.push((at, len));
            at += len;
        }
        Ok(Packed {
            spans,
            masks: lens.iter().map(|&len| mask(len)).collect::<Result<_>>()?,
        })
    }

    /// `f(first row, rows, mask)` on each sequence, the results stacked row-wise; on all `t`
    /// rows at once (no mask of its own) when nothing is packed.
    pub(crate) fn each(
        &self,
        t: usize,
        f: impl Fn(usize, usize, Option<&Tensor>) -> candle_core::Result<Tensor>,
    ) -> candle_core::Result<Tensor> {
        let mut parts = self
            .spans(t)
            .into_iter()
            .enumerate()
            .map(|(i, (a, len))| f(a, len, self.masks.get(i)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        if parts.len() == 1 {
            return Ok(parts.remove(0));
        }
        Tensor::cat(&parts, 0)
    }

    /// Each sequence's `(first row, rows)`; `[(0, t)]` when nothing is packed.
    pub(crate) fn spans(&self, t: usize) -> Vec<(usize, usize)> {
        if self.spans.is_empty() {
            vec![(0, t)]
        } else {
            self.spans.clone()
        }
    }
}

/// Rope tables kept across forwards, one per set of frequencies (every rope has one; LongRoPE
/// two, short and long), each as long as the longest sequence that asked for it: a packed
/// forward's tables are rows of these, gathered on the device. Computing them on the host for
/// every forward (sine and cosine of each position and frequency, per sample) left the device
/// idle 4.6 ms per packed forward of 4,096 tokens on the H100 machines (BENCHMARKS.md, run 62).
#[derive(Default)]
pub(crate) struct RopeCache {
    tables: std::sync::Mutex<Vec<CachedRope>>,
}

/// Tables for positions `0..len` of the rope whose frequencies and scale have the bits `key`.
struct CachedRope {
    key: Vec<u64>,
    len: usize,
    tables: RopeTables,
}

/// The bits of the frequencies and scale a sequence of `len` tokens is rotated with: two
/// sequences of one key have the same table row at every position they share.
fn rope_key(rope: &crate::config::Rope, dim: usize, len: usize) -> Vec<u64> {
    let (freqs, scale) = crate::model::nn::inv_freq_for(rope, dim, len);
    freqs
        .iter()
        .chain(std::iter::once(&scale))
        .map(|f| f.to_bits())
        .collect()
}

impl RopeCache {
    /// The tables of sequences of `lens` tokens packed one after another, positions restarting
    /// at 0 for each: the rows of each sequence's own [`RopeTables::new`], bit for bit.
    pub(crate) fn packed(
        &self,
        rope: &crate::config::Rope,
        dim: usize,
        lens: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<RopeTables> {
        let mut cache = self
            .tables
            .lock()
            .map_err(|_| Error::Device("rope table cache poisoned".into()))?;
        let fits = |c: &CachedRope| {
            c.tables.cos.dtype() == dtype && c.tables.cos.device().same_device(device)
        };
        // The longest sequence of each key, in the order the keys first come: its table must
        // reach that far (grown to a length of the key, it keeps the key's frequencies).
        let keys: Vec<Vec<u64>> = lens.iter().map(|&len| rope_key(rope, dim, len)).collect();
        let mut longest: Vec<(&Vec<u64>, usize)> = Vec::new();
        for (key, &len) in keys.iter().zip(lens) {
            match longest.iter_mut().find(|(k, _)| *k == key) {
                Some((_, n)) => *n = (*n).max(len),
                None => longest.push((key, len)),
            }
        }
        // Each key's place in the cache, and where its rows start in the table of all keys'.
        let mut places = Vec::with_capacity(longest.len());
        let mut start = 0;
        for (key, len) in longest {
            let grown = || -> Result<CachedRope> {
                Ok(CachedRope {
                    key: key.clone(),
                    len,
                    tables: RopeTables::new(rope, dim, len, dtype, device)?,
                })
            };
            let at = match cache.iter().position(|c| &c.key == key && fits(c)) {
                Some(at) if cache[at].len >= len => at,
                Some(at) => {
                    cache[at] = grown()?;
                    at
                }
                None => {
                    cache.push(grown()?);
                    cache.len() - 1
                }
            };
            places.push((key, at, start));
            start += cache[at].len;
        }
        if let ([len], [(_, at, _)]) = (lens, places.as_slice()) {
            return cache[*at].tables.rows(0, *len);
        }
        let idx: Vec<u32> = keys
            .iter()
            .zip(lens)
            .flat_map(|(key, &len)| {
                let start = places.iter().find(|(k, ..)| *k == key).map_or(0, |p| p.2);
                (start..start + len).map(|p| p as u32)
            })
            .collect();
        let n = idx.len();
        let idx = Tensor::from_vec(idx, n, device).ctx(|| "packed rope rows".to_string())?;
        let gather = |f: fn(&RopeTables) -> &Tensor| -> Result<Tensor> {
            let parts: Vec<&Tensor> = places
                .iter()
                .map(|&(_, at, _)| f(&cache[at].tables))
                .collect();
            let all = if parts.len() == 1 {
                parts[0].clone()
            } else {
                Tensor::cat(&parts, 0).ctx(|| "packed rope tables".to_string())?
            };
            all.index_select(&idx, 0)
                .ctx(|| "packed rope tables".to_string())
        };
        let (cos32, sin32) = (gather(|r| &r.cos32)?, gather(|r| &r.sin32)?);
        // In f32 the compute dtype's tables are the f32 ones (RopeTables::new's cast keeps them).
        let (cos, sin) = if dtype == DType::F32 {
            (cos32.clone(), sin32.clone())
        } else {
            (gather(|r| &r.cos)?, gather(|r| &r.sin)?)
        };
        Ok(RopeTables {
            cos,
            sin,
            cos32,
            sin32,
        })
    }
}

/// One layer's attention shape, for [`Attention::with_shape`].
pub(crate) struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub window: Option<usize>,
    /// The softmax scale.
    pub scale: f64,
}

/// q, k and v from their own projections; with `fuse`, stacked into one whose row views they
/// become ([`Attention::qkv`]). `(heads, kv_heads, head_dim)`.
type Qkv = (Linear, Linear, Linear, Option<Linear>);
fn load_qkv(
    vb: &Vb,
    (nh, nkv, hd): (usize, usize, usize),
    h: usize,
    bias: bool,
    fuse: bool,
) -> Result<Qkv> {
    let q = Linear::load(&vb.pp("q_proj"), nh * hd, h, bias)?;
    let k = Linear::load(&vb.pp("k_proj"), nkv * hd, h, bias)?;
    let v = Linear::load(&vb.pp("v_proj"), nkv * hd, h, bias)?;
    if !fuse {
        return Ok((q, k, v, None));
    }
    let fused = || -> candle_core::Result<_> {
        let qkv = Linear::concat(&[&q, &k, &v])?;
        Ok((
            qkv.rows(0, nh * hd)?,
            qkv.rows(nh * hd, nkv * hd)?,
            qkv.rows((nh + nkv) * hd, nkv * hd)?,
            Some(qkv),
        ))
    };
    fused().ctx(|| vb.path("q|k|v"))
}

pub(crate) struct Layer {
    pub(crate) input_norm: RmsNorm,
    pub(crate) attn: Attention,
    pub(crate) post_norm: RmsNorm,
    pub(crate) mlp: Mlp,
    /// `gate|up` as one `[2 * inter, H]` projection, for the CPU forward ([`cpu`]); the MLP's
    /// `gate` and `up` are then views of its rows.
    gate_up: Option<Linear>,
}

impl Layer {
    /// Decoder layer `i` under the decoder prefix `m`; with `fuse`, laid out for the CPU
    /// forward (`q|k|v` and `gate|up` each one projection).
    pub(crate) fn load(cfg: &ModelConfig, m: &Vb, i: usize, fuse: bool) -> Result<Layer> {
        let (h, eps, inter) = (cfg.hidden_size, cfg.rms_norm_eps, cfg.intermediate_size);
        let l = m.pp(format!("layers.{i}"));
        if cfg.arch == Arch::Phi3 {
            return Layer::load_phi3(cfg, &l, i, fuse);
        }
        let mut mlp = Mlp::load_biased(&l.pp("mlp"), h, inter, cfg.mlp_bias)?;
        let gate_up = if fuse {
            let fused = || -> candle_core::Result<(Linear, Linear, Linear)> {
                let gate_up = Linear::concat(&[&mlp.gate, &mlp.up])?;
                Ok((
                    gate_up.rows(0, inter)?,
                    gate_up.rows(inter, inter)?,
                    gate_up,
                ))
            };
            let (gate, up, gate_up) = fused().ctx(|| l.path("mlp.gate|up"))?;
            (mlp.gate, mlp.up) = (gate, up);
            Some(gate_up)
        } else {
            None
        };
        Ok(Layer {
            input_norm: RmsNorm::load(&l.pp("input_layernorm"), h, eps)?,
            attn: Attention::load(cfg, &l.pp("self_attn"), fuse, i)?,
            post_norm: RmsNorm::load(&l.pp("post_attention_layernorm"), h, eps)?,
            mlp,
            gate_up,
        })
    }

    /// Phi-3's layer `l`: its checkpoint's `mlp.gate_up_proj` (gate rows first, `Phi3MLP`'s
    /// `chunk(2)`) is the fused projection, gate and up views of its rows.
    fn load_phi3(cfg: &ModelConfig, l: &Vb, i: usize, fuse: bool) -> Result<Layer> {
        let (h, eps, inter) = (cfg.hidden_size, cfg.rms_norm_eps, cfg.intermediate_size);
        let mv = l.pp("mlp");
        let gate_up = Linear::load(&mv.pp("gate_up_proj"), 2 * inter, h, false)?;
        let split = || -> candle_core::Result<_> {
            Ok((gate_up.rows(0, inter)?, gate_up.rows(inter, inter)?))
        };
        let (gate, up) = split().ctx(|| mv.path("gate_up_proj"))?;
        let down = Linear::load(&mv.pp("down_proj"), h, inter, false)?;
        Ok(Layer {
            input_norm: RmsNorm::load(&l.pp("input_layernorm"), h, eps)?,
            attn: Attention::load(cfg, &l.pp("self_attn"), fuse, i)?,
            post_norm: RmsNorm::load(&l.pp("post_attention_layernorm"), h, eps)?,
            mlp: Mlp { gate, up, down },
            gate_up: fuse.then_some(gate_up),
        })
    }

    /// The CPU forward of this layer ([`cpu`]): `xs` [T, H] in f32, `qkv` and `gate_up` the
    /// fused projections. The same computation as the candle path, op for op.
    fn forward_cpu(
        &self,
        xs: &Tensor,
        rope: &RopeTables,
        qkv: &Linear,
        gate_up: &Linear,
        packed: &Packed,
    ) -> candle_core::Result<LayerStep> {
        let (t, h) = xs.dims2()?;
        let dev = xs.device();
        let mark = |phase| phases::mark(phase, dev);
        let a = &self.attn;
        let hs = cpu::Heads {
            heads: a.heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
        };
        let x_held = Held::of(xs)?;
        let x = x_held.f32s()?;
        let normed = cpu::rms_norm(
            x,
            Held::of(&self.input_norm.weight)?.f32s()?,
            eps_of(&self.input_norm),
        );
        mark("input norm");
        let mut qkv_out = cpu::project(&normed, t, qkv)?;
        mark("q|k|v");
        if let (Some(qn), Some(kn)) = (&a.q_norm, &a.k_norm) {
            let (qw, kw) = (Held::of(&qn.weight)?, Held::of(&kn.weight)?);
            cpu::qk_norm_in_place(&mut qkv_out, hs, qw.f32s()?, kw.f32s()?, eps_of(qn));
        }
        let half = a.rot_dim / 2;
        let (cos, sin) = (Held::of(&rope.cos32)?, Held::of(&rope.sin32)?);
        let (cos, sin) = (cos.f32s()?, sin.f32s()?);
        if cos.len() < t * half || sin.len() < t * half {
            candle_core::bail!(
                "rope tables for {} positions, {t} tokens",
                cos.len() / half.max(1)
            );
        }
        cpu::rope_in_place(
            &mut qkv_out,
            hs,
            a.rot_dim,
            &cos[..t * half],
            &sin[..t * half],
        );
        mark("qk norm + rope");
        let scale = a.scale as f32;
        let ld = qkv_out.len() / t.max(1);
        let mut attn = Vec::with_capacity(t * a.heads * a.head_dim);
        for (at, len) in packed.spans(t) {
            let rows = &qkv_out[at * ld..(at + len) * ld];
            attn.extend(cpu::attention(rows, len, hs, scale, a.window)?);
        }
        mark("attention");
        let o = cpu::project(&attn, t, &a.o)?;
        mark("o_proj");
        let post = Held::of(&self.post_norm.weight)?;
        let (resid, normed) = cpu::add_rms_norm(x, &o, post.f32s()?, eps_of(&self.post_norm));
        mark("residual + post norm");
        let gu = cpu::project(&normed, t, gate_up)?;
        mark("gate|up");
        let act = cpu::silu_mul(&gu, gu.len() / t.max(1) / 2);
        mark("silu * up");
        let m = cpu::project(&act, t, &self.mlp.down)?;
        mark("down");
        let next = cpu::add(&resid, &m);
        Ok(LayerStep {
            next: Tensor::from_vec(next, (t, h), dev)?,
            ffn_out: Tensor::from_vec(m, (t, h), dev)?,
            extras: Vec::new(),
        })
    }
}

/// A norm's epsilon as the f32 the kernels' references add.
fn eps_of(norm: &RmsNorm) -> f32 {
    norm.eps as f32
}

/// The Llama-family decoder: what every layer shares ([`Decoder`]).
pub(crate) struct LlamaDecoder {
    pub(crate) cfg: ModelConfig,
    pub(crate) dtype: DType,
    path: ComputePath,
    rope: RopeCache,
}

impl LlamaDecoder {
    pub(crate) fn new(cfg: &ModelConfig, dtype: DType, path: ComputePath) -> LlamaDecoder {
        LlamaDecoder {
            cfg: cfg.clone(),
            dtype,
            path,
            rope: RopeCache::default(),
        }
    }

    /// Whether layers on `device` run the CPU forward ([`cpu`]): the candle path in f32 on
    /// the CPU.
    fn runs_cpu_forward(&self, device: &Device) -> bool {
        self.path == ComputePath::Candle && self.dtype == DType::F32 && device.is_cpu()
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

/// What every layer of one Llama-family forward shares: the rope tables, the additive causal
/// mask (a placeholder on the kernel path and the CPU forward, which mask by position), and the
/// sequences packed in it.
pub(crate) struct LlamaCtx {
    rope: RopeTables,
    mask: Tensor,
    packed: Packed,
}

impl LlamaDecoder {
    /// The causal mask of `t` tokens the candle path adds (a placeholder elsewhere).
    fn mask(&self, t: usize, device: &Device) -> Result<Tensor> {
        match self.path {
            ComputePath::Candle if !self.runs_cpu_forward(device) => {
                causal_mask(t, self.cfg.sliding_window, self.dtype, device)
            }
            // Flash attention and the CPU forward mask by position; no [T, T] matrix.
            ComputePath::Candle | ComputePath::Kernels | ComputePath::Fused => {
                Tensor::zeros(1, self.dtype, device).ctx(|| "mask".into())
            }
        }
    }
}

impl Decoder for LlamaDecoder {
    type Layer = Layer;
    type Ctx = LlamaCtx;

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn dtype(&self) -> DType {
        self.dtype
    }

    fn load_layer(&self, m: &Vb, i: usize) -> Result<Layer> {
        Layer::load(&self.cfg, m, i, self.runs_cpu_forward(&m.device))
    }

    fn context(&self, t: usize, device: &Device) -> Result<Self::Ctx> {
        Ok(LlamaCtx {
            rope: self.rope.packed(
                &self.cfg.rope,
                self.cfg.rotary_dim,
                &[t],
                self.dtype,
                device,
            )?,
            mask: self.mask(t, device)?,
            packed: Packed::default(),
        })
    }

    fn context_packed(&self, lens: &[usize], device: &Device) -> Result<Option<Self::Ctx>> {
        let cfg = &self.cfg;
        Ok(Some(LlamaCtx {
            rope: self
                .rope
                .packed(&cfg.rope, cfg.rotary_dim, lens, self.dtype, device)?,
            mask: self.mask(1, device)?,
            packed: Packed::new(lens, |t| self.mask(t, device))?,
        }))
    }

    fn step(&self, layer: &Layer, i: usize, xs: &Tensor, ctx: &Self::Ctx) -> Result<LayerStep> {
        let LlamaCtx { rope, mask, packed } = ctx;
        let step = || -> candle_core::Result<LayerStep> {
            if let (Some(qkv), Some(gate_up)) = (&layer.attn.qkv, &layer.gate_up) {
                return layer.forward_cpu(xs, rope, qkv, gate_up, packed);
            }
            let normed = layer.input_norm.forward(xs)?;
            let (xs, normed) = match self.path {
                ComputePath::Candle => {
                    let xs = (xs + layer.attn.forward_packed(&normed, rope, mask, packed)?)?;
                    let normed = layer.post_norm.forward(&xs)?;
                    (xs, normed)
                }
                ComputePath::Kernels | ComputePath::Fused => {
                    let h = layer.attn.forward_kernels_packed(&normed, rope, packed)?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Rope, RopeScaling};

    /// Each sequence's own tables, stacked: what a packed forward's tables were built as
    /// before [`RopeCache`], on the host for every forward.
    fn stacked(rope: &Rope, dim: usize, lens: &[usize], dtype: DType) -> Vec<Vec<f32>> {
        let mut all = vec![Vec::new(); 4];
        for &t in lens {
            let own = RopeTables::new(rope, dim, t, dtype, &Device::Cpu).unwrap();
            for (all, own) in all.iter_mut().zip(values(&own)) {
                all.extend(own);
            }
        }
        all
    }

    /// cos, sin, cos32 and sin32's values, in f32.
    fn values(r: &RopeTables) -> Vec<Vec<f32>> {
        [&r.cos, &r.sin, &r.cos32, &r.sin32]
            .iter()
            .map(|t| {
                t.to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
            .collect()
    }

    /// The cached tables' rows are each sequence's own tables bit for bit, positions
    /// restarting per sequence, as the cache grows and across calls; LongRoPE's sequences on
    /// either side of its original length each get their own factors (a cache keyed by
    /// length alone would hand a short sequence the long factors' rows).
    #[test]
    fn packed_rope_rows_are_each_sequences_own_tables() {
        let long = Rope {
            theta: 10000.0,
            scaling: RopeScaling::LongRope {
                short_factor: vec![1.0, 1.5, 2.0, 3.0],
                long_factor: vec![4.0, 8.0, 16.0, 32.0],
                original_max_position_embeddings: 8.0,
                attention_factor: 1.2,
            },
        };
        let llama3 = Rope {
            theta: 500000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 16.0,
            },
        };
        for rope in [&long, &llama3] {
            for dtype in [DType::F32, DType::BF16] {
                let cache = RopeCache::default();
                for lens in [&[3, 12, 5][..], &[7], &[20, 2, 9, 8], &[12], &[30]] {
                    let got = cache.packed(rope, 8, lens, dtype, &Device::Cpu).unwrap();
                    assert_eq!(
                        values(&got),
                        stacked(rope, 8, lens, dtype),
                        "{:?} {dtype:?} {lens:?}",
                        rope.scaling
                    );
                }
            }
        }
    }
}
