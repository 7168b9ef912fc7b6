//! DeepSeek-V3 / Kimi-K2 / GLM-4.7-Flash (`glm4_moe_lite`) targets: multi-head latent attention
//! (MLA), YaRN rope on the rope part of each head, and the sigmoid-scored, group-limited mixture
//! of experts with shared experts ([`crate::model::moe`]).
//! Reference: transformers 5.24 `models/deepseek_v3/modeling_deepseek_v3.py`
//! (`DeepseekV3Attention`, `DeepseekV3TopkRouter`, `DeepseekV3MoE`, `DeepseekV3DecoderLayer`);
//! `models/glm4_moe_lite/modeling_glm4_moe_lite.py` has the same attention class body
//! (`Glm4MoeLiteAttention`) and router, with `mlp_layer_types` choosing the sparse layers.

use crate::config::{MlaConfig, ModelConfig, MoeConfig, Rope, RopeScaling};
use crate::error::{CandleContext, Error, Result};
use crate::kernels::{self, AttnParams, RopeParams};
use crate::model::llama::{Packed, RopeCache};
use crate::model::moe::{DEEPSEEK_NAMES, Ffn, MoeBlock, residual_step};
use crate::model::nn::{Linear, Mlp, RmsNorm, RopeTables, attention, causal_mask};
use crate::model::source::Vb;
use crate::model::{ComputePath, Decoder, LayerStep, phases};
use candle_core::{D, DType, Device, Tensor};

/// transformers' `yarn_get_mscale`.
fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

/// The attention softmax scale: `qk_head_dim^-0.5`, times `mscale^2` when YaRN sets
/// `mscale_all_dim` (transformers `yarn_apply_mscale`; DeepSeek's own `MLA.__init__` does the same).
pub fn softmax_scale(cfg: &ModelConfig, mla: &MlaConfig) -> f64 {
    softmax_scale_for(&cfg.rope, mla)
}

/// [`softmax_scale`] from the rope settings alone (an MLA draft has no [`ModelConfig`]).
pub fn softmax_scale_for(rope: &Rope, mla: &MlaConfig) -> f64 {
    let base = ((mla.qk_nope_head_dim + mla.qk_rope_head_dim) as f64).powf(-0.5);
    match rope.scaling {
        RopeScaling::Yarn {
            factor,
            mscale_all_dim,
            ..
        } if mscale_all_dim != 0.0 => {
            let m = yarn_get_mscale(factor, mscale_all_dim);
            base * m * m
        }
        _ => base,
    }
}

/// The query path: a plain projection (`q_lora_rank: null`) or the low-rank pair with a norm.
enum QProj {
    Plain(Linear),
    LowRank { a: Linear, norm: RmsNorm, b: Linear },
}

impl QProj {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            QProj::Plain(q) => q.forward(xs),
            QProj::LowRank { a, norm, b } => b.forward(&norm.forward(&a.forward(xs)?)?),
        }
    }
}

/// What an MLA block needs besides its [`MlaConfig`]. The input width is the decoder's hidden
/// size for a target layer and twice the draft's for the EAGLE-3 MLA draft, whose `q_a_proj`
/// (or `q_proj`) and `kv_a_proj_with_mqa` read `cat(embedding, hidden)` (TorchSpec
/// torchspec/models/draft/deepseek_eagle.py `DeepSeekMLAAttention`: `input_dim = hidden_size * 2`;
/// sglang python/sglang/srt/models/deepseek_eagle3.py widens `fused_qkv_a_proj_with_mqa` the same
/// way). `o_proj` always writes `hidden`.
/// The eps of an MLA target's latent norms ([`MlaDims::target`]).
const MLA_NORM_EPS: f64 = 1e-6;

pub(crate) struct MlaDims {
    pub in_dim: usize,
    pub hidden: usize,
    pub heads: usize,
    /// The eps of `q_a_layernorm` and `kv_a_layernorm`.
    pub eps: f64,
    pub bias: bool,
    pub scale: f64,
}

impl MlaDims {
    /// A target decoder layer: input and output are the hidden size.
    fn target(cfg: &ModelConfig, mla: &MlaConfig) -> MlaDims {
        MlaDims {
            in_dim: cfg.hidden_size,
            hidden: cfg.hidden_size,
            heads: cfg.num_heads,
            // transformers builds q_a_layernorm and kv_a_layernorm without an eps, so with the
            // RMSNorm class default 1e-6 whatever `rms_norm_eps` says
            // (`DeepseekV3Attention.__init__`, `Glm4MoeLiteAttention.__init__`; GLM-4.7-Flash's
            // `rms_norm_eps` is 1e-5).
            eps: MLA_NORM_EPS,
            bias: cfg.attention_bias,
            scale: softmax_scale(cfg, mla),
        }
    }
}

