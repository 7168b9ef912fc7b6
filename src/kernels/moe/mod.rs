//! Mixture-of-experts routing and dispatch (kernels/moe.cu), for every MoE family
//! ([`crate::routing::Routing`] says how a family routes).
//!
//! A MoE layer on the GPU: [`moe_route`] (router logits -> top-k experts and weights),
//! [`moe_plan`] (assignments sorted by expert: which token each expert row reads, where each
//! pick's output lands), [`super::gather_rows`] by `perm_token`, the experts ([`moe_experts`]:
//! rows `offsets[e]..offsets[e + 1]` for expert e; on an sm_90 device kernels/moe_gemm_sm90.cu,
//! which reads the offsets on the device, else cuBLAS grouped GEMMs), and [`moe_combine`]
//! (weighted sum of each token's picks plus the shared expert).
//!
//! These ops have several outputs (or four inputs), so they dispatch on the device themselves
//! instead of going through a candle `CustomOp`. Their launches from raw device pointers are
//! [`launch`].

#[cfg(feature = "cuda")]
pub mod launch;

use super::{Elem, with_float_type};
pub use crate::routing::Routing as RouteParams;
use crate::routing::{Routed, route_all};
use candle_core::{DType, Device, Result, Tensor};

/// The CPU reference: every token's scores ([`crate::routing::scores`]: the kernel's f64
/// sigmoid or softmax) and decision ([`crate::routing::route_token`], the model's own routing).
/// `logits`: `[tokens, experts]`, `bias`: `[experts]`. Returns the experts `[tokens, k]`
/// (ascending per token) and their weights `[tokens, k]`.
pub fn moe_route_ref(
    logits: &[f32],
    bias: &[f32],
    experts: usize,
    p: &RouteParams,
) -> (Vec<u32>, Vec<f32>) {
    let (mut idx, mut w) = (Vec::new(), Vec::new());
    for Routed { experts, weights } in route_all(logits, bias, experts, p) {
        idx.extend(experts.iter().map(|&e| e as u32));
        w.extend(weights);
    }
    (idx, w)
}

/// Routing of `[tokens]` tokens: `topk_idx` `[tokens, k]` u32 (ascending per token) and
/// `topk_w` `[tokens, k]` f32.
#[derive(Clone, Debug)]
pub struct MoeRouting {
    pub topk_idx: Tensor,
    pub topk_w: Tensor,
}

/// Routes every token: `logits` `[tokens, experts]` f32 (the router GEMM output, any row
/// stride), `bias` `[experts]` f32 (`e_score_correction_bias`).
pub fn moe_route(logits: &Tensor, bias: &Tensor, p: &RouteParams) -> Result<MoeRouting> {
    let (tokens, experts) = logits.dims2()?;
    if logits.dtype() != DType::F32 || bias.dtype() != DType::F32 || bias.dims() != [experts] {
        candle_core::bail!(
            "moe_route: expected f32 logits [T, E] and f32 bias [E], found {:?} {:?} and {:?} {:?}",
            logits.dtype(),
            logits.dims(),
            bias.dtype(),
            bias.dims()
        );
    }
    if let Some(problem) = p.problem(experts) {
        candle_core::bail!("moe_route: {problem}");
    }
    let (logits, bias) = (logits.contiguous()?, bias.contiguous()?);
    match logits.device() {
        Device::Cpu => {
            let l = logits.flatten_all()?.to_vec1::<f32>()?;
            let b = bias.to_vec1::<f32>()?;
            let (idx, w) = moe_route_ref(&l, &b, experts, p);
            Ok(MoeRouting {
                topk_idx: Tensor::from_vec(idx, (tokens, p.k), &Device::Cpu)?,
                topk_w: Tensor::from_vec(w, (tokens, p.k), &Device::Cpu)?,
            })
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            use super::cuda;
            let n = tokens * p.k;
            let (idx, w) = (
                cuda::alloc(dev, DType::U32, n)?,
                cuda::alloc(dev, DType::F32, n)?,
            );
            launch::moe_route(
                dev,
                &launch::MoeRouteArgs {
                    logits: cuda::tensor_ptr(&logits)?,
                    bias: cuda::tensor_ptr(&bias)?,
                    topk_idx: cuda::storage_ptr(&idx, 0)?,
                    topk_w: cuda::storage_ptr(&w, 0)?,
                    tokens,
                    experts,
                    n_group: p.n_group,
                    topk_group: p.topk_group,
                    k: p.k,
                    norm_topk: p.norm_topk,
                    scaling: p.scaling as f32,
                    softmax: p.scoring == crate::routing::Scoring::Softmax,
                },
            )?;
            Ok(MoeRouting {
                topk_idx: cuda::tensor(idx, (tokens, p.k)),
                topk_w: cuda::tensor(w, (tokens, p.k)),
            })
        }
        other => candle_core::bail!("moe_route: no kernel for {:?}", other.location()),
    }
}

/// Marks a pick left out of the plan (an expert id outside `0..experts`, GPU only).
pub const NO_ROW: u32 = u32::MAX;

/// [`MoePlan`] on the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanRef {
    pub counts: Vec<u32>,
    pub offsets: Vec<u32>,
    pub perm_token: Vec<u32>,
    pub row_of: Vec<u32>,
}

/// The CPU reference of the dispatch plan, for `topk_idx` `[tokens, k]` with distinct experts
/// per token. Rows are sorted by expert, then by token (a stable counting sort).
pub fn moe_plan_ref(topk_idx: &[u32], k: usize, experts: usize) -> Result<PlanRef> {
    let mut counts = vec![0u32; experts];
    for (a, &e) in topk_idx.iter().enumerate() {
        let Some(c) = counts.get_mut(e as usize) else {
            candle_core::bail!("moe_plan: pick {a} names expert {e}, outside 0..{experts}");
        };
        *c += 1;
    }
    let mut offsets = Vec::with_capacity(experts + 1);
    let mut acc = 0u32;
    offsets.push(0);
    for &c in &counts {
        acc += c;
        offsets.push(acc);
    }
    let mut cursor = offsets[..experts].to_vec();
    let mut perm_token = vec![0u32; topk_idx.len()];
    let mut row_of = vec![NO_ROW; topk_idx.len()];
    for (t, picks) in topk_idx.chunks(k.max(1)).enumerate() {
        for (j, &e) in picks.iter().enumerate() {
            if picks[..j].contains(&e) {
                candle_core::bail!("moe_plan: token {t} picks expert {e} twice");
            }
            let row = cursor[e as usize];
            cursor[e as usize] += 1;
            perm_token[row as usize] = t as u32;
            row_of[t * k + j] = row;
        }
    }
    Ok(PlanRef {
        counts,
        offsets,
        perm_token,
        row_of,
    })
}

/// Where every pick goes: all u32 vectors on the routing's device.
#[derive(Clone, Debug)]
pub struct MoePlan {
    /// `[E]` rows per expert
    pub counts: Tensor,
    /// `[E + 1]` expert e owns sorted rows `offsets[e]..offsets[e + 1]`
    pub offsets: Tensor,
    /// `[T * K]` the token of each sorted row (gather the expert inputs by it)
    pub perm_token: Tensor,
    /// `[T * K]` the sorted row of token t's k-th pick at `t * K + k` ([`NO_ROW`]: none)
    pub row_of: Tensor,
}

/// The dispatch plan of a routing: `topk_idx` `[tokens, k]` u32 (or i32), distinct experts per
/// token, all in `0..experts`.
pub fn moe_plan(topk_idx: &Tensor, experts: usize) -> Result<MoePlan> {
    let (tokens, k) = topk_idx.dims2()?;
    if !matches!(topk_idx.dtype(), DType::U32 | DType::I32) {
        candle_core::bail!(
            "moe_plan: topk_idx must be u32 or i32, found {:?}",
            topk_idx.dtype()
        );
    }
    let idx = topk_idx.contiguous()?;
    match idx.device() {
        Device::Cpu => {
            let v = idx.to_dtype(DType::U32)?.flatten_all()?.to_vec1::<u32>()?;
            let plan = moe_plan_ref(&v, k, experts)?;
            let cpu = &Device::Cpu;
            Ok(MoePlan {
                counts: Tensor::new(plan.counts.as_slice(), cpu)?,
                offsets: Tensor::new(plan.offsets.as_slice(), cpu)?,
                perm_token: Tensor::new(plan.perm_token.as_slice(), cpu)?,
                row_of: Tensor::new(plan.row_of.as_slice(), cpu)?,
            })
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            use super::cuda;
            let n = tokens * k;
            let ws = cuda::alloc(
                dev,
                DType::U32,
                launch::moe_plan_workspace_len(tokens, experts),
            )?;
            let counts = cuda::alloc(dev, DType::U32, experts)?;
            let offsets = cuda::alloc(dev, DType::U32, experts + 1)?;
            let perm = cuda::alloc(dev, DType::U32, n)?;
            let row_of = cuda::alloc(dev, DType::U32, n)?;
            launch::moe_plan(
                dev,
                &launch::MoePlanArgs {
                    topk_idx: cuda::tensor_ptr(&idx)?,
                    tokens,
                    k,
                    experts,
                    workspace: cuda::storage_ptr(&ws, 0)?,
                    counts: cuda::storage_ptr(&counts, 0)?,
                    offsets: cuda::storage_ptr(&offsets, 0)?,
                    perm_token: cuda::storage_ptr(&perm, 0)?,
                    row_of: cuda::storage_ptr(&row_of, 0)?,
                },
            )?;
            Ok(MoePlan {
                counts: cuda::tensor(counts, experts),
                offsets: cuda::tensor(offsets, experts + 1),
                perm_token: cuda::tensor(perm, n),
                row_of: cuda::tensor(row_of, n),
            })
        }
        other => {
            let _ = tokens;
            candle_core::bail!("moe_plan: no kernel for {:?}", other.location())
        }
    }
}

