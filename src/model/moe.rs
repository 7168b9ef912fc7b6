//! The sparse MLP every MoE family shares: a router ([`crate::routing::Routing`] says how it
//! decides), routed experts (SwiGLU, or gpt-oss's clamped, biased SwiGLU), and optional shared
//! experts (Qwen2-MoE's behind a sigmoid gate). DeepSeek-V3, Kimi-K2, GLM-4.5, GLM-4.7-Flash,
//! Qwen3-MoE, Qwen2-MoE, MiniMax-M2 and gpt-oss all run through [`MoeBlock`]; each family only
//! names where its tensors live ([`MoeNames`]).
//!
//! Two forwards, as for attention: the candle path (the CPU default: routing on the host, each
//! expert's tokens gathered and scattered back, in ascending expert order as transformers'
//! `*Experts.forward` loops accumulate them) and the kernel path (routing, dispatch plan,
//! gather and combine as kernels; on the GPU the experts as grouped GEMMs over the stacked
//! weights with no per-expert host loop).

use crate::config::{ExpertsAct, ModelConfig, MoeConfig};
use crate::error::{CandleContext, Error, Result};
use crate::kernels::{self, MoePlan, StackedExperts};
use crate::model::nn::{Linear, Mlp, RmsNorm, sigmoid};
use crate::model::source::Vb;
use crate::model::{ComputePath, LayerStep, phases};
use crate::routing::{Routed, route_all};
use candle_core::{DType, Device, Tensor};

/// Where one family keeps its MoE tensors, relative to the layer's MLP prefix.
#[derive(Clone, Copy, Debug)]
pub(crate) struct MoeNames {
    /// The router module: `gate` (most families) or `router` (gpt-oss).
    pub router: &'static str,
    /// Where `e_score_correction_bias` may be, first found wins; absent: zeros (what
    /// transformers initialises the buffer to).
    pub correction: &'static [&'static str],
    /// The shared experts' module: `shared_experts` (DeepSeek, GLM) or `shared_expert`
    /// (Qwen2-MoE, with `shared_expert_gate` beside it).
    pub shared: &'static str,
    /// The router's logits in f32 whatever the compute dtype (transformers keeps DeepSeek's and
    /// GLM's router in f32: `_keep_in_fp32_modules_strict = ["e_score_correction_bias",
    /// "gate.weight"]`); else in the compute dtype, as transformers computes Qwen's, MiniMax's
    /// and gpt-oss's (`F.linear(hidden_states, self.weight)` in the model dtype, the scores
    /// then taken in f32), so that a bf16 run picks the experts a bf16 HF run picks.
    pub router_f32: bool,
    /// How the fused experts' weights (`gate_up_proj`, `down_proj`) are laid out.
    pub fused: FusedLayout,
    /// Gemma-4: `[E]` factors each pick's weight is multiplied by after the renormalisation
    /// (`Gemma4TextRouter.forward`: `top_k_weights * per_expert_scale[top_k_index]`).
    pub expert_scale: Option<&'static str>,
}

/// The layout of fused expert weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FusedLayout {
    /// transformers 5's usual output by input: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I].
    OutByIn,
    /// Input by output, `gate_up_proj` [E, H, 2I], `down_proj` [E, I, H]: Llama-4's
    /// `Llama4TextExperts` multiplies `hidden @ W`.
    InByOut,
    /// Each tensor as its shape says, output by input when it fits that: the published
    /// Qwen3-VL-MoE checkpoints store [E, H, 2I] / [E, I, H], transformers 5's `save_pretrained`
    /// [E, 2I, H] / [E, H, I], and conversion_mapping.py (`qwen3_vl_moe`: `Transpose(1, 2,
    /// check_dims=True)`) transposes a tensor only when its shape is not the module's.
    ByShape,
}

/// DeepSeek-V3, Kimi-K2, GLM-4.5, GLM-4.7-Flash (`DeepseekV3MoE`, `Glm4MoeMoE`).
pub(crate) const DEEPSEEK_NAMES: MoeNames = MoeNames {
    router: "gate",
    correction: &["gate.e_score_correction_bias"],
    shared: "shared_experts",
    router_f32: true,
    fused: FusedLayout::OutByIn,
    expert_scale: None,
};

