//! The launches of kernels/moe.cu (routing, the plan, the combine), kernels/moe_gemm_sm90.cu
//! (the Hopper expert GEMMs) and kernels/expert_act.cu (the experts' bias and activation) from
//! raw device pointers: their arguments and the launches on the device's stream.
//! [`super::moe_experts`] and the candle ops of [`super`] call them.

use crate::kernels::cuda::{
    DevPtr, Module, allow_shared_memory, cfg, function, grid_dim, launch, row_threads, tensor_map,
};
use crate::kernels::dispatch::hopper_device;
use crate::kernels::{KernelDType, to_i32, to_i64};
use candle_core::Result;
use candle_core::cuda_backend::CudaDevice;

// ---------------------------------------------------------------------------------- moe.cu

/// `moe_route`: see kernels/moe.cu. `logits` `[tokens, experts]` f32, `bias` `[experts]` f32;
/// writes `topk_idx` `[tokens, k]` (32-bit, experts ascending) and `topk_w` `[tokens, k]` f32.
#[derive(Clone, Copy, Debug)]
pub struct MoeRouteArgs {
    pub logits: DevPtr,
    pub bias: DevPtr,
    pub topk_idx: DevPtr,
    pub topk_w: DevPtr,
    pub tokens: usize,
    pub experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub k: usize,
    pub norm_topk: bool,
    pub scaling: f32,
    /// Softmax scores instead of sigmoid ones.
    pub softmax: bool,
}

const ROUTE_WARPS: usize = 4;
const ROUTE_MAX_GROUPS: usize = 64;
/// The routing and plan kernels' limit on experts (one bit per expert and lane, one thread per
/// expert in the scan).
pub const MOE_MAX_EXPERTS: usize = 1024;

pub fn moe_route(dev: &CudaDevice, a: &MoeRouteArgs) -> Result<()> {
    let (e, g) = (a.experts, a.n_group);
    if e == 0 || e > MOE_MAX_EXPERTS || g == 0 || g > ROUTE_MAX_GROUPS || !e.is_multiple_of(g) {
        candle_core::bail!(
            "moe_route: {e} experts in {g} groups (need 1..={MOE_MAX_EXPERTS} experts, \
             1..={ROUTE_MAX_GROUPS} equal groups)"
        );
    }
    if a.topk_group == 0 || a.topk_group > g || a.k == 0 || a.k > 32 || a.k > a.topk_group * (e / g)
    {
        candle_core::bail!(
            "moe_route: top {} experts from {} of {g} groups of {} (k must be 1..=32)",
            a.k,
            a.topk_group,
            e / g
        );
    }
    if a.tokens == 0 {
        return Ok(());
    }
    let name = "moe_route";
    let func = function(dev, Module::Moe, name)?;
    let smem = ROUTE_WARPS * (2 * e + ROUTE_MAX_GROUPS) * 4;
    allow_shared_memory(&func, smem, name)?;
    let config = cfg(
        (grid_dim(a.tokens.div_ceil(ROUTE_WARPS), name)?, 1, 1),
        (ROUTE_WARPS * 32) as u32,
        smem,
    )?;
    launch!(
        dev,
        func,
        name,
        config,
        [
            a.logits,
            a.bias,
            a.topk_idx,
            a.topk_w,
            to_i32(a.tokens, "tokens")?,
            to_i32(e, "experts")?,
            to_i32(g, "n_group")?,
            to_i32(a.topk_group, "topk_group")?,
            to_i32(a.k, "k")?,
            i32::from(a.norm_topk),
            a.scaling,
            i32::from(a.softmax),
        ]
    );
    Ok(())
}

/// Tokens per block of the plan kernels (kernels/moe.cu `PLAN_CHUNK`).
const PLAN_CHUNK: usize = 256;

/// `moe_plan_*`: see kernels/moe.cu. Reads `topk_idx` `[tokens, k]`; writes `counts`
/// `[experts]`, `offsets` `[experts + 1]`, `perm_token` `[tokens * k]`, `row_of`
/// `[tokens * k]` (all 32-bit) using `workspace` (`moe_plan_workspace_len` ints).
#[derive(Clone, Copy, Debug)]
pub struct MoePlanArgs {
    pub topk_idx: DevPtr,
    pub tokens: usize,
    pub k: usize,
    pub experts: usize,
    pub workspace: DevPtr,
    pub counts: DevPtr,
    pub offsets: DevPtr,
    pub perm_token: DevPtr,
    pub row_of: DevPtr,
}

/// Ints of workspace [`moe_plan`] needs: one count per (chunk of 256 tokens, expert).
pub fn moe_plan_workspace_len(tokens: usize, experts: usize) -> usize {
    tokens.div_ceil(PLAN_CHUNK).max(1) * experts
}