/// The CPU reference of the combine: `out[t] = T(sum_k w[t,k] * ys[row_of[t*K+k]] + shared[t])`
/// in f32, k ascending, each product and sum rounded to f32. `ys`: `[T*K, H]`, `shared`:
/// `[T, H]`, all contiguous.
pub fn moe_combine_ref<T: Elem>(
    ys: &[T],
    row_of: &[u32],
    topk_w: &[f32],
    shared: Option<&[T]>,
    k: usize,
    hidden: usize,
) -> Vec<T> {
    let tokens = topk_w.len() / k.max(1);
    let mut out = Vec::with_capacity(tokens * hidden);
    for t in 0..tokens {
        for h in 0..hidden {
            let mut acc = 0f32;
            for j in 0..k {
                let row = row_of[t * k + j];
                if row != NO_ROW {
                    acc += topk_w[t * k + j] * ys[row as usize * hidden + h].to_f32();
                }
            }
            if let Some(s) = shared {
                acc += s[t * hidden + h].to_f32();
            }
            out.push(T::from_f32(acc));
        }
    }
    out
}

/// Each token's expert outputs, weighted and summed, plus the shared expert's output:
/// `ys` `[T*K, H]` (the experts' outputs in sorted-row order), `plan.row_of`, `topk_w` `[T, K]`
/// f32, `shared` `[T, H]` in `ys`'s dtype. Returns `[T, H]`.
pub fn moe_combine(
    ys: &Tensor,
    plan: &MoePlan,
    topk_w: &Tensor,
    shared: Option<&Tensor>,
) -> Result<Tensor> {
    let (tokens, k) = topk_w.dims2()?;
    let (rows, hidden) = ys.dims2()?;
    if rows != tokens * k || plan.row_of.dims() != [tokens * k] || topk_w.dtype() != DType::F32 {
        candle_core::bail!(
            "moe_combine: ys {:?}, row_of {:?}, topk_w {:?} {:?} do not fit [T*K, H], [T*K], f32 [T, K]",
            ys.dims(),
            plan.row_of.dims(),
            topk_w.dtype(),
            topk_w.dims()
        );
    }
    if let Some(s) = shared
        && (s.dims() != [tokens, hidden] || s.dtype() != ys.dtype())
    {
        candle_core::bail!(
            "moe_combine: shared {:?} {:?}, expected {:?} [{tokens}, {hidden}]",
            s.dtype(),
            s.dims(),
            ys.dtype()
        );
    }
    let ys = ys.contiguous()?;
    let (row_of, w) = (plan.row_of.contiguous()?, topk_w.contiguous()?);
    let shared = shared.map(Tensor::contiguous).transpose()?;
    match ys.device() {
        Device::Cpu => {
            let r = row_of.to_vec1::<u32>()?;
            let wv = w.flatten_all()?.to_vec1::<f32>()?;
            with_float_type!(ys.dtype(), T => {
                let yv = ys.flatten_all()?.to_vec1::<T>()?;
                let sv = shared.as_ref().map(|s| s.flatten_all()?.to_vec1::<T>()).transpose()?;
                let out = moe_combine_ref(&yv, &r, &wv, sv.as_deref(), k, hidden);
                Tensor::from_vec(out, (tokens, hidden), &Device::Cpu)
            })
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            use super::cuda;
            let out = cuda::alloc(dev, ys.dtype(), tokens * hidden)?;
            launch::moe_combine(
                dev,
                super::KernelDType::of(ys.dtype())?,
                &launch::MoeCombineArgs {
                    ys: cuda::tensor_ptr(&ys)?,
                    row_of: cuda::tensor_ptr(&row_of)?,
                    topk_w: cuda::tensor_ptr(&w)?,
                    shared: shared.as_ref().map(cuda::tensor_ptr).transpose()?,
                    out: cuda::storage_ptr(&out, 0)?,
                    tokens,
                    k,
                    hidden,
                },
            )?;
            Ok(cuda::tensor(out, (tokens, hidden)))
        }
        other => candle_core::bail!("moe_combine: no kernel for {:?}", other.location()),
    }
}

/// Which way [`moe_experts`] ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertsPath {
    /// [`moe_experts_ref`] (the CPU).
    Reference,
    /// kernels/moe_gemm_sm90.cu: two launches (with kernels/expert_act.cu's between and after
    /// them for biases or the clamped SwiGLU), the offsets read on the device.
    Hopper,
    /// cuBLAS grouped GEMMs per projection and kernels/silu_mul.cu (or expert_act.cu); the
    /// host reads the counts.
    Grouped,
}

/// The activation between an expert's gate/up and down projections: the config's
/// ([`crate::config::ExpertsAct`]: `SiluMul`, `T(silu(g) * u)` in f32 rounded once; Gemma-4's
/// `GeluTanhMul`, `T(gelu_tanh(g) * u)` likewise ([`gelu_tanh`]); or gpt-oss's
/// `ClampedSwiglu`, each op rounded to the dtype as transformers' eager ops are,
/// [`clamped_swiglu`]).
pub use crate::config::ExpertsAct as ExpertAct;

/// The routed experts' weights stacked as the kernels read them: `gate_up` `[E * 2I, H]` (each
/// expert's I gate rows, then its I up rows: transformers 5's `experts.gate_up_proj` [E, 2I, H]
/// as a matrix) and `down` `[E * H, I]`, both contiguous; the activation between them; and the
/// optional biases in the same row order: `gate_up_bias` `[E * 2I]` (each expert's I gate
/// biases, then its I up biases), `down_bias` `[E * H]`, in the weights' dtype. Build with
/// [`StackedExperts::new`] (SiLU-mul, no biases) or [`stack_gpt_oss_experts`].
#[derive(Clone, Debug)]
pub struct StackedExperts {
    pub experts: usize,
    pub gate_up: Tensor,
    pub down: Tensor,
    pub act: ExpertAct,
    pub gate_up_bias: Option<Tensor>,
    pub down_bias: Option<Tensor>,
}

impl StackedExperts {
    /// SwiGLU experts without biases (DeepSeek, Qwen MoE): the defaults in one place.
    pub fn new(experts: usize, gate_up: Tensor, down: Tensor) -> StackedExperts {
        StackedExperts {
            experts,
            gate_up,
            down,
            act: ExpertAct::SiluMul,
            gate_up_bias: None,
            down_bias: None,
        }
    }

    /// `(H, I)`, after checking every tensor's shape against the experts.
    fn dims(&self) -> Result<(usize, usize)> {
        let (rows_gu, h) = self.gate_up.dims2()?;
        let (rows_d, inter) = self.down.dims2()?;
        let e = self.experts;
        if e == 0 || rows_gu != e * 2 * inter || rows_d != e * h {
            candle_core::bail!(
                "moe experts: gate_up {:?} and down {:?} are not [{e} * 2I, H] and [{e} * H, I]",
                self.gate_up.dims(),
                self.down.dims()
            );
        }
        for (bias, want, what) in [
            (&self.gate_up_bias, e * 2 * inter, "gate_up_bias"),
            (&self.down_bias, e * h, "down_bias"),
        ] {
            if let Some(b) = bias
                && b.dims() != [want]
            {
                candle_core::bail!("moe experts: {what} {:?}, expected [{want}]", b.dims());
            }
        }
        Ok((h, inter))
    }

    /// Whether these are plain SwiGLU experts without biases: the fused gate/up epilogue of
    /// kernels/moe_gemm_sm90.cu and the grouped path's silu_mul take them as they are.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn plain(&self) -> bool {
        self.act == ExpertAct::SiluMul && self.gate_up_bias.is_none() && self.down_bias.is_none()
    }

    /// Expert e's gate, up and down weights (views).
    pub fn expert(&self, e: usize) -> Result<[Tensor; 3]> {
        let (h, inter) = self.dims()?;
        Ok([
            self.gate_up.narrow(0, e * 2 * inter, inter)?,
            self.gate_up.narrow(0, e * 2 * inter + inter, inter)?,
            self.down.narrow(0, e * h, h)?,
        ])
    }

    /// The tensors on `device` (the same layout).
    pub fn to_device(&self, device: &Device) -> Result<StackedExperts> {
        let move_opt = |t: &Option<Tensor>| t.as_ref().map(|t| t.to_device(device)).transpose();
        Ok(StackedExperts {
            experts: self.experts,
            gate_up: self.gate_up.to_device(device)?,
            down: self.down.to_device(device)?,
            act: self.act,
            gate_up_bias: move_opt(&self.gate_up_bias)?,
            down_bias: move_opt(&self.down_bias)?,
        })
    }
}