/// Qwen3-MoE, Qwen2-MoE (`Qwen2MoeSparseMoeBlock`: `shared_expert`, `shared_expert_gate`).
pub(crate) const QWEN_NAMES: MoeNames = MoeNames {
    router: "gate",
    correction: &[],
    shared: "shared_expert",
    router_f32: false,
    fused: FusedLayout::OutByIn,
    expert_scale: None,
};

/// Qwen3-VL-MoE's tower (`Qwen3VLMoeTextSparseMoeBlock`): Qwen3-MoE's names, the fused experts
/// in either layout ([`FusedLayout::ByShape`]).
pub(crate) const QWEN_VL_NAMES: MoeNames = MoeNames {
    fused: FusedLayout::ByShape,
    ..QWEN_NAMES
};

/// Gemma-4's MoE block, under the decoder layer itself (`Gemma4TextDecoderLayer`: `router.proj`
/// without a bias, `router.per_expert_scale`, `experts` output by input); the router's input
/// scaling is the layer's (`model::gemma4`).
pub(crate) const GEMMA4_NAMES: MoeNames = MoeNames {
    router: "router.proj",
    expert_scale: Some("router.per_expert_scale"),
    ..QWEN_NAMES
};

/// MiniMax-M2: transformers keeps the bias on the block (`MiniMaxM2SparseMoeBlock`), its
/// checkpoint conversion maps it under the gate (conversion_mapping.py, `block_sparse_moe`).
pub(crate) const MINIMAX_NAMES: MoeNames = MoeNames {
    router: "gate",
    correction: &["e_score_correction_bias", "gate.e_score_correction_bias"],
    shared: "shared_experts",
    router_f32: false,
    fused: FusedLayout::OutByIn,
    expert_scale: None,
};

/// gpt-oss (`GptOssMLP`: `router` with a bias, `experts`).
pub(crate) const GPT_OSS_NAMES: MoeNames = MoeNames {
    router: "router",
    correction: &[],
    shared: "shared_experts",
    router_f32: false,
    fused: FusedLayout::OutByIn,
    expert_scale: None,
};

/// Llama-4 (`Llama4TextMoe`: `router` without a bias, `shared_expert`, `experts` input by
/// output).
pub(crate) const LLAMA4_NAMES: MoeNames = MoeNames {
    router: "router",
    correction: &[],
    shared: "shared_expert",
    router_f32: false,
    fused: FusedLayout::InByOut,
    expert_scale: None,
};

/// The router: its logits in f32 or in the compute dtype as transformers computes them
/// ([`MoeNames::router_f32`]), then routed in f32.
struct Router {
    /// [E, H], in the dtype the logits are computed in.
    weight: Tensor,
    /// gpt-oss: the router's own bias [E], added to the logits (same dtype).
    logit_bias: Option<Tensor>,
    /// `e_score_correction_bias` [E] (zeros where a family has none): steers the selection.
    correction: Vec<f32>,
    /// The same as an f32 tensor on the model's device, for the routing kernel.
    correction_t: Tensor,
    /// Gemma-4's `per_expert_scale` [E] (f32), on the host and on the model's device.
    expert_scale: Option<(Vec<f32>, Tensor)>,
}

impl Router {
    /// `xs`: [T, H] -> logits [T, E] f32.
    fn logits(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let logits = xs
            .to_dtype(self.weight.dtype())?
            .matmul(&self.weight.t()?)?;
        let logits = match &self.logit_bias {
            Some(b) => logits.broadcast_add(b)?,
            None => logits,
        };
        logits.to_dtype(DType::F32)
    }
}

/// Shared experts: one MLP over every token, gated per token by `sigmoid(gate(x))` where the
/// family has a gate (Qwen2-MoE).
struct Shared {
    mlp: Mlp,
    /// [1, H]
    gate: Option<Linear>,
}

impl Shared {
    fn forward(&self, xs: &Tensor) -> candle_core::Result<Tensor> {
        let out = self.mlp.forward(xs)?;
        match &self.gate {
            None => Ok(out),
            Some(g) => out.broadcast_mul(&sigmoid(&g.forward(xs)?)?),
        }
    }
}

/// The routed experts: one [`Mlp`] per expert (views of `stacked` on a GPU) and how they
/// activate.
pub(crate) struct Experts {
    mlps: Vec<Mlp>,
    act: ExpertsAct,
    /// On a CUDA device: the experts' weights as one matrix per projection, what
    /// [`kernels::moe_experts`] reads.
    stacked: Option<StackedExperts>,
}