pub fn moe_plan(dev: &CudaDevice, a: &MoePlanArgs) -> Result<()> {
    if a.experts == 0 || a.experts > MOE_MAX_EXPERTS {
        candle_core::bail!(
            "moe_plan: {} experts (need 1..={MOE_MAX_EXPERTS})",
            a.experts
        );
    }
    to_i32(
        a.tokens
            .checked_mul(a.k)
            .ok_or_else(|| candle_core::Error::Msg("moe_plan: tokens * k overflows".into()))?,
        "tokens * k",
    )?;
    let chunks = a.tokens.div_ceil(PLAN_CHUNK).max(1);
    let (t, k, e) = (
        to_i32(a.tokens, "tokens")?,
        to_i32(a.k, "k")?,
        to_i32(a.experts, "experts")?,
    );
    let count = function(dev, Module::Moe, "moe_plan_count")?;
    let config = cfg(
        (grid_dim(chunks, "moe_plan_count")?, 1, 1),
        PLAN_CHUNK as u32,
        a.experts * 4,
    )?;
    launch!(
        dev,
        count,
        "moe_plan_count",
        config,
        [a.topk_idx, t, k, e, a.workspace]
    );

    let scan = function(dev, Module::Moe, "moe_plan_scan")?;
    let threads = (a.experts.div_ceil(32) * 32) as u32;
    let config = cfg((1, 1, 1), threads, a.experts * 4)?;
    launch!(
        dev,
        scan,
        "moe_plan_scan",
        config,
        [
            a.workspace,
            to_i32(chunks, "chunks")?,
            e,
            a.counts,
            a.offsets,
        ]
    );

    let place = function(dev, Module::Moe, "moe_plan_place")?;
    let smem = a.experts * (PLAN_CHUNK / 32) * 4;
    let config = cfg(
        (grid_dim(chunks, "moe_plan_place")?, 1, 1),
        PLAN_CHUNK as u32,
        smem,
    )?;
    launch!(
        dev,
        place,
        "moe_plan_place",
        config,
        [a.topk_idx, t, k, e, a.workspace, a.perm_token, a.row_of,]
    );
    Ok(())
}

/// `moe_combine_*`: see kernels/moe.cu. `ys` `[tokens * k, hidden]` in sorted-row order,
/// `row_of` `[tokens * k]` 32-bit, `topk_w` `[tokens, k]` f32, `shared` and `out`
/// `[tokens, hidden]`; all contiguous.
#[derive(Clone, Copy, Debug)]
pub struct MoeCombineArgs {
    pub ys: DevPtr,
    pub row_of: DevPtr,
    pub topk_w: DevPtr,
    pub shared: Option<DevPtr>,
    pub out: DevPtr,
    pub tokens: usize,
    pub k: usize,
    pub hidden: usize,
}

pub fn moe_combine(dev: &CudaDevice, dtype: KernelDType, a: &MoeCombineArgs) -> Result<()> {
    if a.tokens == 0 || a.hidden == 0 {
        return Ok(());
    }
    let name = format!("moe_combine_{}", dtype.suffix());
    let func = function(dev, Module::Moe, &name)?;
    let threads = (a.hidden.div_ceil(32) * 32).clamp(32, 256) as u32;
    let config = cfg((grid_dim(a.tokens, &name)?, 1, 1), threads, 0)?;
    launch!(
        dev,
        func,
        name,
        config,
        [
            a.ys,
            a.row_of,
            a.topk_w,
            a.shared.unwrap_or(0),
            a.out,
            to_i32(a.tokens, "tokens")?,
            to_i32(a.k, "k")?,
            to_i32(a.hidden, "hidden")?,
        ]
    );
    Ok(())
}

// ----------------------------------------------------------------------------- moe_gemm_sm90.cu

/// Which of kernels/moe_gemm_sm90.cu's two GEMMs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeGemmKind {
    /// `out[r, j] = silu(x_r . gate_j) * (x_r . up_j)`; each expert's weight block holds its
    /// `n_out` gate rows, then its `n_out` up rows.
    GateUp,
    /// `out[r, j] = x_r . w_j`; each expert's weight block holds `n_out` rows.
    Down,
}