/// gpt-oss's experts in the stacked layout, on the tensors' device: transformers 5.24
/// `GptOssExperts` (models/gpt_oss/modeling_gpt_oss.py) holds `gate_up_proj` `[E, H, 2I]`
/// (multiplied as `x @ gate_up_proj[e]`, gate = columns `::2`, up = columns `1::2`),
/// `gate_up_proj_bias` `[E, 2I]` (interleaved the same way), `down_proj` `[E, I, H]` (`x @
/// down_proj[e]`) and `down_proj_bias` `[E, H]`. This de-interleaves and transposes them into
/// [`StackedExperts`]' rows: `gate_up` row `e * 2I + j` is column `2j` of `gate_up_proj[e]`
/// and row `e * 2I + I + j` column `2j + 1`; the bias likewise; `down` row `e * H + h` is
/// column h of `down_proj[e]`. `alpha`, `limit`: the config's `swiglu_alpha`, `swiglu_limit`.
pub fn stack_gpt_oss_experts(
    gate_up: &Tensor,
    gate_up_bias: &Tensor,
    down: &Tensor,
    down_bias: &Tensor,
    alpha: f32,
    limit: f32,
) -> Result<StackedExperts> {
    let (e, h, two_i) = gate_up.dims3()?;
    let inter = two_i / 2;
    let fits = two_i.is_multiple_of(2)
        && gate_up_bias.dims() == [e, two_i]
        && down.dims() == [e, inter, h]
        && down_bias.dims() == [e, h];
    if !fits {
        candle_core::bail!(
            "gpt-oss experts: gate_up_proj {:?}, gate_up_proj_bias {:?}, down_proj {:?}, \
             down_proj_bias {:?} are not [E, H, 2I], [E, 2I], [E, I, H], [E, H]",
            gate_up.dims(),
            gate_up_bias.dims(),
            down.dims(),
            down_bias.dims()
        );
    }
    // [E, H, I, 2] -> [E, 2, I, H]: (e, p, i, h) is gate_up[e, h, 2i + p], p = 0 gate, 1 up.
    let gu = gate_up
        .reshape((e, h, inter, 2))?
        .permute((0, 3, 2, 1))?
        .contiguous()?
        .reshape((e * two_i, h))?;
    let gub = gate_up_bias
        .reshape((e, inter, 2))?
        .permute((0, 2, 1))?
        .contiguous()?
        .reshape(e * two_i)?;
    let d = down
        .transpose(1, 2)?
        .contiguous()?
        .reshape((e * h, inter))?;
    Ok(StackedExperts {
        experts: e,
        gate_up: gu,
        down: d,
        act: ExpertAct::ClampedSwiglu { alpha, limit },
        gate_up_bias: Some(gub),
        down_bias: Some(down_bias.contiguous()?.reshape(e * h)?),
    })
}

/// gpt-oss's clamped SwiGLU of one element, `g`, `u` already in `T` (the gate/up projection
/// plus bias): the ops of `GptOssExperts._apply_gate` (models/gpt_oss/modeling_gpt_oss.py)
/// each rounded to `T`, as torch's eager ops in `T` round them: `gc = min(g, limit)` and
/// `uc = clamp(u, -limit, limit)` (exact; NaN stays NaN), `a = T(gc * alpha)`,
/// `s = T(1 / (1 + exp(-a)))`, `glu = T(gc * s)`, `u1 = T(uc + 1)`, `T(u1 * glu)`.
/// kernels/expert_act.cu computes the same.
pub fn clamped_swiglu<T: Elem>(g: f32, u: f32, alpha: f32, limit: f32) -> T {
    use super::round_to;
    let gc = if g > limit { limit } else { g };
    let uc = if u > limit {
        limit
    } else if u < -limit {
        -limit
    } else {
        u
    };
    let a = round_to::<T>(gc * alpha);
    let s = round_to::<T>(1.0 / (1.0 + (-a).exp()));
    let glu = round_to::<T>(gc * s);
    let u1 = round_to::<T>(uc + 1.0);
    T::from_f32(u1 * glu)
}

/// torch's `gelu(approximate="tanh")` of one value in f32: `0.5 g (1 + tanh(sqrt(2 / pi)
/// (g + 0.044715 g^3)))`. kernels/expert_act.cu computes the same.
pub fn gelu_tanh(g: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let inner = SQRT_2_OVER_PI * (g + (0.044715 * g) * (g * g));
    0.5 * (g * (1.0 + inner.tanh()))
}

/// [`clamped_swiglu`] over two `[rows, cols]` tensors of one dtype (computed on the host; the
/// result on `g`'s device).
pub fn clamped_swiglu_rows(g: &Tensor, u: &Tensor, alpha: f32, limit: f32) -> Result<Tensor> {
    let out = expert_act_cpu(g, u, ExpertAct::ClampedSwiglu { alpha, limit })?;
    out.to_device(g.device())
}

/// `act` over two `[rows, cols]` tensors of one dtype, element by element on the CPU:
/// [`clamped_swiglu`], `T(gelu_tanh(g) * u)` ([`gelu_tanh`]), `T(silu(g) * u)`.
fn expert_act_cpu(g: &Tensor, u: &Tensor, act: ExpertAct) -> Result<Tensor> {
    if act == ExpertAct::SiluMul {
        return super::silu_mul(g, u);
    }
    let dims = g.dims().to_vec();
    with_float_type!(g.dtype(), T => {
        let gv = g.flatten_all()?.to_vec1::<T>()?;
        let uv = u.flatten_all()?.to_vec1::<T>()?;
        let out: Vec<T> = gv
            .iter()
            .zip(&uv)
            .map(|(g, u)| {
                let (g, u) = (g.to_f32(), u.to_f32());
                match act {
                    ExpertAct::ClampedSwiglu { alpha, limit } => {
                        clamped_swiglu::<T>(g, u, alpha, limit)
                    }
                    _ => T::from_f32(gelu_tanh(g) * u),
                }
            })
            .collect();
        Tensor::from_vec(out, dims, &Device::Cpu)
    })
}

/// The CPU reference of the experts: for each expert e and each of its rows x, with
/// `g = T(x . gate_j)` and `u = T(x . up_j)` (every product in f32, every projection's output
/// rounded to T, the unfused forward's values), the biases added in f32 and rounded
/// (`g = T(g + b)`: transformers' `x @ W + b` as two ops), the activation ([`ExpertAct`]),
/// then `T(T(act . down_j) + down_bias)`.
pub fn moe_experts_ref(sorted: &Tensor, offsets: &[u32], w: &StackedExperts) -> Result<Tensor> {
    let dtype = sorted.dtype();
    let (h, inter) = w.dims()?;
    let f32s = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
    let gu_bias = w.gate_up_bias.as_ref().map(f32s).transpose()?;
    let d_bias = w.down_bias.as_ref().map(f32s).transpose()?;
    // y + bias[at..at + n] in f32, rounded to the dtype.
    let plus = |y: Tensor, bias: &Option<Tensor>, at: usize, n: usize| -> Result<Tensor> {
        match bias {
            None => Ok(y),
            Some(b) => y
                .to_dtype(DType::F32)?
                .broadcast_add(&b.narrow(0, at, n)?)?
                .to_dtype(dtype),
        }
    };
    let mut parts = Vec::new();
    for e in 0..w.experts {
        let (lo, hi) = (offsets[e] as usize, offsets[e + 1] as usize);
        if hi <= lo {
            continue;
        }
        let x = f32s(&sorted.narrow(0, lo, hi - lo)?)?;
        let [g, u, d] = w.expert(e)?;
        let proj = |x: &Tensor, w: &Tensor| x.matmul(&f32s(w)?.t()?)?.to_dtype(dtype);
        let g = plus(proj(&x, &g)?, &gu_bias, e * 2 * inter, inter)?;
        let u = plus(proj(&x, &u)?, &gu_bias, e * 2 * inter + inter, inter)?;
        let act = expert_act_cpu(&g, &u, w.act)?;
        parts.push(plus(proj(&f32s(&act)?, &d)?, &d_bias, e * h, h)?);
    }
    if parts.is_empty() {
        return Tensor::zeros((0, h), dtype, &Device::Cpu);
    }
    Tensor::cat(&parts, 0)
}