impl Experts {
    /// One expert over its rows `xs` [n, H] -> [n, H].
    fn one(&self, e: usize, xs: &Tensor) -> candle_core::Result<Tensor> {
        let mlp = &self.mlps[e];
        match self.act {
            ExpertsAct::SiluMul => mlp.forward(xs),
            // `Gemma4TextExperts.forward`: `act_fn(gate) * up` (torch's tanh-approximate GELU).
            ExpertsAct::GeluTanhMul => {
                let act = (mlp.gate.forward(xs)?.gelu()? * mlp.up.forward(xs)?)?;
                mlp.down.forward(&act)
            }
            // `GptOssExperts._apply_gate`, with the kernels' rounding (each op in the dtype).
            ExpertsAct::ClampedSwiglu { alpha, limit } => {
                let (gate, up) = (mlp.gate.forward(xs)?, mlp.up.forward(xs)?);
                let act = kernels::moe::clamped_swiglu_rows(&gate, &up, alpha, limit)?;
                mlp.down.forward(&act)
            }
        }
    }

    /// The experts on rows sorted by expert (`plan.offsets`): `[R, H]` -> `[R, H]`.
    fn sorted(&self, sorted: &Tensor, plan: &MoePlan) -> candle_core::Result<Tensor> {
        if let Some(stacked) = &self.stacked
            && !sorted.device().is_cpu()
        {
            return Ok(kernels::moe_experts(sorted, &plan.offsets, stacked)?.0);
        }
        let counts = plan.counts.to_vec1::<u32>()?;
        let mut parts = Vec::with_capacity(self.mlps.len());
        let mut start = 0;
        for (e, &n) in counts.iter().enumerate() {
            let n = n as usize;
            if n > 0 {
                parts.push(self.one(e, &sorted.narrow(0, start, n)?)?);
            }
            start += n;
        }
        Tensor::cat(&parts, 0)
    }
}

/// One MoE layer's MLP.
pub(crate) struct MoeBlock {
    cfg: MoeConfig,
    router: Router,
    experts: Experts,
    shared: Option<Shared>,
}

