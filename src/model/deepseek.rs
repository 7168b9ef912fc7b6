//! DeepSeek-V3 / Kimi-K2 targets: multi-head latent attention (MLA), YaRN rope on the rope part
//! of each head, and the sigmoid-scored, group-limited mixture of experts with shared experts.
//! Reference: transformers 5.24 `models/deepseek_v3/modeling_deepseek_v3.py`
//! (`DeepseekV3Attention`, `DeepseekV3TopkRouter`, `DeepseekV3MoE`, `DeepseekV3DecoderLayer`).

use crate::config::{MlaConfig, ModelConfig, MoeConfig, Rope, RopeScaling};
use crate::error::{CandleContext, Error, Result};
use crate::kernels::{self, AttnParams, MoePlan, RopeParams, RouteParams, StackedExperts};
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
pub(crate) struct MlaDims {
    pub in_dim: usize,
    pub hidden: usize,
    pub heads: usize,
    /// Used for `q_a_layernorm` and `kv_a_layernorm` too, as DeepSeek, TorchSpec and sglang do.
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
            eps: cfg.rms_norm_eps,
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
        let t = xs.dim(0)?;
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
            use crate::kernels::cuda::{self, tensor_ptr};
            // kv_a's output in place: the latent normed, the rope key rotated; then the keys
            // and values as one GEMM each (see `kv_b_split`).
            let ckv = ckv.contiguous()?;
            let width = self.kv_rank + rd;
            let p = tensor_ptr(&ckv)?;
            cuda::add_rmsnorm(
                cuda_dev,
                kernels::KernelDType::of(ckv.dtype())?,
                &cuda::RmsNormArgs {
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
            let out = kernels::flash_attention(&q, &k, &v, &params)?;
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
        self.o
            .forward(&kernels::flash_attention(&q, &k, &v, &params)?)
    }

    /// `xs`: [T, in_dim] -> [T, hidden]
    pub(crate) fn forward(
        &self,
        xs: &Tensor,
        rope: &RopeTables,
        mask: &Tensor,
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
        let out = attention(&q, &k, &v, mask, self.scale)?; // [T, nh * v]
        self.o.forward(&out)
    }
}

/// One token's routing decision: experts in ascending order, their weights in the same order.
#[derive(Debug, Clone, PartialEq)]
pub struct Routed {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// `n` indices of the largest `values` (ties: the lower index first), in descending order.
fn top_n(values: &[f32], n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(n);
    order
}

/// DeepSeek-V3's `noaux_tc` routing for one token (transformers `DeepseekV3TopkRouter.forward`).
/// `scores`: sigmoid of the router logits [E]; `bias`: `e_score_correction_bias` [E].
///
/// The bias only steers the selection: groups are ranked by the sum of their two best biased
/// scores, the best `topk_group` groups are kept, and the top `num_experts_per_tok` biased
/// scores among their experts win. The weights are the *unbiased* scores of the winners,
/// normalised over the picks when `norm_topk_prob`, times `routed_scaling_factor`.
pub fn route_token(scores: &[f32], bias: &[f32], moe: &MoeConfig) -> Routed {
    let n = scores.len();
    let group_size = n / moe.n_group;
    let choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    let group_scores: Vec<f32> = choice
        .chunks(group_size)
        .map(|g| top_n(g, 2).iter().map(|&i| g[i]).sum())
        .collect();
    let kept = top_n(&group_scores, moe.topk_group);
    let masked: Vec<f32> = choice
        .iter()
        .enumerate()
        .map(|(e, &c)| {
            if kept.contains(&(e / group_size)) {
                c
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    let mut experts = top_n(&masked, moe.num_experts_per_tok);
    experts.sort_unstable();
    let mut weights: Vec<f32> = experts.iter().map(|&e| scores[e]).collect();
    if moe.norm_topk_prob {
        let denominator = weights.iter().sum::<f32>() + 1e-20;
        weights.iter_mut().for_each(|w| *w /= denominator);
    }
    let factor = moe.routed_scaling_factor as f32;
    weights.iter_mut().for_each(|w| *w *= factor);
    Routed { experts, weights }
}

/// The sigmoid router, kept in f32 whatever the compute dtype (transformers keeps `gate.weight`
/// and `e_score_correction_bias` in f32: `_keep_in_fp32_modules_strict`).
struct Router {
    /// [E, H] f32
    weight: Tensor,
    /// [E]
    bias: Vec<f32>,
    /// The same bias as an f32 tensor on the model's device, for the routing kernel.
    bias_t: Tensor,
}

impl Router {
    /// `xs`: [T, H] -> one decision per token.
    fn route(&self, xs: &Tensor, moe: &MoeConfig) -> candle_core::Result<Vec<Routed>> {
        let logits = xs.to_dtype(DType::F32)?.matmul(&self.weight.t()?)?;
        let logits = logits.to_vec2::<f32>()?;
        Ok(logits
            .iter()
            .map(|row| {
                // The routing kernel's sigmoid (exp in f64, rounded once), so that the CPU and
                // the GPU choose the same experts at near-ties.
                let scores: Vec<f32> = row
                    .iter()
                    .map(|&x| kernels::moe::router_sigmoid(x))
                    .collect();
                route_token(&scores, &self.bias, moe)
            })
            .collect())
    }
}

struct Moe {
    cfg: MoeConfig,
    router: Router,
    /// On a CUDA device, views of `stacked`.
    experts: Vec<Mlp>,
    /// On a CUDA device: the experts' weights as one matrix per projection, what
    /// [`kernels::moe_experts`] reads.
    stacked: Option<StackedExperts>,
    shared: Option<Mlp>,
}

/// A tensor in f32 straight from the store (no round trip through a bf16 compute dtype).
fn get_f32(vb: &Vb, name: &str, shape: &[usize]) -> Result<Tensor> {
    let plain =
        vb.shape_of(name).as_deref() == Some(shape) && !vb.contains(&format!("{name}_scale_inv"));
    let t = if plain {
        vb.get_raw(name)?
    } else {
        vb.get(name, shape)?
    };
    t.to_dtype(DType::F32)
        .ctx(|| format!("converting {} to f32", vb.path(name)))
}

impl Moe {
    fn load(cfg: &ModelConfig, moe: &MoeConfig, vb: &Vb) -> Result<Moe> {
        let (h, e, inter) = (
            cfg.hidden_size,
            moe.n_routed_experts,
            moe.moe_intermediate_size,
        );
        let gate = vb.pp("gate");
        let bias = match vb.shape_of("gate.e_score_correction_bias") {
            Some(_) => get_f32(&gate, "e_score_correction_bias", &[e])?
                .to_vec1::<f32>()
                .ctx(|| gate.path("e_score_correction_bias"))?,
            // transformers initialises the buffer to zeros; DeepSeek-V2-style checkpoints lack it.
            None => vec![0.0; e],
        };
        let bias_t = Tensor::new(bias.as_slice(), &vb.device).ctx(|| gate.path("bias"))?;
        let router = Router {
            weight: get_f32(&gate, "weight", &[e, h])?,
            bias,
            bias_t,
        };
        let (experts, stacked) = load_experts(vb, e, h, inter)?;
        let shared = if moe.n_shared_experts > 0 {
            Some(Mlp::load(
                &vb.pp("shared_experts"),
                h,
                inter * moe.n_shared_experts,
            )?)
        } else {
            None
        };
        Ok(Moe {
            cfg: moe.clone(),
            router,
            experts,
            stacked,
            shared,
        })
    }

    /// The kernel path: routing, dispatch plan, gather and combine as kernels
    /// (kernels/moe.cu, kernels/gather.cu), the experts by [`kernels::moe_experts`] on the GPU
    /// (each touched expert's weights read once; no per-expert host loop; on an sm_90 device no
    /// host synchronisation either) or a matmul per expert on the CPU. `xs`: [T, H] -> ([T, H],
    /// topk_idx [T, K] u32, topk_w [T, K] f32).
    fn forward_kernels(&self, xs: &Tensor) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let logits = xs.to_dtype(DType::F32)?.matmul(&self.router.weight.t()?)?;
        let routing =
            kernels::moe_route(&logits, &self.router.bias_t, &RouteParams::of(&self.cfg))?;
        let e = self.experts.len();
        let plan = kernels::moe_plan(&routing.topk_idx, e)?;
        let sorted = kernels::gather_rows(xs, &plan.perm_token)?; // [T*K, H]
        phases::mark("moe routing, plan, gather", xs.device());
        let ys = self.experts_forward(&sorted, &plan)?;
        phases::mark("moe experts", xs.device());
        let shared = match &self.shared {
            Some(s) => Some(s.forward(xs)?),
            None => None,
        };
        phases::mark("moe shared expert", xs.device());
        let out = kernels::moe_combine(&ys, &plan, &routing.topk_w, shared.as_ref())?;
        phases::mark("moe combine", xs.device());
        Ok((out, routing.topk_idx, routing.topk_w))
    }

    /// The experts on rows sorted by expert (`plan.offsets`): `[R, H]` -> `[R, H]`.
    fn experts_forward(&self, sorted: &Tensor, plan: &MoePlan) -> candle_core::Result<Tensor> {
        if let Some(stacked) = &self.stacked
            && !sorted.device().is_cpu()
        {
            return Ok(kernels::moe_experts(sorted, &plan.offsets, stacked)?.0);
        }
        let counts = plan.counts.to_vec1::<u32>()?;
        let mut parts = Vec::with_capacity(self.experts.len());
        let mut start = 0;
        for (expert, &n) in self.experts.iter().zip(&counts) {
            let n = n as usize;
            if n > 0 {
                parts.push(expert.forward(&sorted.narrow(0, start, n)?)?);
            }
            start += n;
        }
        Tensor::cat(&parts, 0)
    }

    /// `xs`: [T, H] -> ([T, H], the routing of every token).
    fn forward(&self, xs: &Tensor) -> candle_core::Result<(Tensor, Vec<Routed>)> {
        let routing = self.router.route(xs, &self.cfg)?;
        let device = xs.device();
        // Per expert: the tokens routed to it and their weights. Experts run in ascending order,
        // as transformers' `DeepseekV3Experts` accumulates them.
        let mut per_expert: Vec<(Vec<u32>, Vec<f32>)> =
            vec![Default::default(); self.experts.len()];
        for (tok, r) in routing.iter().enumerate() {
            for (&e, &w) in r.experts.iter().zip(&r.weights) {
                per_expert[e].0.push(tok as u32);
                per_expert[e].1.push(w);
            }
        }
        let mut out = xs.zeros_like()?;
        for (expert, (toks, ws)) in self.experts.iter().zip(per_expert) {
            if toks.is_empty() {
                continue;
            }
            let n = toks.len();
            let idx = Tensor::new(toks.as_slice(), device)?;
            let w = Tensor::from_vec(ws, (n, 1), device)?.to_dtype(xs.dtype())?;
            let y = expert
                .forward(&xs.index_select(&idx, 0)?)?
                .broadcast_mul(&w)?;
            out = out.index_add(&idx, &y, 0)?;
        }
        if let Some(shared) = &self.shared {
            out = (out + shared.forward(xs)?)?;
        }
        Ok((out, routing))
    }
}

/// Routed experts, either one module per expert (`experts.{e}.gate_proj.weight`: the original
/// DeepSeek / Kimi layout and what `save_pretrained` writes) or transformers 5's fused tensors
/// (`experts.gate_up_proj` [E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]). On a
/// CUDA device also stacked as [`StackedExperts`]: the fused tensors as they are, the
/// per-expert ones copied into their slots as each expert loads (`load_stacked`); each
/// expert's [`Mlp`] is then views of the stack.
fn load_experts(
    vb: &Vb,
    e: usize,
    h: usize,
    inter: usize,
) -> Result<(Vec<Mlp>, Option<StackedExperts>)> {
    let ex = vb.pp("experts");
    let views =
        |stacked: StackedExperts, what: &str| -> Result<(Vec<Mlp>, Option<StackedExperts>)> {
            let lin = |w: Tensor| Linear {
                weight: w,
                bias: None,
            };
            let mlps = (0..e)
                .map(|i| {
                    let [gate, up, down] = stacked.expert(i)?;
                    Ok(Mlp {
                        gate: lin(gate),
                        up: lin(up),
                        down: lin(down),
                    })
                })
                .collect::<candle_core::Result<Vec<_>>>()
                .ctx(|| what.to_string())?;
            let keep = (!vb.device.is_cpu()).then_some(stacked);
            Ok((mlps, keep))
        };
    if ex.contains("gate_up_proj") {
        let what = ex.path("gate_up_proj");
        let gate_up = ex.get("gate_up_proj", &[e, 2 * inter, h])?;
        let down = ex.get("down_proj", &[e, h, inter])?;
        let stacked = StackedExperts::new(
            e,
            gate_up.reshape((e * 2 * inter, h)).ctx(|| what.clone())?,
            down.reshape((e * h, inter)).ctx(|| ex.path("down_proj"))?,
        );
        return views(stacked, &what);
    }
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = &vb.device {
        let stacked = load_stacked(&ex, dev, e, h, inter)?;
        return views(stacked, &ex.path("*"));
    }
    let mlps = (0..e)
        .map(|i| Mlp::load(&ex.pp(i.to_string()), h, inter))
        .collect::<Result<Vec<_>>>()?;
    Ok((mlps, None))
}

/// Per-expert weights (`experts.{e}.{gate,up,down}_proj.weight`) copied into their slots of
/// the stacked matrices as each expert loads, so a layer's experts are held once plus one
/// expert. Every weight arrives in the builder's compute dtype (`Vb::get` converts to it).
#[cfg(feature = "cuda")]
fn load_stacked(
    ex: &Vb,
    dev: &candle_core::cuda_backend::CudaDevice,
    e: usize,
    h: usize,
    inter: usize,
) -> Result<StackedExperts> {
    use kernels::cuda;
    let what = ex.path("*");
    let alloc = |rows: usize, cols: usize| -> Result<Tensor> {
        let s = cuda::alloc(dev, ex.dtype, rows * cols).ctx(|| format!("stacking {what}"))?;
        Ok(cuda::tensor(s, (rows, cols)))
    };
    let stacked = StackedExperts::new(e, alloc(e * 2 * inter, h)?, alloc(e * h, inter)?);
    let ptrs = || -> candle_core::Result<_> {
        Ok((
            cuda::tensor_ptr(&stacked.gate_up)?,
            cuda::tensor_ptr(&stacked.down)?,
        ))
    };
    let (gu_p, d_p) = ptrs().ctx(|| format!("stacking {what}"))?;
    let block = (inter * h * ex.dtype.size_in_bytes()) as u64;
    for i in 0..e {
        let m = Mlp::load(&ex.pp(i.to_string()), h, inter)?;
        let copy = || -> candle_core::Result<()> {
            for (w, dst) in [
                (&m.gate.weight, gu_p + 2 * i as u64 * block),
                (&m.up.weight, gu_p + (2 * i as u64 + 1) * block),
                (&m.down.weight, d_p + i as u64 * block),
            ] {
                if w.dtype() != ex.dtype {
                    candle_core::bail!("{:?}, expected {:?}", w.dtype(), ex.dtype);
                }
                let w = w.contiguous()?;
                cuda::copy_raw(dev, dst, cuda::tensor_ptr(&w)?, block as usize)?;
            }
            Ok(())
        };
        copy().ctx(|| format!("{what}: stacking expert {i}"))?;
    }
    Ok(stacked)
}

enum Ffn {
    Dense(Mlp),
    Moe(Moe),
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
            Some(moe) if moe.is_moe_layer(i) => Ffn::Moe(Moe::load(cfg, moe, &l.pp("mlp"))?),
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
    /// The last forward's rope tables (its length and device): a capture bench or a `diff`
    /// over samples of one length builds them once (at T = 2048, building them and gathering
    /// the embedding rows took 1.8 ms of a 37 ms forward on the H200 machine).
    rope_cache: std::sync::Mutex<Option<(usize, Device, RopeTables)>>,
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
    if let Some(moe) = &cfg.moe {
        let group_size = moe.n_routed_experts / moe.n_group;
        if moe.topk_group == 0 || moe.topk_group > moe.n_group {
            return Err(bad(format!(
                "topk_group {} must be in 1..={} (n_group)",
                moe.topk_group, moe.n_group
            )));
        }
        if moe.num_experts_per_tok == 0 || moe.num_experts_per_tok > moe.topk_group * group_size {
            return Err(bad(format!(
                "num_experts_per_tok {} must be in 1..={} (topk_group {} x {} experts per group)",
                moe.num_experts_per_tok,
                moe.topk_group * group_size,
                moe.topk_group,
                group_size
            )));
        }
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
            rope_cache: std::sync::Mutex::new(None),
        })
    }

    fn rope_dim(&self) -> usize {
        self.cfg.mla.as_ref().map_or(0, |m| m.qk_rope_head_dim)
    }
}

/// `[T, k]` routing tensors for `Capture.extras`: i64 expert ids and f32 weights.
fn routing_tensors(routing: &[Routed], device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let t = routing.len();
    let k = routing.first().map_or(0, |r| r.experts.len());
    let idx: Vec<i64> = routing
        .iter()
        .flat_map(|r| r.experts.iter().map(|&e| e as i64))
        .collect();
    let w: Vec<f32> = routing.iter().flat_map(|r| r.weights.clone()).collect();
    Ok((
        Tensor::from_vec(idx, (t, k), device)?,
        Tensor::from_vec(w, (t, k), device)?,
    ))
}

impl Decoder for DeepseekDecoder {
    type Layer = Layer;
    /// Rope tables over the rope part of each head and the additive causal mask (a placeholder
    /// on the kernel path).
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
        let rope = {
            let mut cache = self
                .rope_cache
                .lock()
                .map_err(|_| Error::Device("rope table cache poisoned".into()))?;
            match cache.as_ref() {
                Some((n, d, r)) if *n == t && d.same_device(device) => r.clone(),
                _ => {
                    let r =
                        RopeTables::new(&self.cfg.rope, self.rope_dim(), t, self.dtype, device)?;
                    *cache = Some((t, device.clone(), r.clone()));
                    r
                }
            }
        };
        let mask = match self.path {
            ComputePath::Candle => causal_mask(t, None, self.dtype, device)?,
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
        let device = xs.device();
        // (next, ffn output, routing as [T, K] expert ids i64 and weights f32)
        type Step = (Tensor, Tensor, Option<(Tensor, Tensor)>);
        let step = || -> candle_core::Result<Step> {
            let normed = layer.input_norm.forward(xs)?;
            phases::mark("input norm", device);
            let (xs, normed) = match self.path {
                ComputePath::Candle => {
                    let xs = (xs + layer.attn.forward(&normed, rope, mask)?)?;
                    let normed = layer.post_norm.forward(&xs)?;
                    (xs, normed)
                }
                ComputePath::Kernels | ComputePath::Fused => {
                    let a = layer.attn.forward_kernels(&normed, rope)?;
                    layer.post_norm.add_forward(xs, &a)?
                }
            };
            phases::mark("post-attention add + norm", device);
            let (f, routing) = match (&layer.ffn, self.path) {
                (Ffn::Dense(mlp), _) => {
                    let f = mlp.forward(&normed)?;
                    phases::mark("dense mlp", device);
                    (f, None)
                }
                (Ffn::Moe(moe), ComputePath::Candle) => {
                    let (f, r) = moe.forward(&normed)?;
                    (f, Some(routing_tensors(&r, device)?))
                }
                (Ffn::Moe(moe), ComputePath::Kernels | ComputePath::Fused) => {
                    let (f, idx, w) = moe.forward_kernels(&normed)?;
                    (f, Some((idx.to_dtype(DType::I64)?, w)))
                }
            };
            Ok(((xs + &f)?, f, routing))
        };
        let (next, ffn_out, routing) = step().ctx(|| format!("decoder layer {i}"))?;
        let mut extras = Vec::new();
        if let Some((idx, w)) = routing {
            extras.push((format!("router.{i}.topk_idx"), idx));
            extras.push((format!("router.{i}.topk_weight"), w));
        }
        Ok(LayerStep {
            next,
            ffn_out,
            extras,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe(n_group: usize, topk_group: usize) -> MoeConfig {
        MoeConfig {
            n_routed_experts: 8,
            n_shared_experts: 1,
            num_experts_per_tok: 2,
            moe_intermediate_size: 4,
            first_k_dense_replace: 0,
            moe_layer_freq: 1,
            n_group,
            topk_group,
            norm_topk_prob: true,
            routed_scaling_factor: 2.0,
        }
    }

    #[test]
    fn group_limit_overrides_the_two_best_scores() {
        // Groups of two: {0,1} {2,3} {4,5} {6,7}. Experts 0 and 2 are the two best, but their
        // groups' partners are weak; group {6,7} has the best pair sum, then {4,5}.
        let scores = [0.95, 0.0, 0.9, 0.0, 0.6, 0.6, 0.7, 0.7];
        let bias = [0.0; 8];
        let grouped = route_token(&scores, &bias, &moe(4, 2));
        assert_eq!(grouped.experts, vec![6, 7]);
        let plain = route_token(&scores, &bias, &moe(1, 1));
        assert_eq!(plain.experts, vec![0, 2]);
    }

    #[test]
    fn bias_selects_but_does_not_weigh() {
        let scores = [0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1];
        let mut bias = [0.0; 8];
        bias[3] = 1.0; // lifts expert 3 into the picks, not into the weights
        let r = route_token(&scores, &bias, &moe(1, 1));
        assert_eq!(r.experts, vec![0, 3]);
        let w0 = 0.5 / 0.7 * 2.0;
        let w3 = 0.2 / 0.7 * 2.0;
        assert!((r.weights[0] - w0).abs() < 1e-6 && (r.weights[1] - w3).abs() < 1e-6);
    }
}