/// `moe_gemm_wg_{gate_up,down}_*`: see kernels/moe_gemm_sm90.cu. `x` `[rows, k]` (row stride
/// `k`) sorted by expert, `offsets` `[experts + 1]` u32 on the device (expert e owns rows
/// `offsets[e]..offsets[e + 1]`, `offsets[experts] == rows`), `w` `[experts * rpe, k]` (row
/// stride `k`; `rpe` = 2 `n_out` for [`MoeGemmKind::GateUp`], `n_out` for `Down`), `out`
/// `[rows, n_out]` at row stride `o_stride`.
#[derive(Clone, Copy, Debug)]
pub struct MoeGemmArgs {
    pub kind: MoeGemmKind,
    pub x: DevPtr,
    pub rows: usize,
    pub k: usize,
    pub offsets: DevPtr,
    pub experts: usize,
    pub w: DevPtr,
    pub out: DevPtr,
    pub o_stride: usize,
    pub n_out: usize,
}

/// The most experts the kernel's shared-memory tile index holds (`MAX_EXPERTS` in the .cu).
pub const MOE_GEMM_MAX_EXPERTS: usize = 512;
/// Token rows per tile at most (`CHUNK` in the .cu).
pub const MOE_GEMM_CHUNK: usize = 96;
/// Its ring: 5 stages of two 128 x 64 weight boxes and a 96 x 64 token chunk, 2-byte
/// elements, and 1 KiB of alignment slack (`SMEM_BYTES` in the .cu).
const MOE_GEMM_SMEM: usize = 5 * (2 * 128 * 64 + MOE_GEMM_CHUNK * 64) * 2 + 1024;

impl MoeGemmArgs {
    /// Rows of each expert's weight block.
    pub fn rows_per_expert(&self) -> usize {
        match self.kind {
            MoeGemmKind::GateUp => 2 * self.n_out,
            MoeGemmKind::Down => self.n_out,
        }
    }

    /// Why the kernel cannot take these arguments (`None`: it can): the limits of its tile
    /// index and of TMA (16-byte rows and bases, i32 coordinates).
    pub fn unsupported(&self, dtype: KernelDType) -> Option<String> {
        let rows_w = self.experts.checked_mul(self.rows_per_expert());
        if dtype == KernelDType::F32 {
            Some("f32 (the kernel takes bf16 or f16)".into())
        } else if self.experts == 0 || self.experts > MOE_GEMM_MAX_EXPERTS {
            Some(format!(
                "{} experts (1..={MOE_GEMM_MAX_EXPERTS})",
                self.experts
            ))
        } else if self.k == 0 || !self.k.is_multiple_of(8) || self.n_out == 0 {
            Some(format!(
                "k {} (a positive multiple of 8), n_out {}",
                self.k, self.n_out
            ))
        } else if rows_w.is_none_or(|r| r > i32::MAX as usize) || self.rows > i32::MAX as usize {
            Some("more rows than TMA coordinates reach".into())
        } else if ![self.x, self.w, self.out]
            .iter()
            .all(|p| p.is_multiple_of(16))
            || self.o_stride < self.n_out
        {
            Some("pointers not 16-byte aligned, or out rows shorter than n_out".into())
        } else {
            None
        }
    }
}

/// Runs one of the Hopper expert GEMMs on an sm_90 device (see [`MoeGemmArgs`]); a persistent
/// grid of one 384-thread block per SM (fewer when there are fewer tiles).
pub fn moe_gemm_wg(dev: &CudaDevice, dtype: KernelDType, a: &MoeGemmArgs) -> Result<()> {
    if let Some(why) = a.unsupported(dtype) {
        candle_core::bail!("moe gemm: the Hopper kernel cannot take {why}");
    }
    if !hopper_device(dev) {
        candle_core::bail!("moe gemm: the Hopper kernel needs an sm_90 device");
    }
    if a.rows == 0 {
        return Ok(());
    }
    let tag = match a.kind {
        MoeGemmKind::GateUp => "gate_up",
        MoeGemmKind::Down => "down",
    };
    let name = format!("moe_gemm_wg_{tag}_{}", dtype.suffix());
    let func = function(dev, Module::MoeGemmSm90, &name)?;
    allow_shared_memory(&func, MOE_GEMM_SMEM, &name)?;
    // At most ceil(rows / CHUNK) + experts token chunks, each with its column blocks.
    let tile_cols = match a.kind {
        MoeGemmKind::GateUp => 128,
        MoeGemmKind::Down => 256,
    };
    let tiles = (a.rows.div_ceil(MOE_GEMM_CHUNK) + a.experts) * a.n_out.div_ceil(tile_cols);
    let sms = dev
        .cuda_stream()
        .context()
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .map_err(|e| candle_core::Error::Msg(format!("{name}: SM count: {e:?}")))?;
    let blocks = tiles.min(sms.max(1) as usize);
    let rpe = a.rows_per_expert();
    let w_map = tensor_map(dtype, a.w, a.k, a.experts * rpe, a.k, 128)?;
    let x_map = tensor_map(dtype, a.x, a.k, a.rows, a.k, 16)?;
    launch!(
        dev,
        func,
        name,
        cfg((grid_dim(blocks, &name)?, 1, 1), 384, MOE_GEMM_SMEM)?,
        [
            w_map,
            x_map,
            a.offsets,
            a.out,
            to_i64(a.o_stride, "out stride")?,
            to_i32(a.experts, "experts")?,
            to_i32(rpe, "rows per expert")?,
            to_i32(a.n_out, "n_out")?,
            to_i32(a.k, "k")?,
        ]
    );
    Ok(())
}