/// A tensor in f32 straight from the store (no round trip through a bf16 compute dtype).
pub(crate) fn get_f32(vb: &Vb, name: &str, shape: &[usize]) -> Result<Tensor> {
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

impl MoeBlock {
    /// The MoE MLP under `vb` (the layer's MLP prefix), its tensors where `names` says.
    pub(crate) fn load(
        cfg: &ModelConfig,
        moe: &MoeConfig,
        vb: &Vb,
        names: &MoeNames,
    ) -> Result<MoeBlock> {
        let (h, e) = (cfg.hidden_size, moe.n_routed_experts);
        let r = vb.pp(names.router);
        let correction = match names.correction.iter().find(|n| vb.contains(n)) {
            Some(name) => get_f32(vb, name, &[e])?
                .to_vec1::<f32>()
                .ctx(|| vb.path(name))?,
            None => vec![0.0; e],
        };
        let correction_t =
            Tensor::new(correction.as_slice(), &vb.device).ctx(|| r.path("correction bias"))?;
        let get = |vb: &Vb, name: &str, shape: &[usize]| -> Result<Tensor> {
            if names.router_f32 {
                get_f32(vb, name, shape)
            } else {
                vb.get(name, shape)
            }
        };
        let logit_bias = match r.contains("bias") {
            true => Some(get(&r, "bias", &[e])?),
            false => None,
        };
        let expert_scale = match names.expert_scale {
            Some(name) => {
                let t = get_f32(vb, name, &[e])?;
                Some((t.to_vec1::<f32>().ctx(|| vb.path(name))?, t))
            }
            None => None,
        };
        let router = Router {
            weight: get(&r, "weight", &[e, h])?,
            logit_bias,
            correction,
            correction_t,
            expert_scale,
        };
        let experts = load_experts(&vb.pp("experts"), moe, h, names)?;
        let shared = if moe.shared_intermediate > 0 {
            let gate_name = format!("{}_gate", names.shared);
            Some(Shared {
                mlp: Mlp::load(&vb.pp(names.shared), h, moe.shared_intermediate)?,
                gate: if moe.shared_gate {
                    Some(Linear::load(&vb.pp(gate_name), 1, h, false)?)
                } else {
                    None
                },
            })
        } else {
            None
        };
        Ok(MoeBlock {
            cfg: moe.clone(),
            router,
            experts,
            shared,
        })
    }

    /// The candle path. `xs`: [T, H] -> ([T, H], the routing of every token); the router
    /// reads `router_in` [T, H] (Gemma-4's own input; `xs` for every other family).
    pub(crate) fn forward(
        &self,
        router_in: &Tensor,
        xs: &Tensor,
    ) -> candle_core::Result<(Tensor, Vec<Routed>)> {
        let logits = self.router.logits(router_in)?;
        let flat = logits.flatten_all()?.to_vec1::<f32>()?;
        let mut routing = route_all(
            &flat,
            &self.router.correction,
            self.cfg.n_routed_experts,
            &self.cfg.routing,
        );
        if let Some((scale, _)) = &self.router.expert_scale {
            for r in &mut routing {
                for (w, &e) in r.weights.iter_mut().zip(&r.experts) {
                    *w *= scale[e];
                }
            }
        }
        let device = xs.device();
        // Per expert: the tokens routed to it and their weights; experts in ascending order.
        let mut per_expert: Vec<(Vec<u32>, Vec<f32>)> =
            vec![Default::default(); self.experts.mlps.len()];
        for (tok, r) in routing.iter().enumerate() {
            for (&e, &w) in r.experts.iter().zip(&r.weights) {
                per_expert[e].0.push(tok as u32);
                per_expert[e].1.push(w);
            }
        }
        let mut out = xs.zeros_like()?;
        for (e, (toks, ws)) in per_expert.into_iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let n = toks.len();
            let idx = Tensor::new(toks.as_slice(), device)?;
            let w = Tensor::from_vec(ws, (n, 1), device)?.to_dtype(xs.dtype())?;
            let rows = xs.index_select(&idx, 0)?;
            let y = if self.cfg.weights_on_input {
                self.experts.one(e, &rows.broadcast_mul(&w)?)?
            } else {
                self.experts.one(e, &rows)?.broadcast_mul(&w)?
            };
            out = out.index_add(&idx, &y, 0)?;
        }
        if let Some(shared) = &self.shared {
            out = (out + shared.forward(xs)?)?;
        }
        Ok((out, routing))
    }

    /// The kernel path: routing, dispatch plan, gather and combine as kernels
    /// (kernels/moe.cu, kernels/gather.cu), the experts by [`kernels::moe_experts`] on the GPU
    /// (each touched expert's weights read once; no per-expert host loop; on an sm_90 device no
    /// host synchronisation either) or a matmul per expert on the CPU. `xs`: [T, H] -> ([T, H],
    /// topk_idx [T, K] u32, topk_w [T, K] f32).
    pub(crate) fn forward_kernels(
        &self,
        router_in: &Tensor,
        xs: &Tensor,
    ) -> candle_core::Result<(Tensor, Tensor, Tensor)> {
        let logits = self.router.logits(router_in)?;
        let mut routing =
            kernels::moe_route(&logits, &self.router.correction_t, &self.cfg.routing)?;
        if let Some((_, scale)) = &self.router.expert_scale {
            let picked = scale
                .index_select(&routing.topk_idx.flatten_all()?, 0)?
                .reshape(routing.topk_w.shape())?;
            routing.topk_w = routing.topk_w.mul(&picked)?;
        }
        let plan = kernels::moe_plan(&routing.topk_idx, self.cfg.n_routed_experts)?;
        let mut sorted = kernels::gather_rows(xs, &plan.perm_token)?; // [T*K, H]
        // Llama-4: each sorted row times its pick's weight before the experts, the outputs
        // then summed with weight 1 (every pick has a row: the experts of a token are distinct).
        let combine_w = if self.cfg.weights_on_input {
            let rows = sorted.dim(0)?;
            let w = Tensor::zeros(rows, DType::F32, xs.device())?.index_add(
                &plan.row_of,
                &routing.topk_w.flatten_all()?,
                0,
            )?;
            sorted = sorted.broadcast_mul(&w.to_dtype(sorted.dtype())?.unsqueeze(1)?)?;
            routing.topk_w.ones_like()?
        } else {
            routing.topk_w.clone()
        };
        phases::mark("moe routing, plan, gather", xs.device());
        let ys = self.experts.sorted(&sorted, &plan)?;
        phases::mark("moe experts", xs.device());
        let shared = match &self.shared {
            Some(s) => Some(s.forward(xs)?),
            None => None,
        };
        phases::mark("moe shared expert", xs.device());
        let out = kernels::moe_combine(&ys, &plan, &combine_w, shared.as_ref())?;
        phases::mark("moe combine", xs.device());
        Ok((out, routing.topk_idx, routing.topk_w))
    }
}