/// The routed experts on rows sorted by expert: `sorted` `[R, H]`, `offsets` `[E + 1]` u32 on
/// `sorted`'s device (expert e owns rows `offsets[e]..offsets[e + 1]`, `offsets[E] == R`).
/// Returns `[R, H]` and the way it ran. Experts with biases or gpt-oss's activation run as a
/// plain gate/up GEMM (`[R, 2I]`), kernels/expert_act.cu (each row's expert bias, read from
/// `offsets` on the device, and the activation), the down GEMM and expert_act.cu's bias add;
/// on an sm_90 device both GEMMs are kernels/moe_gemm_sm90.cu's `down` GEMM, else cuBLAS
/// grouped GEMMs.
pub fn moe_experts(
    sorted: &Tensor,
    offsets: &Tensor,
    w: &StackedExperts,
) -> Result<(Tensor, ExpertsPath)> {
    let h = w.dims()?.0;
    let cols = sorted.dims2()?.1;
    if cols != h || offsets.dims() != [w.experts + 1] || offsets.dtype() != DType::U32 {
        candle_core::bail!(
            "moe experts: sorted {:?} and offsets {:?} {:?} do not fit H {h} and {} experts",
            sorted.dims(),
            offsets.dtype(),
            offsets.dims(),
            w.experts
        );
    }
    let biases = w.gate_up_bias.iter().chain(&w.down_bias);
    if [&w.gate_up, &w.down]
        .into_iter()
        .chain(biases)
        .any(|t| t.dtype() != sorted.dtype())
    {
        candle_core::bail!(
            "moe experts: weights {:?} (and biases) for rows of {:?}",
            w.gate_up.dtype(),
            sorted.dtype()
        );
    }
    let sorted = sorted.contiguous()?;
    match sorted.device() {
        Device::Cpu => Ok((
            moe_experts_ref(&sorted, &offsets.to_vec1::<u32>()?, w)?,
            ExpertsPath::Reference,
        )),
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            use super::cuda;
            use super::dispatch::hopper_experts;
            use candle_core::cuda_backend::CudaStorage;
            use launch::{MoeGemmArgs, MoeGemmKind};
            let dtype = super::KernelDType::of(sorted.dtype())?;
            let (rows, inter) = (sorted.dims2()?.0, w.dims()?.1);
            let args = |kind: MoeGemmKind,
                        x: &Tensor,
                        k: usize,
                        weight: &Tensor,
                        out: &CudaStorage,
                        n_out: usize|
             -> Result<MoeGemmArgs> {
                Ok(MoeGemmArgs {
                    kind,
                    x: cuda::tensor_ptr(x)?,
                    rows,
                    k,
                    offsets: cuda::tensor_ptr(offsets)?,
                    experts: w.experts,
                    w: cuda::tensor_ptr(weight)?,
                    out: cuda::storage_ptr(out, 0)?,
                    o_stride: n_out,
                    n_out,
                })
            };
            if hopper_experts(dev) && w.plain() {
                let act = cuda::alloc(dev, sorted.dtype(), rows * inter)?;
                let first = args(MoeGemmKind::GateUp, &sorted, h, &w.gate_up, &act, inter)?;
                let act = cuda::tensor(act, (rows, inter));
                let out = cuda::alloc(dev, sorted.dtype(), rows * h)?;
                let down = args(MoeGemmKind::Down, &act, inter, &w.down, &out, h)?;
                if first.unsupported(dtype).is_none() && down.unsupported(dtype).is_none() {
                    launch::moe_gemm_wg(dev, dtype, &first)?;
                    launch::moe_gemm_wg(dev, dtype, &down)?;
                    return Ok((cuda::tensor(out, (rows, h)), ExpertsPath::Hopper));
                }
            } else if hopper_experts(dev) {
                // The gate/up GEMM without its SiLU-mul epilogue: the `down` kernel over the
                // 2I rows of each expert's gate_up block.
                let gu = cuda::alloc(dev, sorted.dtype(), rows * 2 * inter)?;
                let first = args(MoeGemmKind::Down, &sorted, h, &w.gate_up, &gu, 2 * inter)?;
                let gu = cuda::tensor(gu, (rows, 2 * inter));
                let act = cuda::alloc(dev, sorted.dtype(), rows * inter)?;
                let act = cuda::tensor(act, (rows, inter));
                let out = cuda::alloc(dev, sorted.dtype(), rows * h)?;
                let down = args(MoeGemmKind::Down, &act, inter, &w.down, &out, h)?;
                if first.unsupported(dtype).is_none() && down.unsupported(dtype).is_none() {
                    launch::moe_gemm_wg(dev, dtype, &first)?;
                    expert_act_on_device(&gu, &act, offsets, w)?;
                    launch::moe_gemm_wg(dev, dtype, &down)?;
                    let out = cuda::tensor(out, (rows, h));
                    expert_down_bias_on_device(&out, offsets, w)?;
                    return Ok((out, ExpertsPath::Hopper));
                }
            }
            Ok((grouped_experts(&sorted, offsets, w)?, ExpertsPath::Grouped))
        }
        other => candle_core::bail!("moe experts: no kernel for {:?}", other.location()),
    }
}

/// kernels/expert_act.cu's `expert_act`: `gu` `[R, 2I]` (gate | up) into `act` `[R, I]`, with
/// the gate/up biases of each row's expert.
#[cfg(feature = "cuda")]
fn expert_act_on_device(
    gu: &Tensor,
    act: &Tensor,
    offsets: &Tensor,
    w: &StackedExperts,
) -> Result<()> {
    use super::cuda;
    let candle_core::Device::Cuda(dev) = gu.device() else {
        candle_core::bail!("expert_act runs on CUDA tensors");
    };
    let (rows, inter) = act.dims2()?;
    let kind = match w.act {
        ExpertAct::SiluMul => launch::ExpertActKind::SiluMul,
        ExpertAct::GeluTanhMul => launch::ExpertActKind::GeluTanhMul,
        ExpertAct::ClampedSwiglu { alpha, limit } => {
            launch::ExpertActKind::ClampedSwiglu { alpha, limit }
        }
    };
    let bias = w
        .gate_up_bias
        .as_ref()
        .map(Tensor::contiguous)
        .transpose()?;
    launch::expert_act(
        dev,
        super::KernelDType::of(gu.dtype())?,
        &launch::ExpertActArgs {
            gu: cuda::tensor_ptr(gu)?,
            gu_stride: 2 * inter,
            bias: bias.as_ref().map(cuda::tensor_ptr).transpose()?,
            offsets: cuda::tensor_ptr(offsets)?,
            experts: w.experts,
            out: cuda::tensor_ptr(act)?,
            o_stride: inter,
            rows,
            inter,
            act: kind,
        },
    )
}

/// kernels/expert_act.cu's `expert_bias_add`: each row of `out` `[R, H]` plus its expert's
/// down bias, in place (nothing without a down bias).
#[cfg(feature = "cuda")]
fn expert_down_bias_on_device(out: &Tensor, offsets: &Tensor, w: &StackedExperts) -> Result<()> {
    use super::cuda;
    let Some(bias) = &w.down_bias else {
        return Ok(());
    };
    let candle_core::Device::Cuda(dev) = out.device() else {
        candle_core::bail!("expert_bias_add runs on CUDA tensors");
    };
    let (rows, h) = out.dims2()?;
    let bias = bias.contiguous()?;
    launch::expert_bias_add(
        dev,
        super::KernelDType::of(out.dtype())?,
        &launch::ExpertBiasArgs {
            y: cuda::tensor_ptr(out)?,
            y_stride: h,
            bias: cuda::tensor_ptr(&bias)?,
            offsets: cuda::tensor_ptr(offsets)?,
            experts: w.experts,
            rows,
            cols: h,
        },
    )
}