pub(crate) struct Mla {
    q: QProj,
    kv_a: Linear,
    kv_norm: RmsNorm,
    kv_b: Linear,
    o: Linear,
    heads: usize,
    nope: usize,
    rope: usize,
    v_dim: usize,
    kv_rank: usize,
    interleave: bool,
    scale: f64,
    /// On a CUDA device: `kv_b_proj` widened once at load for the kernel path, so that the
    /// per-head keys and the values come out of one GEMM each, straight from
    /// `kv_a_proj_with_mqa`'s output `[T, kv_rank + rope]` (its latent normed and its rope key
    /// rotated in place), in the layout flash attention reads, with no strided copy or
    /// broadcast: key rows `[nh * (nope + rope), kv_rank + rope]`, per head its `nope` rows of
    /// `kv_b_proj` (zeros against the rope key) and then `[0 | I_rope]`, which copies the
    /// shared rope key into the head exactly (one product by 1.0 and zeros, f32 accumulation);
    /// value rows `[nh * v, kv_rank + rope]`, `kv_b_proj`'s value rows with zeros against the
    /// rope key.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    kv_b_split: Option<(Tensor, Tensor)>,
}

/// [`Mla::kv_b_split`] from `kv_b_proj`'s weight `[nh * (nope + v), kv_rank]`.
fn split_kv_b(
    w: &Tensor,
    nh: usize,
    nope: usize,
    rope: usize,
    v: usize,
) -> Result<(Tensor, Tensor)> {
    let split = || -> candle_core::Result<(Tensor, Tensor)> {
        let (r, dt, dev) = (w.dim(1)?, w.dtype(), w.device());
        let per_head = w.reshape((nh, nope + v, r))?;
        // Zero columns against the rope key, appended to rows of kv_b_proj.
        let widen = |rows: &Tensor| -> candle_core::Result<Tensor> {
            let n = rows.dim(1)?;
            Tensor::cat(&[rows, &Tensor::zeros((nh, n, rope), dt, dev)?], 2)
        };
        let rope_rows = Tensor::cat(
            &[
                &Tensor::zeros((rope, r), dt, dev)?,
                &Tensor::eye(rope, dt, dev)?,
            ],
            1,
        )?
        .unsqueeze(0)?
        .broadcast_as((nh, rope, r + rope))?;
        let k = Tensor::cat(&[&widen(&per_head.narrow(1, 0, nope)?)?, &rope_rows], 1)?
            .reshape((nh * (nope + rope), r + rope))?
            .contiguous()?;
        let v = widen(&per_head.narrow(1, nope, v)?)?
            .reshape((nh * v, r + rope))?
            .contiguous()?;
        Ok((k, v))
    };
    split().ctx(|| "kv_b_proj split for the kernel path".to_string())
}

impl Mla {
    pub(crate) fn load(dims: &MlaDims, mla: &MlaConfig, vb: &Vb) -> Result<Mla> {
        let (h, nh, eps, bias) = (dims.in_dim, dims.heads, dims.eps, dims.bias);
        let qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
        // transformers puts `attention_bias` on q_a_proj and kv_a_proj_with_mqa only.
        let q = match mla.q_lora_rank {
            None => QProj::Plain(Linear::load(&vb.pp("q_proj"), nh * qk, h, false)?),
            Some(r) => QProj::LowRank {
                a: Linear::load(&vb.pp("q_a_proj"), r, h, bias)?,
                norm: RmsNorm::load(&vb.pp("q_a_layernorm"), r, eps)?,
                b: Linear::load(&vb.pp("q_b_proj"), nh * qk, r, false)?,
            },
        };
        Ok(Mla {
            q,
            kv_a: Linear::load(
                &vb.pp("kv_a_proj_with_mqa"),
                mla.kv_lora_rank + mla.qk_rope_head_dim,
                h,
                bias,
            )?,
            kv_norm: RmsNorm::load(&vb.pp("kv_a_layernorm"), mla.kv_lora_rank, eps)?,
            kv_b: Linear::load(
                &vb.pp("kv_b_proj"),
                nh * (mla.qk_nope_head_dim + mla.v_head_dim),
                mla.kv_lora_rank,
                false,
            )?,
            o: Linear::load(&vb.pp("o_proj"), dims.hidden, nh * mla.v_head_dim, bias)?,
            heads: nh,
            nope: mla.qk_nope_head_dim,
            rope: mla.qk_rope_head_dim,
            v_dim: mla.v_head_dim,
            kv_rank: mla.kv_lora_rank,
            interleave: mla.rope_interleave,
            scale: dims.scale,
            kv_b_split: None,
        })
        .and_then(|mut m| {
            if vb.device.is_cuda() {
                m.kv_b_split = Some(split_kv_b(&m.kv_b.weight, nh, m.nope, m.rope, m.v_dim)?);
            }
            Ok(m)
        })
    }