// ---------------------------------------------------------------------------- expert_act.cu

/// The activation [`expert_act`] applies (the `act` argument of kernels/expert_act.cu).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertActKind {
    SiluMul,
    GeluTanhMul,
    ClampedSwiglu { alpha: f32, limit: f32 },
}

/// `expert_act_*`: see kernels/expert_act.cu. `gu` `[rows, *]` (gate columns `0..inter`, up
/// columns `inter..2 inter`, row stride `gu_stride`), `bias` `[experts * 2 inter]` or none
/// (each expert's gate biases, then its up biases), `offsets` `[experts + 1]` u32 on the
/// device, `out` `[rows, inter]` at row stride `o_stride`; one dtype for gu, bias and out.
#[derive(Clone, Copy, Debug)]
pub struct ExpertActArgs {
    pub gu: DevPtr,
    pub gu_stride: usize,
    pub bias: Option<DevPtr>,
    pub offsets: DevPtr,
    pub experts: usize,
    pub out: DevPtr,
    pub o_stride: usize,
    pub rows: usize,
    pub inter: usize,
    pub act: ExpertActKind,
}

pub fn expert_act(dev: &CudaDevice, dtype: KernelDType, a: &ExpertActArgs) -> Result<()> {
    if a.rows == 0 || a.inter == 0 {
        return Ok(());
    }
    if a.experts == 0 || a.gu_stride < 2 * a.inter || a.o_stride < a.inter {
        candle_core::bail!(
            "expert_act: {} experts, gu stride {} and out stride {} for {} columns",
            a.experts,
            a.gu_stride,
            a.o_stride,
            a.inter
        );
    }
    let name = format!("expert_act_{}", dtype.suffix());
    let func = function(dev, Module::ExpertAct, &name)?;
    let config = cfg((grid_dim(a.rows, &name)?, 1, 1), row_threads(a.inter, 4), 0)?;
    let (act, alpha, limit) = match a.act {
        ExpertActKind::SiluMul => (0i32, 0f32, 0f32),
        ExpertActKind::ClampedSwiglu { alpha, limit } => (1, alpha, limit),
        ExpertActKind::GeluTanhMul => (2, 0f32, 0f32),
    };
    launch!(
        dev,
        func,
        name,
        config,
        [
            a.gu,
            to_i64(a.gu_stride, "gu stride")?,
            a.bias.unwrap_or(0),
            a.offsets,
            to_i32(a.experts, "experts")?,
            a.out,
            to_i64(a.o_stride, "out stride")?,
            to_i32(a.rows, "rows")?,
            to_i32(a.inter, "inter")?,
            act,
            alpha,
            limit,
        ]
    );
    Ok(())
}

/// `expert_bias_add_*`: see kernels/expert_act.cu. `y` `[rows, cols]` at row stride
/// `y_stride`, updated in place; `bias` `[experts * cols]`; `offsets` as [`ExpertActArgs`].
#[derive(Clone, Copy, Debug)]
pub struct ExpertBiasArgs {
    pub y: DevPtr,
    pub y_stride: usize,
    pub bias: DevPtr,
    pub offsets: DevPtr,
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
}

pub fn expert_bias_add(dev: &CudaDevice, dtype: KernelDType, a: &ExpertBiasArgs) -> Result<()> {
    if a.rows == 0 || a.cols == 0 {
        return Ok(());
    }
    if a.experts == 0 || a.y_stride < a.cols {
        candle_core::bail!(
            "expert_bias_add: {} experts, row stride {} for {} columns",
            a.experts,
            a.y_stride,
            a.cols
        );
    }
    let name = format!("expert_bias_add_{}", dtype.suffix());
    let func = function(dev, Module::ExpertAct, &name)?;
    let config = cfg((grid_dim(a.rows, &name)?, 1, 1), row_threads(a.cols, 4), 0)?;
    launch!(
        dev,
        func,
        name,
        config,
        [
            a.y,
            to_i64(a.y_stride, "y stride")?,
            a.bias,
            a.offsets,
            to_i32(a.experts, "experts")?,
            to_i32(a.rows, "rows")?,
            to_i32(a.cols, "cols")?,
        ]
    );
    Ok(())
}