/// [`moe_experts`] as cuBLAS grouped GEMMs: the host reads the offsets (a synchronisation),
/// then one grouped call per projection, SiLU-mul between (plain experts), or for experts with
/// biases or gpt-oss's activation one grouped gate/up call into `[R, 2I]`, expert_act.cu, the
/// grouped down call and the down bias.
#[cfg(feature = "cuda")]
fn grouped_experts(sorted: &Tensor, offsets: &Tensor, w: &StackedExperts) -> Result<Tensor> {
    use super::cuda;
    let candle_core::Device::Cuda(dev) = sorted.device() else {
        candle_core::bail!("grouped experts run on CUDA tensors");
    };
    let (h, inter) = w.dims()?;
    let rows = sorted.dims2()?.0;
    let offs = offsets.to_vec1::<u32>()?;
    let counts: Vec<usize> = offs.windows(2).map(|p| (p[1] - p[0]) as usize).collect();
    let grouped = |a: &Tensor, ws: &[Tensor], n: usize| -> Result<Tensor> {
        // Uninitialised: the groups' rows (counts sum to `rows`) cover every row.
        let out = cuda::tensor(cuda::alloc(dev, a.dtype(), rows * n)?, (rows, n));
        let ws: Vec<&Tensor> = ws.iter().collect();
        super::gemm::grouped_gemm_into(&out, a, &ws, &counts)?;
        Ok(out)
    };
    let views = (0..w.experts)
        .map(|e| w.expert(e))
        .collect::<Result<Vec<_>>>()?;
    let pick = |which: usize| -> Vec<Tensor> { views.iter().map(|v| v[which].clone()).collect() };
    if w.plain() {
        let act = super::silu_mul(
            &grouped(sorted, &pick(0), inter)?,
            &grouped(sorted, &pick(1), inter)?,
        )?;
        return grouped(&act, &pick(2), h);
    }
    let gate_up = (0..w.experts)
        .map(|e| w.gate_up.narrow(0, e * 2 * inter, 2 * inter))
        .collect::<Result<Vec<_>>>()?;
    let gu = grouped(sorted, &gate_up, 2 * inter)?;
    let act = cuda::tensor(
        cuda::alloc(dev, sorted.dtype(), rows * inter)?,
        (rows, inter),
    );
    expert_act_on_device(&gu, &act, offsets, w)?;
    let out = grouped(&act, &pick(2), h)?;
    expert_down_bias_on_device(&out, offsets, w)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{assert_close, random, random_vec, values};
    use crate::routing::{Scoring, route_token};
    use candle_core::Device;

    /// DeepSeek-V3's router (256 experts, 8 groups, top 4 groups, 8 picks, scale 2.5) and small
    /// ragged ones, some with ties planted; then the softmax routers of Qwen3-30B-A3B (128
    /// experts, top 8, renormalised), Qwen1.5-MoE (60, top 4, not renormalised) and gpt-oss-20b
    /// (32, top 4).
    fn params() -> Vec<(usize, RouteParams)> {
        let p = |n_group, topk_group, k, norm_topk, scaling| RouteParams {
            scoring: Scoring::Sigmoid,
            n_group,
            topk_group,
            k,
            norm_topk,
            scaling,
        };
        let soft = |k, norm_topk| RouteParams::top_k(Scoring::Softmax, k, norm_topk);
        vec![
            (256, p(8, 4, 8, true, 2.5)),
            (8, p(4, 2, 2, true, 2.0)),
            (12, p(3, 3, 5, false, 1.0)),
            (7, p(7, 3, 3, true, 1.5)), // groups of one expert
            (64, p(1, 1, 6, true, 16.0)),
            (128, soft(8, true)),
            (60, soft(4, false)),
            (32, soft(4, true)),
        ]
    }

    /// Logits with exact ties (quantised to 1/8) so that tie-breaking is exercised.
    fn logits(tokens: usize, experts: usize, seed: u64) -> Vec<f32> {
        random_vec(tokens * experts, seed)
            .iter()
            .map(|v| {
                if seed.is_multiple_of(2) {
                    (v * 8.0).round() / 8.0
                } else {
                    v * 4.0
                }
            })
            .collect()
    }

    #[test]
    fn route_matches_route_token() {
        // The reference is route_token itself; this pins the tensor plumbing and the scoring.
        for (experts, p) in params() {
            let tokens = 37;
            let l = logits(tokens, experts, 2);
            let bias: Vec<f32> = random_vec(experts, 3).iter().map(|v| v * 0.1).collect();
            let lt = Tensor::from_vec(l.clone(), (tokens, experts), &Device::Cpu).unwrap();
            let bt = Tensor::new(bias.as_slice(), &Device::Cpu).unwrap();
            let r = moe_route(&lt, &bt, &p).unwrap();
            let idx = r.topk_idx.to_vec2::<u32>().unwrap();
            let w = r.topk_w.to_vec2::<f32>().unwrap();
            for t in 0..tokens {
                let scores = crate::routing::scores(&l[t * experts..][..experts], p.scoring);
                let want = route_token(&scores, &bias, &p);
                assert_eq!(
                    idx[t],
                    want.experts.iter().map(|&e| e as u32).collect::<Vec<_>>()
                );
                assert_eq!(w[t], want.weights);
            }
        }
        let lt = Tensor::zeros((2, 8), DType::F32, &Device::Cpu).unwrap();
        let bt = Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap();
        let bad = RouteParams {
            n_group: 3,
            ..params()[1].1
        };
        assert!(moe_route(&lt, &bt, &bad).is_err());
    }

    #[test]
    fn plan_sorts_by_expert_then_token() {
        // 3 tokens, 2 picks each, 4 experts.
        let idx = [2u32, 0, 0, 3, 2, 3];
        let plan = moe_plan_ref(&idx, 2, 4).unwrap();
        assert_eq!(plan.counts, [2, 0, 2, 2]);
        assert_eq!(plan.offsets, [0, 2, 2, 4, 6]);
        assert_eq!(plan.perm_token, [0, 1, 0, 2, 1, 2]);
        assert_eq!(plan.row_of, [2, 0, 1, 4, 3, 5]);
        assert!(moe_plan_ref(&[0, 4], 2, 4).is_err());
        assert!(moe_plan_ref(&[1, 1], 2, 4).is_err());
    }

    #[test]
    fn route_plan_combine_equal_the_model_moe_sum() {
        // Experts as per-expert scalings: y = x * (e + 1). The combine must give
        // sum_k w_k * x * (e_k + 1) + shared, the sum transformers' DeepseekV3MoE computes.
        let (tokens, experts, hidden) = (37, 8, 5);
        let p = params()[1].1;
        let lt =
            Tensor::from_vec(logits(tokens, experts, 5), (tokens, experts), &Device::Cpu).unwrap();
        let bt = Tensor::zeros(experts, DType::F32, &Device::Cpu).unwrap();
        let r = moe_route(&lt, &bt, &p).unwrap();
        let plan = moe_plan(&r.topk_idx, experts).unwrap();
        let x = random(&[tokens, hidden], DType::F32, 6, &Device::Cpu);
        let gathered = crate::kernels::gather_rows(&x, &plan.perm_token).unwrap();
        let offsets = plan.offsets.to_vec1::<u32>().unwrap();
        let mut ys = Vec::new();
        for e in 0..experts {
            let (a, b) = (offsets[e] as usize, offsets[e + 1] as usize);
            ys.push((gathered.narrow(0, a, b - a).unwrap() * (e as f64 + 1.0)).unwrap());
        }
        let ys = Tensor::cat(&ys, 0).unwrap();
        let shared = random(&[tokens, hidden], DType::F32, 7, &Device::Cpu);
        let got = values(&moe_combine(&ys, &plan, &r.topk_w, Some(&shared)).unwrap());
        let (idx, w) = (
            r.topk_idx.to_vec2::<u32>().unwrap(),
            r.topk_w.to_vec2::<f32>().unwrap(),
        );
        let (xv, sv) = (values(&x), values(&shared));
        let mut want = Vec::new();
        for t in 0..tokens {
            for h in 0..hidden {
                let mut acc = 0f32;
                for j in 0..p.k {
                    acc += w[t][j] * (xv[t * hidden + h] * (idx[t][j] as f32 + 1.0));
                }
                want.push(acc + sv[t * hidden + h]);
            }
        }
        // The expert scaling is one f32 product on both sides: exact.
        assert_close(&got, &want, 0.0, 0.0, "moe sum");
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_route_is_bit_exact() {
        let Some(gpu) = crate::kernels::testing::cuda_device() else {
            return;
        };
        for (experts, p) in params() {
            for (tokens, seed) in [(1, 2), (37, 3), (2048, 4), (8192, 5)] {
                let l = Tensor::from_vec(
                    logits(tokens, experts, seed),
                    (tokens, experts),
                    &Device::Cpu,
                )
                .unwrap();
                let b = Tensor::from_vec(
                    random_vec(experts, seed + 10)
                        .iter()
                        .map(|v| v * 0.05)
                        .collect::<Vec<_>>(),
                    experts,
                    &Device::Cpu,
                )
                .unwrap();
                let want = moe_route(&l, &b, &p).unwrap();
                let got = moe_route(&l.to_device(&gpu).unwrap(), &b.to_device(&gpu).unwrap(), &p)
                    .unwrap();
                let what = format!("E {experts} {p:?} T {tokens}");
                assert_eq!(
                    got.topk_idx.to_vec2::<u32>().unwrap(),
                    want.topk_idx.to_vec2::<u32>().unwrap(),
                    "experts, {what}"
                );
                let (gw, ww) = (values(&got.topk_w), values(&want.topk_w));
                assert!(
                    gw.iter().zip(&ww).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "weights, {what}"
                );
            }
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_plan_matches_reference() {
        let Some(gpu) = crate::kernels::testing::cuda_device() else {
            return;
        };
        for (experts, p) in params() {
            for tokens in [1, 37, 255, 256, 257, 8192] {
                let l =
                    Tensor::from_vec(logits(tokens, experts, 7), (tokens, experts), &Device::Cpu)
                        .unwrap();
                let b = Tensor::zeros(experts, DType::F32, &Device::Cpu).unwrap();
                let idx = moe_route(&l, &b, &p).unwrap().topk_idx;
                let want = moe_plan(&idx, experts).unwrap();
                let got = moe_plan(&idx.to_device(&gpu).unwrap(), experts).unwrap();
                let v = |t: &Tensor| t.to_vec1::<u32>().unwrap();
                let what = format!("E {experts} T {tokens}");
                assert_eq!(v(&got.counts), v(&want.counts), "counts, {what}");
                assert_eq!(v(&got.offsets), v(&want.offsets), "offsets, {what}");
                assert_eq!(
                    v(&got.perm_token),
                    v(&want.perm_token),
                    "perm_token, {what}"
                );
                assert_eq!(v(&got.row_of), v(&want.row_of), "row_of, {what}");
            }
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_combine_matches_reference() {
        let Some(gpu) = crate::kernels::testing::cuda_device() else {
            return;
        };
        let cpu = Device::Cpu;
        for &(tokens, k, experts, hidden) in &[(1, 2, 8, 5), (37, 3, 12, 100), (2048, 8, 256, 7168)]
        {
            let l = Tensor::from_vec(logits(tokens, experts, 9), (tokens, experts), &cpu).unwrap();
            let b = Tensor::zeros(experts, DType::F32, &cpu).unwrap();
            let p = RouteParams {
                scaling: 2.5,
                ..RouteParams::top_k(Scoring::Sigmoid, k, true)
            };
            let r = moe_route(&l, &b, &p).unwrap();
            let plan = moe_plan(&r.topk_idx, experts).unwrap();
            for dtype in [DType::F32, DType::BF16] {
                let ys = random(&[tokens * k, hidden], dtype, 10, &cpu);
                let shared = random(&[tokens, hidden], dtype, 11, &cpu);
                for sh in [None, Some(&shared)] {
                    let want = moe_combine(&ys, &plan, &r.topk_w, sh).unwrap();
                    let gplan = MoePlan {
                        counts: plan.counts.to_device(&gpu).unwrap(),
                        offsets: plan.offsets.to_device(&gpu).unwrap(),
                        perm_token: plan.perm_token.to_device(&gpu).unwrap(),
                        row_of: plan.row_of.to_device(&gpu).unwrap(),
                    };
                    let gsh = sh.map(|s| s.to_device(&gpu).unwrap());
                    let got = moe_combine(
                        &ys.to_device(&gpu).unwrap(),
                        &gplan,
                        &r.topk_w.to_device(&gpu).unwrap(),
                        gsh.as_ref(),
                    )
                    .unwrap();
                    // The same f32 operations in the same order, no fused multiply-add: exact.
                    assert_eq!(
                        values(&got),
                        values(&want),
                        "T {tokens} K {k} H {hidden} {dtype:?}"
                    );
                }
            }
        }
    }

    /// `[0, c0, c0 + c1, ...]`: where each expert's rows start, and the end.
    fn offsets_of(counts: &[u32]) -> Vec<u32> {
        std::iter::once(0)
            .chain(counts.iter().scan(0u32, |end, &c| {
                *end += c;
                Some(*end)
            }))
            .collect()
    }

    /// Random experts and rows sorted by expert with these counts, on `device`.
    #[cfg(feature = "cuda")]
    fn experts_case(
        counts: &[u32],
        h: usize,
        inter: usize,
        dtype: DType,
        device: &Device,
    ) -> (Tensor, Vec<u32>, StackedExperts) {
        let e = counts.len();
        let offsets = offsets_of(counts);
        let rows = *offsets.last().unwrap() as usize;
        let w = StackedExperts::new(
            e,
            random(&[e * 2 * inter, h], dtype, 21, device),
            random(&[e * h, inter], dtype, 22, device),
        );
        (random(&[rows, h], dtype, 23, device), offsets, w)
    }

    /// The reference is the model's per-expert MLP (`Mlp::forward` on the CPU: candle matmuls
    /// and silu_mul) on each expert's rows, with the experts' weights stacked as
    /// transformers 5 fuses them (each expert's gate rows, then its up rows).
    #[test]
    fn experts_reference_is_the_expert_mlp() {
        let cpu = Device::Cpu;
        let (h, inter, counts) = (24, 16, [3usize, 0, 5, 1]);
        let lin = |w: Tensor| crate::model::nn::Linear {
            weight: w,
            bias: None,
        };
        let mlps: Vec<crate::model::nn::Mlp> = (0..counts.len() as u64)
            .map(|e| crate::model::nn::Mlp {
                gate: lin(random(&[inter, h], DType::F32, 30 + e, &cpu)),
                up: lin(random(&[inter, h], DType::F32, 40 + e, &cpu)),
                down: lin(random(&[h, inter], DType::F32, 50 + e, &cpu)),
            })
            .collect();
        let gate_up: Vec<&Tensor> = mlps
            .iter()
            .flat_map(|m| [&m.gate.weight, &m.up.weight])
            .collect();
        let down: Vec<&Tensor> = mlps.iter().map(|m| &m.down.weight).collect();
        let w = StackedExperts::new(
            counts.len(),
            Tensor::cat(&gate_up, 0).unwrap(),
            Tensor::cat(&down, 0).unwrap(),
        );
        let rows: usize = counts.iter().sum();
        let x = random(&[rows, h], DType::F32, 60, &cpu);
        let offsets = offsets_of(&counts.map(|c| c as u32));
        let got = moe_experts_ref(&x, &offsets, &w).unwrap();
        for (e, mlp) in mlps.iter().enumerate() {
            let (lo, n) = (offsets[e] as usize, counts[e]);
            let want = mlp.forward(&x.narrow(0, lo, n).unwrap()).unwrap();
            let got_e = got.narrow(0, lo, n).unwrap();
            assert_close(
                &values(&got_e),
                &values(&want),
                1e-5,
                1e-5,
                &format!("expert {e}"),
            );
        }
    }

    /// The Hopper expert GEMMs (kernels/moe_gemm_sm90.cu) and the grouped cuBLAS path against
    /// the CPU reference: empty experts, an expert longer than one 96-row chunk, counts that
    /// are not multiples of 16, k and n_out that are not multiples of the tiles (k % 64 != 0,
    /// n_out % 128 != 0), a DeepSeek-like spread at H 1024; bf16 and f16.
    #[cfg(feature = "cuda")]
    #[test]
    fn device_experts_match_reference() {
        let Some(gpu) = crate::kernels::testing::cuda_device() else {
            return;
        };
        let Device::Cuda(dev) = &gpu else {
            unreachable!("cuda_device is a CUDA device")
        };
        let hopper = crate::kernels::dispatch::hopper_experts(dev);
        if !hopper {
            eprintln!("skipped the Hopper expert kernel: not an sm_90 device");
        }
        let spread: Vec<u32> = (0..16u32).map(|i| (i * 37 + 11) % 97).collect();
        let cases: [(&[u32], usize, usize); 4] = [
            (&[0, 1, 130, 17, 0, 64], 200, 72),
            (&[16, 48, 81, 3], 256, 128),
            (&[300], 72, 136),
            (&spread, 1024, 256),
        ];
        for (counts, h, inter) in cases {
            for dtype in [DType::BF16, DType::F16] {
                let (x, offsets, w) = experts_case(counts, h, inter, dtype, &Device::Cpu);
                let want = moe_experts_ref(&x, &offsets, &w).unwrap();
                let gw = w.to_device(&gpu).unwrap();
                let gx = x.to_device(&gpu).unwrap();
                let goff = Tensor::new(offsets.as_slice(), &gpu).unwrap();
                let what = format!("counts {counts:?} H {h} I {inter} {dtype:?}");
                // Each projection rounds once; an f32 sum in another order may round a gate or
                // up value the other way, which moves the down projection by a few of its ulps.
                let scale = values(&want).iter().fold(1f32, |m, v| m.max(v.abs()));
                let (atol, rtol) = (1e-2 * scale, 1.0 / 128.0);
                let (got, path) = moe_experts(&gx, &goff, &gw).unwrap();
                let want_path = if hopper {
                    ExpertsPath::Hopper
                } else {
                    ExpertsPath::Grouped
                };
                assert_eq!(path, want_path, "{what}");
                assert_close(&values(&got), &values(&want), atol, rtol, &what);
                let grouped = grouped_experts(&gx, &goff, &gw).unwrap();
                assert_close(&values(&grouped), &values(&want), atol, rtol, &what);
            }
        }
    }
    /// Llama-4-Scout's experts (16 of H 5120, I 8192; top-1 over T = 128 tokens, unevenly):
    /// the default path (the Hopper kernel on sm_90) and grouped cuBLAS agree. The weights are
    /// drawn on the device (4 GB in bf16: too slow to draw and to reference on the host).
    #[cfg(feature = "cuda")]
    #[test]
    fn device_llama4_scout_experts_agree() {
        let Some(gpu) = crate::kernels::testing::cuda_device() else {
            return;
        };
        let (e, h, inter) = (16, 5120, 8192);
        let counts: Vec<u32> = (0..e as u32)
            .map(|i| [19, 0, 7, 3][i as usize % 4])
            .collect();
        let offsets = offsets_of(&counts);
        let rows = *offsets.last().unwrap() as usize;
        let draw = |shape: &[usize], std: f64| {
            Tensor::randn(0f32, std as f32, shape, &gpu)
                .and_then(|t| t.to_dtype(DType::BF16))
                .unwrap()
        };
        let w = StackedExperts::new(
            e,
            draw(&[e * 2 * inter, h], 0.02),
            draw(&[e * h, inter], 0.02),
        );
        let x = draw(&[rows, h], 1.0);
        let goff = Tensor::new(offsets.as_slice(), &gpu).unwrap();
        let (got, path) = moe_experts(&x, &goff, &w).unwrap();
        gpu.synchronize().unwrap();
        eprintln!("llama4-scout experts: {rows} rows on {path:?}");
        // Off sm_90 both sides are cuBLAS and the comparison checks nothing but that it ends.
        let Device::Cuda(dev) = &gpu else {
            unreachable!("cuda_device is a CUDA device")
        };
        let want_path = if crate::kernels::dispatch::hopper_experts(dev) {
            ExpertsPath::Hopper
        } else {
            ExpertsPath::Grouped
        };
        assert_eq!(path, want_path, "llama4-scout experts");
        let grouped = grouped_experts(&x, &goff, &w).unwrap();
        let want = values(&grouped);
        let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        assert_close(
            &values(&got),
            &want,
            1e-2 * scale,
            1.0 / 64.0,
            "llama4-scout experts",
        );
    }

    /// gpt-oss's experts in transformers' layout (`GptOssExperts`): `[E, H, 2I]`, `[E, 2I]`,
    /// `[E, I, H]`, `[E, H]` f32, the weights scaled by `w_scale` so that gate/up values pass
    /// the clamp limit 7, biases of size ~1.
    fn hf_experts(e: usize, h: usize, inter: usize, w_scale: f64) -> [Tensor; 4] {
        let cpu = Device::Cpu;
        let r = |shape: &[usize], seed| random(shape, DType::F32, seed, &cpu);
        [
            (r(&[e, h, 2 * inter], 71) * w_scale).unwrap(),
            r(&[e, 2 * inter], 72),
            (r(&[e, inter, h], 73) * (w_scale / 4.0)).unwrap(),
            r(&[e, h], 74),
        ]
    }

    /// transformers 5.24 `GptOssExperts.forward` for the rows of each expert, written out
    /// directly in f32 on the HF layout (models/gpt_oss/modeling_gpt_oss.py):
    /// `gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]`, gate = `gate_up[..., ::2]`,
    /// up = `gate_up[..., 1::2]`, `_apply_gate`, `@ down_proj[e] + down_proj_bias[e]`.
    /// `clamp`, `bias`, `interleave`: switches for the planted bugs.
    fn hf_expert_forward(
        x: &[f32],
        offsets: &[u32],
        hf: &[Tensor; 4],
        (alpha, limit): (f32, f32),
        (clamp, bias, interleave): (bool, bool, bool),
    ) -> Vec<f32> {
        let (e_n, h, two_i) = hf[0].dims3().unwrap();
        let inter = two_i / 2;
        let [gu, gub, d, db] = hf.each_ref().map(values);
        let mut out = Vec::new();
        for e in 0..e_n {
            for r in offsets[e] as usize..offsets[e + 1] as usize {
                let xr = &x[r * h..][..h];
                let mut gate_up = vec![0f32; two_i];
                for (c, gu_c) in gate_up.iter_mut().enumerate() {
                    let dot: f32 = (0..h).map(|k| xr[k] * gu[(e * h + k) * two_i + c]).sum();
                    *gu_c = dot + if bias { gub[e * two_i + c] } else { 0.0 };
                }
                let act: Vec<f32> = (0..inter)
                    .map(|j| {
                        let (gi, ui) = if interleave {
                            (2 * j, 2 * j + 1)
                        } else {
                            (j, inter + j)
                        };
                        let (mut g, mut u) = (gate_up[gi], gate_up[ui]);
                        if clamp {
                            g = g.min(limit);
                            u = u.clamp(-limit, limit);
                        }
                        let glu = g * (1.0 / (1.0 + (-(g * alpha)).exp()));
                        (u + 1.0) * glu
                    })
                    .collect();
                for c in 0..h {
                    let dot: f32 = (0..inter)
                        .map(|j| act[j] * d[(e * inter + j) * h + c])
                        .sum();
                    out.push(dot + if bias { db[e * h + c] } else { 0.0 });
                }
            }
        }
        out
    }

    /// The de-interleave of [`stack_gpt_oss_experts`] on values that name their own index:
    /// gate_up_proj[e, k, c] = 1000 e + 10 k + c, bias[e, c] = 100 e + c.
    #[test]
    fn gpt_oss_stacking_deinterleaves_gate_and_up() {
        let cpu = Device::Cpu;
        let (e, h, inter) = (2, 3, 2);
        let gu: Vec<f32> = (0..e * h * 2 * inter)
            .map(|i| {
                let (ee, k, c) = (i / (h * 2 * inter), i / (2 * inter) % h, i % (2 * inter));
                (1000 * ee + 10 * k + c) as f32
            })
            .collect();
        let gub: Vec<f32> = (0..e * 2 * inter)
            .map(|i| (100 * (i / (2 * inter)) + i % (2 * inter)) as f32)
            .collect();
        let down: Vec<f32> = (0..e * inter * h).map(|i| i as f32).collect();
        let db: Vec<f32> = (0..e * h).map(|i| -(i as f32)).collect();
        let t = |v: Vec<f32>, s: &[usize]| Tensor::from_vec(v, s, &cpu).unwrap();
        let w = stack_gpt_oss_experts(
            &t(gu, &[e, h, 2 * inter]),
            &t(gub, &[e, 2 * inter]),
            &t(down, &[e, inter, h]),
            &t(db, &[e, h]),
            1.702,
            7.0,
        )
        .unwrap();
        assert_eq!(w.gate_up.dims(), [e * 2 * inter, h]);
        let rows = w.gate_up.to_vec2::<f32>().unwrap();
        // Expert 1: gate rows are columns 0, 2; up rows columns 1, 3; each over k = 0..3.
        assert_eq!(rows[4], [1000.0, 1010.0, 1020.0]);
        assert_eq!(rows[5], [1002.0, 1012.0, 1022.0]);
        assert_eq!(rows[6], [1001.0, 1011.0, 1021.0]);
        assert_eq!(rows[7], [1003.0, 1013.0, 1023.0]);
        let b = w.gate_up_bias.as_ref().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(b, [0.0, 2.0, 1.0, 3.0, 100.0, 102.0, 101.0, 103.0]);
        // down_proj[e] is [I, H]; its transpose's rows: expert 1's row h = (6 + h, 9 + h).
        let d = w.down.to_vec2::<f32>().unwrap();
        assert_eq!(d[3..6], [[6.0, 9.0], [7.0, 10.0], [8.0, 11.0]]);
        let db = w.down_bias.as_ref().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(db, [0.0, -1.0, -2.0, -3.0, -4.0, -5.0]);
        assert_eq!(
            w.act,
            ExpertAct::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0
            }
        );
        let bad = t(vec![0.0; 4], &[e, 2]);
        assert!(stack_gpt_oss_experts(&w.gate_up, &bad, &w.down, &bad, 1.0, 1.0).is_err());
    }

    /// The reference on stacked gpt-oss experts against transformers' expert written out on its
    /// own layout ([`hf_expert_forward`]), in f32 (every rounding to T is then a no-op): empty
    /// experts, ragged counts, gate and up values past the limit on both sides. Planted bugs
    /// (no clamp, no biases, gate/up read as halves instead of interleaved) each fail by far.
    /// Gemma-4's expert activation (`gelu_pytorch_tanh`): the reference's scalar GELU is candle's
    /// tanh-approximate `gelu` (the candle path's) to f32 rounding, over the range where it
    /// bends, and the reference experts with it are `down(gelu(gate x) * up x)` per expert;
    /// SiLU in its place (the planted bug) is far off.
    #[test]
    fn gelu_tanh_reference_is_the_gemma4_expert() {
        let xs: Vec<f32> = (-800..=800).map(|i| i as f32 / 100.0).collect();
        let t = Tensor::new(xs.as_slice(), &Device::Cpu).unwrap();
        let candle: Vec<f32> = t.gelu().unwrap().to_vec1().unwrap();
        for (x, want) in xs.iter().zip(&candle) {
            let got = gelu_tanh(*x);
            assert!(
                (got - want).abs() <= 2e-6 * want.abs().max(1.0),
                "{x}: {got} vs {want}"
            );
        }
        let (e, h, inter) = (3, 16, 8);
        let gate_up = random(&[e * 2 * inter, h], DType::F32, 5, &Device::Cpu);
        let down = random(&[e * h, inter], DType::F32, 6, &Device::Cpu);
        let mut w = StackedExperts::new(e, gate_up, down);
        w.act = ExpertAct::GeluTanhMul;
        let offsets = [0u32, 4, 4, 9];
        let x = random(&[9, h], DType::F32, 7, &Device::Cpu);
        let got = values(&moe_experts_ref(&x, &offsets, &w).unwrap());
        let mut want = Vec::new();
        for ex in 0..e {
            let (lo, hi) = (offsets[ex] as usize, offsets[ex + 1] as usize);
            let rows = x.narrow(0, lo, hi - lo).unwrap();
            let [g, u, d] = w.expert(ex).unwrap();
            let act = (rows.matmul(&g.t().unwrap()).unwrap().gelu().unwrap()
                * rows.matmul(&u.t().unwrap()).unwrap())
            .unwrap();
            want.extend(values(&act.matmul(&d.t().unwrap()).unwrap()));
        }
        assert_close(&got, &want, 1e-5, 1e-5, "gelu-tanh experts");
        w.act = ExpertAct::SiluMul;
        let silu = values(&moe_experts_ref(&x, &offsets, &w).unwrap());
        let off = silu
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(off > 1e-2, "SiLU for GELU must be far off: {off}");
    }

    #[test]
    fn gpt_oss_reference_is_the_hf_expert() {
        let (h, inter, counts) = (24, 16, [3u32, 0, 5, 2]);
        let (alpha, limit) = (1.702f32, 7.0f32);
        let hf = hf_experts(counts.len(), h, inter, 4.0);
        let w = stack_gpt_oss_experts(&hf[0], &hf[1], &hf[2], &hf[3], alpha, limit).unwrap();
        let offsets = offsets_of(&counts);
        let rows = *offsets.last().unwrap() as usize;
        let x = random(&[rows, h], DType::F32, 75, &Device::Cpu);
        let got = values(&moe_experts_ref(&x, &offsets, &w).unwrap());
        let xv = values(&x);
        let want = hf_expert_forward(&xv, &offsets, &hf, (alpha, limit), (true, true, true));
        // f32 both ways; sums in another order (candle's matmul) and libm's exp: a few ulps of
        // outputs of size ~10.
        let (atol, rtol) = (1e-4, 1e-5);
        assert_close(&got, &want, atol, rtol, "gpt-oss experts");
        // The inputs exercise the clamp on both sides (else the first planted bug is invisible).
        let gu = values(&x.matmul(&w.gate_up.t().unwrap()).unwrap());
        assert!(gu.iter().any(|&v| v > limit) && gu.iter().any(|&v| v < -limit));
        for (bug, flags) in [
            ("clamp off", (false, true, true)),
            ("biases off", (true, false, true)),
            ("gate/up not interleaved", (true, true, false)),
        ] {
            let planted = hf_expert_forward(&xv, &offsets, &hf, (alpha, limit), flags);
            let worst = got
                .iter()
                .zip(&planted)
                .map(|(g, p)| (g - p).abs() / (atol + rtol * p.abs()))
                .fold(0f32, f32::max);
            assert!(worst > 100.0, "{bug}: only {worst}x the tolerance off");
        }
        // SiLU-mul experts with biases: the bias alone moves the output.
        let mut silu = w.clone();
        silu.act = ExpertAct::SiluMul;
        let with_bias = values(&moe_experts_ref(&x, &offsets, &silu).unwrap());
        silu.gate_up_bias = None;
        silu.down_bias = None;
        let plain = values(&moe_experts_ref(&x, &offsets, &silu).unwrap());
        assert!(
            with_bias
                .iter()
                .zip(&plain)
                .any(|(a, b)| (a - b).abs() > 0.1)
        );
    }

    /// In bf16, [`clamped_swiglu`] rounds after every op as transformers' eager bf16 ops do:
    /// hand-checked values at the clamp and away from it.
    #[test]
    fn clamped_swiglu_rounds_each_op() {
        use half::bf16;
        let (alpha, limit) = (1.702f32, 7.0f32);
        let r = |v: f32| bf16::from_f32(v).to_f32();
        for (g, u) in [(9.0f32, -8.0f32), (0.5, 0.25), (-3.0, 7.5), (2.0, 1.0)] {
            let (g, u) = (r(g), r(u));
            let gc = g.min(limit);
            let uc = u.clamp(-limit, limit);
            let a = r(gc * alpha);
            let s = r(1.0 / (1.0 + (-a).exp()));
            let want = r(r(uc + 1.0) * r(gc * s));
            let got = clamped_swiglu::<bf16>(g, u, alpha, limit).to_f32();
            assert_eq!(got, want, "g {g} u {u}");
        }
        // At g = 9 > limit the gate is 7: 7 * sigmoid(11.914) ~ 7; u = -8 -> -7, (u + 1) = -6.
        let v = clamped_swiglu::<f32>(9.0, -8.0, alpha, limit);
        assert!((v - (-6.0 * 7.0 / (1.0 + (-7.0f32 * alpha).exp()))).abs() < 1e-5);
        assert!(clamped_swiglu::<f32>(f32::NAN, 0.0, alpha, limit).is_nan());
    }

    /// gpt-oss experts (clamped SwiGLU, both biases) and SiLU-mul experts with biases on the
    /// GPU against the reference: the Hopper path (the `down` GEMM for gate/up, expert_act.cu,
    /// the `down` GEMM, the bias add) on sm_90 devices and the grouped cuBLAS path everywhere;
    /// empty experts, an expert past one 96-row chunk, gpt-oss-20b's H 2880 / I 2880 (8 of its
    /// 32 experts, to keep the CPU reference short). bf16 and f16. Prints one line per case.
    #[cfg(feature = "cuda")]
    #[test]
    fn device_gpt_oss_experts_match_reference() {
        let Some(gpu) = crate::kernels::testing::cuda_device() else {
            return;
        };
        let Device::Cuda(dev) = &gpu else {
            unreachable!("cuda_device is a CUDA device")
        };
        let hopper = crate::kernels::dispatch::hopper_experts(dev);
        if !hopper {
            eprintln!("skipped the Hopper expert kernel: not an sm_90 device");
        }
        let spread: Vec<u32> = (0..8u32).map(|i| (i * 37 + 11) % 29).collect();
        let cases: [(&[u32], usize, usize); 3] = [
            (&[0, 1, 130, 17, 0, 64], 200, 72),
            (&[16, 48, 81, 3], 256, 128),
            (&spread, 2880, 2880),
        ];
        for (counts, h, inter) in cases {
            // Weights scaled so that gate/up values reach the clamp at every H.
            let hf = hf_experts(counts.len(), h, inter, 40.0 / (h as f64).sqrt());
            let offsets = offsets_of(counts);
            let rows = *offsets.last().unwrap() as usize;
            for dtype in [DType::BF16, DType::F16] {
                let hf_t = hf.each_ref().map(|t| t.to_dtype(dtype).unwrap());
                let w = stack_gpt_oss_experts(&hf_t[0], &hf_t[1], &hf_t[2], &hf_t[3], 1.702, 7.0)
                    .unwrap();
                let mut silu = w.clone();
                silu.act = ExpertAct::SiluMul;
                // Gemma-4's experts: GELU-tanh, no biases (the non-fused path all the same).
                let mut gelu = w.clone();
                gelu.act = ExpertAct::GeluTanhMul;
                (gelu.gate_up_bias, gelu.down_bias) = (None, None);
                for (name, w) in [("gpt-oss", w), ("silu+bias", silu), ("gelu-tanh", gelu)] {
                    let x = random(&[rows, h], dtype, 76, &Device::Cpu);
                    let want = moe_experts_ref(&x, &offsets, &w).unwrap();
                    let gw = w.to_device(&gpu).unwrap();
                    let gx = x.to_device(&gpu).unwrap();
                    let goff = Tensor::new(offsets.as_slice(), &gpu).unwrap();
                    let what = format!("{name} counts {counts:?} H {h} I {inter} {dtype:?}");
                    // As `device_experts_match_reference`: a projection rounded the other way
                    // moves what follows by a few of its ulps; the clamp and the extra rounding
                    // steps add no error of their own (the same ops in the same order).
                    let scale = values(&want).iter().fold(1f32, |m, v| m.max(v.abs()));
                    let (atol, rtol) = (1e-2 * scale, 1.0 / 64.0);
                    let (got, path) = moe_experts(&gx, &goff, &gw).unwrap();
                    let want_path = if hopper {
                        ExpertsPath::Hopper
                    } else {
                        ExpertsPath::Grouped
                    };
                    assert_eq!(path, want_path, "{what}");
                    assert_close(&values(&got), &values(&want), atol, rtol, &what);
                    let grouped = grouped_experts(&gx, &goff, &gw).unwrap();
                    assert_close(&values(&grouped), &values(&want), atol, rtol, &what);
                    eprintln!("{what}: {path:?} and grouped pass");
                }
            }
        }
    }
}