    fn apply_rope(&self, rope: &RopeTables, xs: &Tensor) -> candle_core::Result<Tensor> {
        if self.interleave {
            rope.apply_interleaved(xs)
        } else {
            rope.apply_half(xs)
        }
    }

    /// The kernel path: token-major throughout, rope in place on each head's rope part, flash
    /// attention over the per-head keys `cat(k_nope, k_rot)` (k_rot shared by every head).
    /// `xs`: [T, in_dim] -> [T, hidden]
    pub(crate) fn forward_kernels(
        &self,
        xs: &Tensor,
        rope: &RopeTables,
    ) -> candle_core::Result<Tensor> {
        self.forward_kernels_packed(xs, rope, &Packed::default())
    }

    /// [`Mla::forward_kernels`] over the sequences `packed` lays out in `xs`'s rows: flash
    /// attention on each one's rows.
    pub(crate) fn forward_kernels_packed(
        &self,
        xs: &Tensor,
        rope: &RopeTables,
        packed: &Packed,
    ) -> candle_core::Result<Tensor> {
        let t = xs.dim(0)?;
        let flash = |q: &Tensor, k: &Tensor, v: &Tensor, params: &AttnParams| {
            packed.each(t, |a, len, _| {
                let rows = |x: &Tensor| x.narrow(0, a, len);
                kernels::flash_attention(&rows(q)?, &rows(k)?, &rows(v)?, params)
            })
        };
        let (nh, nope, rd, vd) = (self.heads, self.nope, self.rope, self.v_dim);
        let rot = |heads, head_stride, rot_offset| RopeParams {
            heads,
            head_stride,
            rot_offset,
            rot_dim: rd,
            interleaved: self.interleave,
        };
        let dev = xs.device();
        // [T, nh * (nope + rope)]
        let q = self.q.forward(xs)?.contiguous()?;
        kernels::rope_in_place(&q, &rope.cos32, &rope.sin32, &rot(nh, nope + rd, nope))?;
        phases::mark("mla: q projections + rope", dev);
        let ckv = self.kv_a.forward(xs)?; // [T, kv_rank + rope]
        let params = AttnParams {
            nh,
            nkv: nh,
            dk: nope + rd,
            dv: vd,
            scale: self.scale,
            window: None,
        };
        #[cfg(feature = "cuda")]
        if let (Some((wk, wv)), candle_core::Device::Cuda(cuda_dev)) = (&self.kv_b_split, dev) {
            use crate::kernels::cuda::tensor_ptr;
            use crate::kernels::rmsnorm::launch::{RmsNormArgs, add_rmsnorm};
            // kv_a's output in place: the latent normed, the rope key rotated; then the keys
            // and values as one GEMM each (see `kv_b_split`).
            let ckv = ckv.contiguous()?;
            let width = self.kv_rank + rd;
            let p = tensor_ptr(&ckv)?;
            add_rmsnorm(
                cuda_dev,
                kernels::KernelDType::of(ckv.dtype())?,
                &RmsNormArgs {
                    x: p,
                    x_stride: width,
                    delta: None,
                    w: tensor_ptr(&self.kv_norm.weight)?,
                    resid: None,
                    normed: p,
                    normed_stride: width,
                    rows: t,
                    cols: self.kv_rank,
                    eps: self.kv_norm.eps as f32,
                },
            )?;
            kernels::rope_in_place(&ckv, &rope.cos32, &rope.sin32, &rot(1, width, self.kv_rank))?;
            let k = ckv.matmul(&wk.t()?)?; // [T, nh * (nope + rope)]
            let v = ckv.matmul(&wv.t()?)?; // [T, nh * v]
            phases::mark("mla: kv projections", dev);
            let out = flash(&q, &k, &v, &params)?;
            phases::mark("mla: flash attention", dev);
            let out = self.o.forward(&out)?;
            phases::mark("mla: o_proj", dev);
            return Ok(out);
        }
        let kv_latent = self.kv_norm.forward(&ckv.narrow(1, 0, self.kv_rank)?)?;
        let k_rot = ckv.narrow(1, self.kv_rank, rd)?.contiguous()?;
        kernels::rope_in_place(&k_rot, &rope.cos32, &rope.sin32, &rot(1, rd, 0))?;
        let kv = self.kv_b.forward(&kv_latent)?.reshape((t, nh, nope + vd))?;
        let k = Tensor::cat(
            &[
                &kv.narrow(2, 0, nope)?,
                &k_rot.reshape((t, 1, rd))?.broadcast_as((t, nh, rd))?,
            ],
            2,
        )?
        .reshape((t, nh * (nope + rd)))?;
        let v = kv
            .narrow(2, nope, vd)?
            .contiguous()?
            .reshape((t, nh * vd))?;
        self.o.forward(&flash(&q, &k, &v, &params)?)
    }