impl MoeBlock {
    /// The block on compute `path`: `xs` [T, H] through the experts the router picks from
    /// `router_in` [T, H] -> (the output [T, H], the routing as [T, K] expert ids i64 and
    /// weights f32).
    pub(crate) fn forward_on(
        &self,
        path: ComputePath,
        router_in: &Tensor,
        xs: &Tensor,
    ) -> candle_core::Result<(Tensor, (Tensor, Tensor))> {
        match path {
            ComputePath::Candle => {
                let (f, r) = self.forward(router_in, xs)?;
                Ok((f, routing_tensors(&r, xs.device())?))
            }
            ComputePath::Kernels | ComputePath::Fused => {
                let (f, idx, w) = self.forward_kernels(router_in, xs)?;
                Ok((f, (idx.to_dtype(DType::I64)?, w)))
            }
        }
    }
}

/// A decoder layer's feed-forward part: a dense MLP or the experts.
pub(crate) enum Ffn {
    Dense(Mlp),
    Moe(Box<MoeBlock>),
}

impl Ffn {
    /// `normed` [T, H] -> (the FFN output [T, H], for a MoE layer its routing as [T, K] expert
    /// ids i64 and weights f32).
    pub(crate) fn forward(
        &self,
        normed: &Tensor,
        path: ComputePath,
    ) -> candle_core::Result<(Tensor, Option<(Tensor, Tensor)>)> {
        match self {
            Ffn::Dense(mlp) => {
                let f = mlp.forward(normed)?;
                phases::mark("dense mlp", normed.device());
                Ok((f, None))
            }
            Ffn::Moe(moe) => {
                let (f, routing) = moe.forward_on(path, normed, normed)?;
                Ok((f, Some(routing)))
            }
        }
    }
}

/// One pre-norm decoder layer of a MoE family: `x + attn(norm(x))`, then `+ ffn(norm(.))`,
/// with the attention as the compute path runs it (`candle`: head-major with a mask, the sum
/// and the post norm apart; `kernels`: token-major, the add fused into the post norm), and the
/// layer's routing in the step's extras. DeepSeek's MLA and the GQA families share it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn residual_step(
    i: usize,
    xs: &Tensor,
    path: ComputePath,
    input_norm: &RmsNorm,
    post_norm: &RmsNorm,
    ffn: &Ffn,
    candle: impl FnOnce(&Tensor) -> candle_core::Result<Tensor>,
    kernels: impl FnOnce(&Tensor) -> candle_core::Result<Tensor>,
) -> Result<LayerStep> {
    let device = xs.device();
    // (next, ffn output, routing as [T, K] expert ids i64 and weights f32)
    type Step = (Tensor, Tensor, Option<(Tensor, Tensor)>);
    let step = || -> candle_core::Result<Step> {
        let normed = input_norm.forward(xs)?;
        phases::mark("input norm", device);
        let (xs, normed) = match path {
            ComputePath::Candle => {
                let xs = (xs + candle(&normed)?)?;
                let normed = post_norm.forward(&xs)?;
                (xs, normed)
            }
            ComputePath::Kernels | ComputePath::Fused => {
                post_norm.add_forward(xs, &kernels(&normed)?)?
            }
        };
        phases::mark("post-attention add + norm", device);
        let (f, routing) = ffn.forward(&normed, path)?;
        Ok(((xs + &f)?, f, routing))
    };
    let (next, ffn_out, routing) = step().ctx(|| format!("decoder layer {i}"))?;
    Ok(LayerStep {
        next,
        ffn_out,
        extras: routing_extras(i, routing),
    })
}