    /// `xs`: [T, in_dim] -> [T, hidden]
    pub(crate) fn forward(
        &self,
        xs: &Tensor,
        rope: &RopeTables,
        mask: &Tensor,
    ) -> candle_core::Result<Tensor> {
        self.forward_packed(xs, rope, mask, &Packed::default())
    }

    /// [`Mla::forward`] over the sequences `packed` lays out in `xs`'s rows: attention on each
    /// one's rows under its own mask.
    pub(crate) fn forward_packed(
        &self,
        xs: &Tensor,
        rope: &RopeTables,
        mask: &Tensor,
        packed: &Packed,
    ) -> candle_core::Result<Tensor> {
        let t = xs.dim(0)?;
        let (nh, nope, rd) = (self.heads, self.nope, self.rope);
        // [nh, T, nope + rope]
        let q = self
            .q
            .forward(xs)?
            .reshape((t, nh, nope + rd))?
            .transpose(0, 1)?;
        let q_pass = q.narrow(D::Minus1, 0, nope)?;
        let q_rot = self.apply_rope(rope, &q.narrow(D::Minus1, nope, rd)?.contiguous()?)?;

        // The compressed latent and the one rope key every head shares.
        let ckv = self.kv_a.forward(xs)?; // [T, kv_rank + rope]
        let kv_latent = self.kv_norm.forward(&ckv.narrow(1, 0, self.kv_rank)?)?;
        let k_rot = ckv
            .narrow(1, self.kv_rank, rd)?
            .contiguous()?
            .reshape((1, t, rd))?;
        let k_rot = self.apply_rope(rope, &k_rot)?;

        // [nh, T, nope + v]
        let kv = self
            .kv_b
            .forward(&kv_latent)?
            .reshape((t, nh, nope + self.v_dim))?
            .transpose(0, 1)?;
        let k_nope = kv.narrow(D::Minus1, 0, nope)?;
        let v = kv.narrow(D::Minus1, nope, self.v_dim)?;
        let k = Tensor::cat(&[&k_nope, &k_rot.broadcast_as((nh, t, rd))?], D::Minus1)?;
        let q = Tensor::cat(&[&q_pass, &q_rot], D::Minus1)?;
        // [T, nh * v]
        let out = packed.each(t, |a, len, m| {
            let rows = |x: &Tensor| x.narrow(1, a, len);
            attention(
                &rows(&q)?,
                &rows(&k)?,
                &rows(&v)?,
                m.unwrap_or(mask),
                self.scale,
            )
        })?;
        self.o.forward(&out)
    }
}

pub(crate) struct Layer {
    input_norm: RmsNorm,
    attn: Mla,
    post_norm: RmsNorm,
    ffn: Ffn,
}