/// Layer `layer`'s routing as `Capture.extras` entries (`router.{layer}.topk_idx`,
/// `router.{layer}.topk_weight`).
pub(crate) fn routing_extras(
    layer: usize,
    routing: Option<(Tensor, Tensor)>,
) -> Vec<(String, Tensor)> {
    match routing {
        Some((idx, w)) => vec![
            (format!("router.{layer}.topk_idx"), idx),
            (format!("router.{layer}.topk_weight"), w),
        ],
        None => Vec::new(),
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

/// A linear layer from a weight `[out, in]` and an optional bias `[out]`.
fn linear(weight: Tensor, bias: Option<Tensor>) -> Linear {
    Linear { weight, bias }
}

/// The routed experts under `ex` (the `experts` prefix), in whichever layout the checkpoint
/// holds them:
/// - transformers 5's fused tensors: `gate_up_proj` [E, 2I, H] (each expert's gate rows, then
///   its up rows: `*Experts.forward` chunks the output in two) and `down_proj` [E, H, I];
/// - stacked per projection, `gate_proj` / `up_proj` [E, I, H] and `down_proj` [E, H, I] (a
///   GGUF's `ffn_*_exps`);
/// - one module per expert, `{e}.gate_proj` / `{e}.up_proj` / `{e}.down_proj` (the original
///   DeepSeek, Kimi, Qwen and GLM checkpoints) or `{e}.w1` / `{e}.w3` / `{e}.w2` (MiniMax's,
///   transformers' conversion_mapping.py `block_sparse_moe`: w1 gate, w3 up, w2 down);
/// - gpt-oss's ([`load_gpt_oss_experts`]).
///
/// On a CUDA device also stacked as [`StackedExperts`] (SwiGLU experts): the fused tensors as
/// they are, the per-expert ones copied into their slots as each expert loads.
fn load_experts(ex: &Vb, moe: &MoeConfig, h: usize, names: &MoeNames) -> Result<Experts> {
    let (e, inter) = (moe.n_routed_experts, moe.moe_intermediate_size);
    if let ExpertsAct::ClampedSwiglu { .. } = moe.act {
        return load_gpt_oss_experts(ex, moe, h);
    }
    if ex.contains("gate_proj") {
        // Stacked but not fused (a GGUF's `ffn_{gate,up,down}_exps`, Llama-4's included: its
        // converter transposes them to output by input): gate [E, I, H], up [E, I, H],
        // down [E, H, I].
        let what = ex.path("gate_proj");
        let gate = ex.get("gate_proj", &[e, inter, h])?;
        let up = ex.get("up_proj", &[e, inter, h])?;
        let down = ex.get("down_proj", &[e, h, inter])?;
        let stack = || -> candle_core::Result<StackedExperts> {
            Ok(StackedExperts::new(
                e,
                Tensor::cat(&[&gate, &up], 1)?.reshape((e * 2 * inter, h))?,
                down.reshape((e * h, inter))?,
            ))
        };
        return stacked_experts(stack().ctx(|| what.clone())?, moe.act, &what);
    }
    if ex.contains("gate_up_proj") {
        // `gate_up_proj`: each expert's gate rows, then its up rows (`chunk(2)` over the
        // outputs); input-by-output tensors are transposed into the stacked output-by-input
        // rows every expert path reads.
        let what = ex.path("gate_up_proj");
        let gate_up = fused_weight(ex, "gate_up_proj", [e, 2 * inter, h], names.fused)?;
        let down = fused_weight(ex, "down_proj", [e, h, inter], names.fused)?;
        let stacked = StackedExperts::new(
            e,
            gate_up.reshape((e * 2 * inter, h)).ctx(|| what.clone())?,
            down.reshape((e * h, inter)).ctx(|| ex.path("down_proj"))?,
        );
        return stacked_experts(stacked, moe.act, &what);
    }
    let names = if ex.contains("0.w1.weight") {
        ["w1", "w3", "w2"]
    } else {
        ["gate_proj", "up_proj", "down_proj"]
    };
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = &ex.device {
        let stacked = load_stacked(ex, dev, e, h, inter, names)?;
        return stacked_experts(stacked, moe.act, &ex.path("*"));
    }
    let mlps = (0..e)
        .map(|i| expert_mlp(&ex.pp(i.to_string()), h, inter, names))
        .collect::<Result<Vec<_>>>()?;
    Ok(Experts {
        mlps,
        act: moe.act,
        stacked: None,
    })
}

/// A fused expert weight `name` as `[E, out, in]` (`out_by_in`), from the layout `layout` says.
fn fused_weight(ex: &Vb, name: &str, out_by_in: [usize; 3], layout: FusedLayout) -> Result<Tensor> {
    let [e, out, inp] = out_by_in;
    let stored_out_by_in = match layout {
        FusedLayout::OutByIn => true,
        FusedLayout::InByOut => false,
        FusedLayout::ByShape => ex.shape_of(name).as_deref() == Some(&out_by_in[..]),
    };
    if stored_out_by_in {
        return ex.get(name, &out_by_in);
    }
    ex.get(name, &[e, inp, out])?
        .transpose(1, 2)
        .and_then(|w| w.contiguous())
        .ctx(|| ex.path(name))
}

/// Experts over `stacked`: each expert's [`Mlp`] views of its rows (and of its biases, where
/// the stack has them), the stack itself kept on a GPU for [`kernels::moe_experts`], with the
/// experts' activation.
fn stacked_experts(mut stacked: StackedExperts, act: ExpertsAct, what: &str) -> Result<Experts> {
    stacked.act = act;
    let views = || -> candle_core::Result<Vec<Mlp>> {
        (0..stacked.experts)
            .map(|i| {
                let [gate, up, down] = stacked.expert(i)?;
                let (inter, h) = (gate.dim(0)?, down.dim(0)?);
                let bias = |b: &Option<Tensor>, start: usize, len: usize| {
                    b.as_ref().map(|b| b.narrow(0, start, len)).transpose()
                };
                let gu = &stacked.gate_up_bias;
                Ok(Mlp {
                    gate: linear(gate, bias(gu, i * 2 * inter, inter)?),
                    up: linear(up, bias(gu, i * 2 * inter + inter, inter)?),
                    down: linear(down, bias(&stacked.down_bias, i * h, h)?),
                })
            })
            .collect()
    };
    let mlps = views().ctx(|| what.to_string())?;
    let keep = (!stacked.gate_up.device().is_cpu()).then_some(stacked);
    Ok(Experts {
        mlps,
        act,
        stacked: keep,
    })
}

/// One expert's module: gate, up and down under `names`.
fn expert_mlp(vb: &Vb, h: usize, inter: usize, names: [&str; 3]) -> Result<Mlp> {
    let [gate, up, down] = names;
    Ok(Mlp {
        gate: Linear::load(&vb.pp(gate), inter, h, false)?,
        up: Linear::load(&vb.pp(up), inter, h, false)?,
        down: Linear::load(&vb.pp(down), h, inter, false)?,
    })
}

/// gpt-oss's experts (`GptOssExperts`): `gate_up_proj` [E, H, 2I] whose output columns
/// interleave gate and up (`gate_up[..., ::2]`, `gate_up[..., 1::2]`), `gate_up_proj_bias`
/// [E, 2I] likewise, `down_proj` [E, I, H], `down_proj_bias` [E, H]: the weights multiply from
/// the right (`hidden @ gate_up_proj[e]`). The released checkpoints ship the two weights as
/// MXFP4 (`*_blocks` [E, rows, cols / 32, 16] u8 and `*_scales` [E, rows, cols / 32] u8, rows the
/// output features), dequantised here on the model's device ([`kernels::mxfp4_dequant`];
/// transformers integrations/mxfp4.py `convert_moe_packed_tensors` transposes the result into
/// the layout above, and so do we). [`kernels::stack_gpt_oss_experts`] then de-interleaves them
/// into the stacked rows every expert path reads; each expert's [`Mlp`] is views of them.
fn load_gpt_oss_experts(ex: &Vb, moe: &MoeConfig, h: usize) -> Result<Experts> {
    let (e, inter) = (moe.n_routed_experts, moe.moe_intermediate_size);
    if ex.contains("gate_proj") {
        return load_gpt_oss_gguf_experts(ex, moe, h);
    }
    let (gate_up, down) = if ex.contains("gate_up_proj_blocks") {
        (
            mxfp4(ex, "gate_up_proj", e, 2 * inter, h)?,
            mxfp4(ex, "down_proj", e, h, inter)?,
        )
    } else {
        (
            ex.get("gate_up_proj", &[e, h, 2 * inter])?,
            ex.get("down_proj", &[e, inter, h])?,
        )
    };
    let gate_up_bias = ex.get("gate_up_proj_bias", &[e, 2 * inter])?;
    let down_bias = ex.get("down_proj_bias", &[e, h])?;
    gpt_oss_stacked(ex, moe, [gate_up, gate_up_bias, down, down_bias])
}

/// A gpt-oss GGUF's experts, as llama.cpp's converter splits them
/// (convert_hf_to_gguf.py `GptOssModel`: `gate_up_proj[:, ::2]` becomes `ffn_gate_exps`,
/// `[:, 1::2]` `ffn_up_exps`, each `[E, I, H]` output by input, `ffn_down_exps` `[E, H, I]`, the
/// biases likewise): interleaved back into transformers' layout, then stacked as above.
fn load_gpt_oss_gguf_experts(ex: &Vb, moe: &MoeConfig, h: usize) -> Result<Experts> {
    let (e, inter) = (moe.n_routed_experts, moe.moe_intermediate_size);
    let gate = ex.get("gate_proj", &[e, inter, h])?;
    let up = ex.get("up_proj", &[e, inter, h])?;
    let down = ex.get("down_proj", &[e, h, inter])?;
    let gate_b = ex.get("gate_proj_bias", &[e, inter])?;
    let up_b = ex.get("up_proj_bias", &[e, inter])?;
    let down_b = ex.get("down_proj_bias", &[e, h])?;
    let hf = || -> candle_core::Result<[Tensor; 4]> {
        // [E, H, I, 2] -> [E, H, 2I]: column 2j is gate j, 2j + 1 up j.
        let gate_up = Tensor::stack(&[gate.transpose(1, 2)?, up.transpose(1, 2)?], 3)?
            .reshape((e, h, 2 * inter))?;
        let gate_up_b = Tensor::stack(&[&gate_b, &up_b], 2)?.reshape((e, 2 * inter))?;
        Ok([
            gate_up,
            gate_up_b,
            down.transpose(1, 2)?.contiguous()?,
            down_b.clone(),
        ])
    };
    let parts = hf().ctx(|| ex.path("gate_proj"))?;
    gpt_oss_stacked(ex, moe, parts)
}

/// gpt-oss experts from transformers' layout: `gate_up_proj` [E, H, 2I] (interleaved), its
/// bias [E, 2I], `down_proj` [E, I, H], its bias [E, H].
fn gpt_oss_stacked(
    ex: &Vb,
    moe: &MoeConfig,
    [gate_up, gate_up_bias, down, down_bias]: [Tensor; 4],
) -> Result<Experts> {
    let ExpertsAct::ClampedSwiglu { alpha, limit } = moe.act else {
        return Err(Error::config(
            ex.origin(),
            "gpt-oss experts without the clamped SwiGLU".to_string(),
        ));
    };
    let stacked =
        kernels::stack_gpt_oss_experts(&gate_up, &gate_up_bias, &down, &down_bias, alpha, limit)
            .ctx(|| ex.path("gate_up_proj"))?;
    stacked_experts(stacked, moe.act, &ex.path("gate_up_proj"))
}

/// An MXFP4 weight `{name}_blocks` / `{name}_scales` of `[E, rows, cols]` output-by-input
/// matrices, dequantised in the compute dtype and transposed to `[E, cols, rows]` (the layout
/// of transformers' `GptOssExperts` parameters).
fn mxfp4(ex: &Vb, name: &str, e: usize, rows: usize, cols: usize) -> Result<Tensor> {
    let (blocks, scales) = (format!("{name}_blocks"), format!("{name}_scales"));
    let groups = cols.div_ceil(32);
    ex.checked(&blocks, &[e, rows, groups, 16])?;
    ex.checked(&scales, &[e, rows, groups])?;
    let (b, s) = (ex.get_raw(&blocks)?, ex.get_raw(&scales)?);
    let what = ex.path(name);
    kernels::mxfp4_dequant(&b, &s, ex.dtype)
        .and_then(|w| w.narrow(2, 0, cols)?.transpose(1, 2))
        .ctx(|| format!("dequantising {what} (MXFP4)"))
}

/// Per-expert weights copied into their slots of the stacked matrices as each expert loads,
/// so a layer's experts are held once plus one expert. Every weight arrives in the builder's
/// compute dtype (`Vb::get` converts to it).
#[cfg(feature = "cuda")]
fn load_stacked(
    ex: &Vb,
    dev: &candle_core::cuda_backend::CudaDevice,
    e: usize,
    h: usize,
    inter: usize,
    names: [&str; 3],
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
        let m = expert_mlp(&ex.pp(i.to_string()), h, inter, names)?;
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