impl Layer {
    /// Decoder layer `i` under the decoder prefix `m`: dense, or MoE where the config says.
    fn load(cfg: &ModelConfig, m: &Vb, i: usize) -> Result<Layer> {
        let (mla, moe) = validate(cfg)?;
        let (h, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let l = m.pp(format!("layers.{i}"));
        let ffn = match moe {
            Some(moe) if moe.is_moe_layer(i) => Ffn::Moe(Box::new(MoeBlock::load(
                cfg,
                moe,
                &l.pp("mlp"),
                &DEEPSEEK_NAMES,
            )?)),
            _ => Ffn::Dense(Mlp::load(&l.pp("mlp"), h, cfg.intermediate_size)?),
        };
        Ok(Layer {
            input_norm: RmsNorm::load(&l.pp("input_layernorm"), h, eps)?,
            attn: Mla::load(&MlaDims::target(cfg, mla), mla, &l.pp("self_attn"))?,
            post_norm: RmsNorm::load(&l.pp("post_attention_layernorm"), h, eps)?,
            ffn,
        })
    }
}

/// The DeepSeek-V3 decoder: what every layer shares ([`Decoder`]).
pub(crate) struct DeepseekDecoder {
    cfg: ModelConfig,
    dtype: DType,
    path: ComputePath,
    /// Rope tables kept across forwards: a capture bench or a `diff` builds them once (at
    /// T = 2048, building them and gathering the embedding rows took 1.8 ms of a 37 ms forward
    /// on the H200 machine).
    rope: RopeCache,
}

/// Config checks the forward relies on, with the numbers in the message.
fn validate(cfg: &ModelConfig) -> Result<(&MlaConfig, Option<&MoeConfig>)> {
    let bad = |msg: String| Error::config(&cfg.path, msg);
    let mla = cfg
        .mla
        .as_ref()
        .ok_or_else(|| bad("deepseek_v3 config without MLA fields".into()))?;
    if mla.qk_rope_head_dim == 0 || mla.qk_rope_head_dim % 2 != 0 {
        return Err(bad(format!(
            "qk_rope_head_dim must be even and positive, found {}",
            mla.qk_rope_head_dim
        )));
    }
    if let Some(moe) = &cfg.moe
        && let Some(problem) = moe.routing.problem(moe.n_routed_experts)
    {
        return Err(bad(format!("MoE routing: {problem}")));
    }
    Ok((mla, cfg.moe.as_ref()))
}

impl DeepseekDecoder {
    /// Checks the config before any weight is read.
    pub(crate) fn new(cfg: &ModelConfig, dtype: DType, path: ComputePath) -> Result<Self> {
        validate(cfg)?;
        Ok(DeepseekDecoder {
            cfg: cfg.clone(),
            dtype,
            path,
            rope: RopeCache::default(),
        })
    }

    /// The causal mask of `t` tokens the candle path adds (a placeholder on the kernel path).
    fn mask(&self, t: usize, device: &Device) -> Result<Tensor> {
        match self.path {
            ComputePath::Candle => causal_mask(t, None, self.dtype, device),
            ComputePath::Kernels | ComputePath::Fused => {
                Tensor::zeros(1, self.dtype, device).ctx(|| "mask".into())
            }
        }
    }

    fn rope_dim(&self) -> usize {
        self.cfg.mla.as_ref().map_or(0, |m| m.qk_rope_head_dim)
    }
}

impl Decoder for DeepseekDecoder {
    type Layer = Layer;
    /// Rope tables over the rope part of each head, the additive causal mask (a placeholder
    /// on the kernel path) and the sequences packed in the forward.
    type Ctx = (RopeTables, Tensor, Packed);

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
        let rope = self
            .rope
            .packed(&self.cfg.rope, self.rope_dim(), &[t], self.dtype, device)?;
        Ok((rope, self.mask(t, device)?, Packed::default()))
    }

    fn context_packed(&self, lens: &[usize], device: &Device) -> Result<Option<Self::Ctx>> {
        let rope = self
            .rope
            .packed(&self.cfg.rope, self.rope_dim(), lens, self.dtype, device)?;
        let packed = Packed::new(lens, |t| self.mask(t, device))?;
        Ok(Some((rope, self.mask(1, device)?, packed)))
    }

    fn step(
        &self,
        layer: &Layer,
        i: usize,
        xs: &Tensor,
        (rope, mask, packed): &Self::Ctx,
    ) -> Result<LayerStep> {
        residual_step(
            i,
            xs,
            self.path,
            &layer.input_norm,
            &layer.post_norm,
            &layer.ffn,
            |normed| layer.attn.forward_packed(normed, rope, mask, packed),
            |normed| layer.attn.forward_kernels_packed(normed, rope, packed),
        )
    }
}
