//! The CUDA side of [`crate::kernels`]: the PTX of `kernels/*.cu` (compiled by build.rs) loaded
//! once per device, and one launch function per kernel that takes raw device pointers and
//! sizes. A runner with preallocated workspaces calls these directly (nothing here allocates);
//! the candle ops in the sibling modules call the same functions.
//!
//! Every launch runs on the device's candle stream, so it is ordered with candle's own ops.
//! Sizes are checked (i32/i64 range, grid limits) before anything is launched, and every
//! launch's result is checked. Pointers are the caller's responsibility: each `*Args` field
//! says the shape its buffer must have.

use super::{KernelDType, to_i32, to_i64};
use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice};
use candle_core::{DType, Result};
use cudarc::driver::{CudaFunction, DevicePtr, LaunchConfig, PushKernelArg};

/// A raw device address (`CUdeviceptr`).
pub type DevPtr = u64;

/// One PTX module per `.cu` file.
#[derive(Clone, Copy, Debug)]
enum Module {
    Attention,
    AttentionSm90,
    ExpertAct,
    Fp8,
    MoeGemmSm90,
    Mxfp4,
    Gather,
    Moe,
    Rmsnorm,
    Rope,
    Score,
    SiluMul,
}

impl Module {
    /// The name candle caches the loaded module under (unique among custom modules).
    fn name(self) -> &'static str {
        match self {
            Module::Attention => "eagle_check_attention",
            Module::AttentionSm90 => "eagle_check_attention_sm90",
            Module::ExpertAct => "eagle_check_expert_act",
            Module::Fp8 => "eagle_check_fp8_dequant",
            Module::Mxfp4 => "eagle_check_mxfp4",
            Module::MoeGemmSm90 => "eagle_check_moe_gemm_sm90",
            Module::Gather => "eagle_check_gather",
            Module::Moe => "eagle_check_moe",
            Module::Rmsnorm => "eagle_check_rmsnorm",
            Module::Rope => "eagle_check_rope",
            Module::Score => "eagle_check_score",
            Module::SiluMul => "eagle_check_silu_mul",
        }
    }

    fn ptx(self) -> &'static str {
        match self {
            Module::Attention => include_str!(concat!(env!("OUT_DIR"), "/attention.ptx")),
            Module::AttentionSm90 => {
                include_str!(concat!(env!("OUT_DIR"), "/attention_sm90.ptx"))
            }
            Module::ExpertAct => include_str!(concat!(env!("OUT_DIR"), "/expert_act.ptx")),
            Module::Fp8 => include_str!(concat!(env!("OUT_DIR"), "/fp8_dequant.ptx")),
            Module::Mxfp4 => include_str!(concat!(env!("OUT_DIR"), "/mxfp4.ptx")),
            Module::MoeGemmSm90 => include_str!(concat!(env!("OUT_DIR"), "/moe_gemm_sm90.ptx")),
            Module::Gather => include_str!(concat!(env!("OUT_DIR"), "/gather.ptx")),
            Module::Moe => include_str!(concat!(env!("OUT_DIR"), "/moe.ptx")),
            Module::Rmsnorm => include_str!(concat!(env!("OUT_DIR"), "/rmsnorm.ptx")),
            Module::Rope => include_str!(concat!(env!("OUT_DIR"), "/rope.ptx")),
            Module::Score => include_str!(concat!(env!("OUT_DIR"), "/score.ptx")),
            Module::SiluMul => include_str!(concat!(env!("OUT_DIR"), "/silu_mul.ptx")),
        }
    }
}

/// The function `name` of `module`, loading the module on first use on this device.
fn function(dev: &CudaDevice, module: Module, name: &str) -> Result<CudaFunction> {
    Ok(dev
        .get_or_load_custom_func(name, module.name(), module.ptx())?
        .into_cuda_function())
}

/// Pushes each argument (by reference; each lives until the end of the enclosing block) and
/// launches `$func` on the device's stream.
macro_rules! launch {
    ($dev:expr, $func:expr, $name:expr, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        let stream = $dev.cuda_stream();
        let mut builder = stream.launch_builder(&$func);
        $(
            let arg = $arg;
            builder.arg(&arg);
        )*
        // SAFETY: the argument list matches the kernel's signature (kernels/*.cu, checked by the
        // device tests); buffer sizes are the caller's contract, documented on each `*Args`.
        unsafe { builder.launch($cfg) }
            .map_err(|e| candle_core::Error::Msg(format!("launching {}: {e:?}", $name)))?;
    }};
}

fn grid_dim(n: usize, what: &str) -> Result<u32> {
    if n == 0 || n > i32::MAX as usize {
        candle_core::bail!("{what}: grid of {n} blocks is outside 1..=2^31-1");
    }
    Ok(n as u32)
}

fn grid_dim_yz(n: usize, what: &str) -> Result<u32> {
    if n == 0 || n > 65_535 {
        candle_core::bail!("{what}: grid dimension {n} is outside 1..=65535");
    }
    Ok(n as u32)
}

fn cfg(grid: (u32, u32, u32), threads: u32, smem: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: grid,
        block_dim: (threads, 1, 1),
        shared_mem_bytes: u32::try_from(smem)
            .map_err(|_| candle_core::Error::Msg(format!("{smem} bytes of shared memory")))?,
    })
}

/// Threads for a block that walks one row of `cols` elements in 16-byte vectors: one warp for
/// short rows, up to 1024.
fn row_threads(cols: usize, elem_size: usize) -> u32 {
    let vectors = cols.div_ceil(16 / elem_size);
    (vectors.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// Raises a function's dynamic shared-memory limit when a launch needs more than the default
/// 48 KiB.
fn allow_shared_memory(func: &CudaFunction, bytes: usize, name: &str) -> Result<()> {
    if bytes <= 48 * 1024 {
        return Ok(());
    }
    let bytes = to_i32(bytes, "shared memory bytes")?;
    // SAFETY: a valid function handle, and an attribute the driver range-checks.
    unsafe {
        cudarc::driver::result::function::set_function_attribute(
            func.cu_function(),
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes,
        )
    }
    .map_err(|e| candle_core::Error::Msg(format!("{name}: {bytes} bytes of shared memory: {e:?}")))
}

/// Copies `bytes` from `src` to `dst` on the device's stream (ordered with the kernels).
pub fn copy_raw(dev: &CudaDevice, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<()> {
    // SAFETY: the caller passes two device ranges of `bytes` each, live until the copy is done
    // (frees are ordered after it on the same stream).
    unsafe {
        cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, dev.cuda_stream().cu_stream())
    }
    .map_err(|e| candle_core::Error::Msg(format!("device copy of {bytes} bytes: {e:?}")))
}

/// `t` converted to `dtype` by candle's cast, `chunk` elements a launch, into one buffer of
/// `t`'s shape ([`super::to_dtype`] says why). `t` must be contiguous, as loaded weights are.
pub fn to_dtype_in_chunks(
    t: &candle_core::Tensor,
    dtype: DType,
    chunk: usize,
) -> Result<candle_core::Tensor> {
    let candle_core::Device::Cuda(dev) = t.device() else {
        candle_core::bail!(
            "a chunked cast takes a CUDA tensor, not one on {:?}",
            t.device()
        );
    };
    if !t.is_contiguous() || chunk == 0 {
        candle_core::bail!("a chunked cast takes a contiguous tensor and chunks of at least one");
    }
    let n = t.elem_count();
    let flat = t.flatten_all()?;
    let out = tensor(alloc(dev, dtype, n)?, n);
    let (dst, size) = (tensor_ptr(&out)?, dtype.size_in_bytes());
    for start in (0..n).step_by(chunk) {
        let len = chunk.min(n - start);
        let part = flat.narrow(0, start, len)?.to_dtype(dtype)?;
        copy_raw(
            dev,
            dst + (start * size) as u64,
            tensor_ptr(&part)?,
            len * size,
        )?;
    }
    out.reshape(t.shape())
}

/// The device address of element `offset` of a storage (its start plus `offset` elements).
pub fn storage_ptr(s: &CudaStorage, offset: usize) -> Result<DevPtr> {
    let stream = s.device.cuda_stream();
    let (base, size) = match &s.slice {
        CudaStorageSlice::U8(x) => (x.device_ptr(&stream).0, 1),
        CudaStorageSlice::F8E4M3(x) => (x.device_ptr(&stream).0, 1),
        CudaStorageSlice::U32(x) => (x.device_ptr(&stream).0, 4),
        CudaStorageSlice::I32(x) => (x.device_ptr(&stream).0, 4),
        CudaStorageSlice::I64(x) => (x.device_ptr(&stream).0, 8),
        CudaStorageSlice::BF16(x) => (x.device_ptr(&stream).0, 2),
        CudaStorageSlice::F16(x) => (x.device_ptr(&stream).0, 2),
        CudaStorageSlice::F32(x) => (x.device_ptr(&stream).0, 4),
        CudaStorageSlice::F64(x) => (x.device_ptr(&stream).0, 8),
        other => candle_core::bail!("no kernel takes a {other:?} storage"),
    };
    let bytes = offset
        .checked_mul(size)
        .ok_or_else(|| candle_core::Error::Msg(format!("offset {offset} overflows")))?;
    Ok(base + bytes as u64)
}

/// An uninitialised device buffer of `n` elements of `dtype` (at least one, so that a pointer
/// exists even for empty outputs).
pub fn alloc(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    let n = n.max(1);
    // SAFETY: every caller writes the elements it exposes before they are read.
    let slice = unsafe {
        match dtype {
            DType::F32 => CudaStorageSlice::F32(dev.alloc::<f32>(n)?),
            DType::F16 => CudaStorageSlice::F16(dev.alloc::<half::f16>(n)?),
            DType::BF16 => CudaStorageSlice::BF16(dev.alloc::<half::bf16>(n)?),
            DType::F64 => CudaStorageSlice::F64(dev.alloc::<f64>(n)?),
            DType::U32 => CudaStorageSlice::U32(dev.alloc::<u32>(n)?),
            DType::I32 => CudaStorageSlice::I32(dev.alloc::<i32>(n)?),
            other => candle_core::bail!("kernels allocate no {other:?} buffers"),
        }
    };
    let storage = CudaStorage {
        slice,
        device: dev.clone(),
    };
    #[cfg(test)]
    poison(&storage, n * dtype.size_in_bytes())?;
    Ok(storage)
}

/// Fills a fresh test buffer with 0xff bytes (NaN in every float type, -1 in every integer
/// type), so an output the kernel failed to write cannot pass for a result: a fresh device
/// allocation may reuse memory that still holds a previous run's correct values.
#[cfg(test)]
fn poison(s: &CudaStorage, bytes: usize) -> Result<()> {
    let ptr = storage_ptr(s, 0)?;
    let stream = s.device.cuda_stream();
    // SAFETY: `ptr` is the start of a live allocation of at least `bytes` bytes on this stream.
    unsafe { cudarc::driver::result::memset_d8_async(ptr, 0xff, bytes, stream.cu_stream()) }
        .map_err(|e| candle_core::Error::Msg(format!("poisoning a test buffer: {e:?}")))
}

// ------------------------------------------------------------------------------ rmsnorm.cu

/// `add_rmsnorm_*`: see kernels/rmsnorm.cu. Matrices are `[rows, cols]` with the given row
/// strides (elements); `w` is `[cols]`.
#[derive(Clone, Copy, Debug)]
pub struct RmsNormArgs {
    pub x: DevPtr,
    pub x_stride: usize,
    /// The residual branch added to `x` before the norm, with its row stride.
    pub delta: Option<(DevPtr, usize)>,
    pub w: DevPtr,
    /// Where `x + delta` is written, with its row stride (may alias `x` or `delta`).
    pub resid: Option<(DevPtr, usize)>,
    pub normed: DevPtr,
    pub normed_stride: usize,
    pub rows: usize,
    pub cols: usize,
    pub eps: f32,
}

pub fn add_rmsnorm(dev: &CudaDevice, dtype: KernelDType, a: &RmsNormArgs) -> Result<()> {
    if a.rows == 0 || a.cols == 0 {
        return Ok(());
    }
    let name = format!("add_rmsnorm_{}", dtype.suffix());
    let func = function(dev, Module::Rmsnorm, &name)?;
    let config = cfg(
        (grid_dim(a.rows, &name)?, 1, 1),
        row_threads(a.cols, dtype.size()),
        0,
    )?;
    let (delta, delta_stride) = a.delta.unwrap_or((0, 0));
    let (resid, resid_stride) = a.resid.unwrap_or((0, 0));
    launch!(
        dev,
        func,
        name,
        config,
        [
            a.x,
            to_i64(a.x_stride, "x stride")?,
            delta,
            to_i64(delta_stride, "delta stride")?,
            a.w,
            resid,
            to_i64(resid_stride, "resid stride")?,
            a.normed,
            to_i64(a.normed_stride, "normed stride")?,
            to_i32(a.rows, "rows")?,
            to_i32(a.cols, "cols")?,
            a.eps,
        ]
    );
    Ok(())
}

// --------------------------------------------------------------------------------- rope.cu

/// `rope_*`: see kernels/rope.cu. Rotates `x[t * row_stride + h * head_stride + rot_offset + d]`
/// in place for d < rot_dim; `cos`, `sin` are `[tokens, rot_dim / 2]` f32, contiguous.
#[derive(Clone, Copy, Debug)]
pub struct RopeArgs {
    pub x: DevPtr,
    pub row_stride: usize,
    pub tokens: usize,
    pub heads: usize,
    pub head_stride: usize,
    pub rot_offset: usize,
    pub rot_dim: usize,
    pub cos: DevPtr,
    pub sin: DevPtr,
    pub interleaved: bool,
}

/// Warps (one (token, head) each) per rope block.
const ROPE_WARPS: usize = 4;
/// Threads per block of `rope_half_vec_*`.
const ROPE_VEC_THREADS: usize = 256;

/// Which rope kernel ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeKernel {
    /// `rope_*`: one warp per (token, head), any layout.
    Warp,
    /// `rope_half_vec_*`: 16-byte vectors, rotate-half with aligned rows.
    HalfVec,
}

/// The kernel [`rope`] takes: [`RopeKernel::HalfVec`] for rotate-half when every row and head
/// start is 16-byte aligned and `rot_dim / 2` is a multiple of the vector width and of 4 (the
/// float4 reads of the tables), [`RopeKernel::Warp`] otherwise.
pub fn rope_kernel(dtype: KernelDType, a: &RopeArgs) -> RopeKernel {
    let (size, half) = (dtype.size(), a.rot_dim / 2);
    let vec = 16 / size;
    let aligned = a.x.is_multiple_of(16)
        && [a.row_stride, a.head_stride, a.rot_offset, half]
            .iter()
            .all(|n| (n * size).is_multiple_of(16))
        && a.cos.is_multiple_of(16)
        && a.sin.is_multiple_of(16);
    if !a.interleaved && aligned && half.is_multiple_of(vec) && half.is_multiple_of(4) {
        RopeKernel::HalfVec
    } else {
        RopeKernel::Warp
    }
}

/// Rotates in place with the kernel [`rope_kernel`] picks, and says which one ran.
pub fn rope(dev: &CudaDevice, dtype: KernelDType, a: &RopeArgs) -> Result<RopeKernel> {
    if a.rot_dim == 0 || !a.rot_dim.is_multiple_of(2) || a.rot_dim > 2048 {
        candle_core::bail!("rope: rot_dim {} must be even and in 2..=2048", a.rot_dim);
    }
    let items = a
        .tokens
        .checked_mul(a.heads)
        .ok_or_else(|| candle_core::Error::Msg("rope: tokens * heads overflows".into()))?;
    let kernel = rope_kernel(dtype, a);
    if items == 0 {
        return Ok(kernel);
    }
    let (name, config) = match kernel {
        RopeKernel::Warp => {
            let name = format!("rope_{}", dtype.suffix());
            let config = cfg(
                (grid_dim(items.div_ceil(ROPE_WARPS), &name)?, 1, 1),
                (ROPE_WARPS * 32) as u32,
                ROPE_WARPS * a.rot_dim * 4,
            )?;
            (name, config)
        }
        RopeKernel::HalfVec => {
            let name = format!("rope_half_vec_{}", dtype.suffix());
            let threads = items
                .checked_mul(a.rot_dim / 2 / (16 / dtype.size()))
                .ok_or_else(|| candle_core::Error::Msg("rope: thread count overflows".into()))?;
            let config = cfg(
                (grid_dim(threads.div_ceil(ROPE_VEC_THREADS), &name)?, 1, 1),
                ROPE_VEC_THREADS as u32,
                0,
            )?;
            (name, config)
        }
    };
    let func = function(dev, Module::Rope, &name)?;
    let common = (
        a.x,
        to_i64(a.row_stride, "row stride")?,
        to_i32(a.tokens, "tokens")?,
        to_i32(a.heads, "heads")?,
        to_i64(a.head_stride, "head stride")?,
        to_i32(a.rot_offset, "rot_offset")?,
        to_i32(a.rot_dim, "rot_dim")?,
    );
    match kernel {
        RopeKernel::Warp => launch!(
            dev,
            func,
            name,
            config,
            [
                common.0,
                common.1,
                common.2,
                common.3,
                common.4,
                common.5,
                common.6,
                a.cos,
                a.sin,
                i32::from(a.interleaved),
            ]
        ),
        RopeKernel::HalfVec => launch!(
            dev,
            func,
            name,
            config,
            [
                common.0, common.1, common.2, common.3, common.4, common.5, common.6, a.cos, a.sin,
            ]
        ),
    }
    Ok(kernel)
}

// ---------------------------------------------------------------------------- attention.cu

/// `flash_attn_*`: see kernels/attention.cu. `q` is `[tq, nh * dk]`, `k` `[tk, nkv * dk]`,
/// `v` `[tk, nkv * dv]`, `out` `[tq, nh * dv]`, each at its row stride (elements).
#[derive(Clone, Copy, Debug)]
pub struct FlashArgs {
    pub q: DevPtr,
    pub q_stride: usize,
    pub k: DevPtr,
    pub k_stride: usize,
    pub v: DevPtr,
    pub v_stride: usize,
    pub out: DevPtr,
    pub o_stride: usize,
    pub tq: usize,
    pub tk: usize,
    pub nh: usize,
    pub nkv: usize,
    pub dk: usize,
    pub dv: usize,
    pub scale: f32,
    /// 0: no sliding window.
    pub window: usize,
}

/// One tensor-core tile configuration, as instantiated at the end of kernels/attention.cu
/// (`flash_attn_tc_{tag}_{bf16,f16}`): `mt` 16-row tiles per warp, `nw` warps, `bn` keys per
/// K/V tile, `stages` K/V tiles in shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcConfig {
    pub tag: &'static str,
    pub dk: usize,
    pub dv: usize,
    pub mt: usize,
    pub nw: usize,
    pub bn: usize,
    pub stages: usize,
}

impl TcConfig {
    /// Query rows per block.
    pub fn bm(&self) -> usize {
        16 * self.mt * self.nw
    }

    /// The Q tile plus `stages` K and V tiles, rows padded by 8 elements (see `Padded` in the
    /// .cu).
    pub fn shared_bytes(&self, elem: usize) -> usize {
        (self.bm() * (self.dk + 8) + self.stages * self.bn * (self.dk + 8 + self.dv + 8)) * elem
    }
}

const fn tc(
    tag: &'static str,
    (dk, dv): (usize, usize),
    mt: usize,
    nw: usize,
    bn: usize,
    stages: usize,
) -> TcConfig {
    TcConfig {
        tag,
        dk,
        dv,
        mt,
        nw,
        bn,
        stages,
    }
}

/// Every tensor-core entry point; the first one matching (dk, dv) is the default, chosen by
/// measurement on the H200 (BENCHMARKS.md, `device_throughput`, 2026-12-01): d128 `c64`
/// 252 / 326 / 366 TFLOP/s at T = 2048 / 4096 / 8192 against the first tile's 198 / 244 / 267;
/// d192 (MLA) `lean` 304 / 344 / 328 against 202 / 214 / 211. The `_lean`, `_n64`, `_c64`, `_s3`,
/// `_w8pipe`, `_w8m1` tiles are flash_tc2 (kernels/README.md has each one's design, registers
/// and expected rate); the others are the first kernel, kept for comparison and tests. ptxas
/// (sm_90), registers: d64_v64 222, d128_v128 250, d128_v128_m1 166, d192_v128 178; d128 lean
/// 242, n64 241, c64 255, s3 242, w8pipe 192, w8m1 128; d192 lean 244, lean_m1 174, w8m1 128;
/// no stack frame, no spills.
pub const TC_CONFIGS: &[TcConfig] = &[
    tc("d64_v64", (64, 64), 2, 4, 64, 2),
    // flash_tc2 (BC, the keys per compute chunk, and PIPE live only in the .cu instantiation).
    tc("d128_v128_c64", (128, 128), 2, 4, 64, 2),
    tc("d192_v128_lean", (192, 128), 2, 4, 32, 2),
    tc("d128_v128_lean", (128, 128), 2, 4, 32, 2),
    tc("d128_v128_n64", (128, 128), 2, 4, 64, 2),
    tc("d128_v128_s3", (128, 128), 2, 4, 32, 3),
    tc("d128_v128_w8pipe", (128, 128), 1, 8, 32, 4),
    tc("d128_v128_w8m1", (128, 128), 1, 8, 64, 2),
    tc("d192_v128_lean_m1", (192, 128), 1, 4, 64, 2),
    tc("d192_v128_w8m1", (192, 128), 1, 8, 32, 2),
    // The first kernel.
    tc("d128_v128", (128, 128), 2, 4, 32, 2),
    tc("d128_v128_m1", (128, 128), 1, 4, 64, 2),
    tc("d192_v128", (192, 128), 1, 4, 64, 2),
];

/// Which attention kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashPath {
    Generic,
    TensorCore(TcConfig),
    /// kernels/attention_sm90.cu: wgmma and TMA, sm_90 devices only.
    Hopper(WgConfig),
}

/// One Hopper kernel, as instantiated at the end of kernels/attention_sm90.cu
/// (`flash_attn_wg_{tag}_{bf16,f16}`): blocks of [`WgConfig::BM`] query rows, key tiles of
/// [`WgConfig::BN`], `stages` K/V tiles in shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WgConfig {
    pub tag: &'static str,
    pub dk: usize,
    pub dv: usize,
    pub stages: usize,
}

impl WgConfig {
    /// Query rows per block (two consumer warpgroups of 64).
    pub const BM: usize = 128;
    /// Keys per K/V tile.
    pub const BN: usize = 128;
    /// Threads per block: a producer warpgroup and two consumers.
    pub const THREADS: usize = 384;

    /// The Q tile, `stages` K and V tiles (2-byte elements) and 1 KiB to align them to the
    /// 128-byte swizzle's 1024-byte pattern (`Smem::TOTAL` in the .cu).
    pub fn shared_bytes(&self) -> usize {
        Self::BM * self.dk * 2 + self.stages * (self.dk + self.dv) * Self::BN * 2 + 1024
    }
}

/// Every Hopper entry point; the one matching (dk, dv) is the default on an sm_90 device.
pub const WG_CONFIGS: &[WgConfig] = &[
    WgConfig {
        tag: "wg_d128",
        dk: 128,
        dv: 128,
        stages: 2,
    },
    WgConfig {
        tag: "wg_d192",
        dk: 192,
        dv: 128,
        stages: 2,
    },
];

/// Set by [`prefer_mma_attention`].
static MMA_ATTENTION: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes [`flash_path`] take the mma.sync kernels on every device (the GPU bench times both
/// in one process); `EAGLE_CHECK_ATTENTION=mma` does the same for a whole run.
pub fn prefer_mma_attention(on: bool) {
    MMA_ATTENTION.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the device runs sm_90a code (the Hopper kernels' PTX targets exactly that), unless
/// the mma.sync kernels are preferred ([`prefer_mma_attention`], `EAGLE_CHECK_ATTENTION=mma`).
pub fn hopper(dev: &CudaDevice) -> bool {
    if MMA_ATTENTION.load(std::sync::atomic::Ordering::Relaxed)
        || std::env::var("EAGLE_CHECK_ATTENTION").is_ok_and(|v| v == "mma")
    {
        return false;
    }
    hopper_device(dev)
}

/// Whether the device is sm_90 (what the `*_sm90.cu` kernels' compute_90a PTX loads on).
pub fn hopper_device(dev: &CudaDevice) -> bool {
    dev.cuda_stream()
        .context()
        .compute_capability()
        .is_ok_and(|cc| cc == (9, 0))
}

/// Set by [`prefer_grouped_experts`].
static GROUPED_EXPERTS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes [`hopper_experts`] say no on every device, so the routed experts run as cuBLAS
/// grouped GEMMs (the GPU bench times both in one process); `EAGLE_CHECK_MOE=cublas` does the
/// same for a whole run.
pub fn prefer_grouped_experts(on: bool) {
    GROUPED_EXPERTS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether the routed experts run on kernels/moe_gemm_sm90.cu: an sm_90 device, unless the
/// grouped cuBLAS path is preferred ([`prefer_grouped_experts`], `EAGLE_CHECK_MOE=cublas`).
pub fn hopper_experts(dev: &CudaDevice) -> bool {
    !(GROUPED_EXPERTS.load(std::sync::atomic::Ordering::Relaxed)
        || std::env::var("EAGLE_CHECK_MOE").is_ok_and(|v| v == "cublas"))
        && hopper_device(dev)
}

/// The generic path's limit on dk and dv (kernels/attention.cu `GEN_MAX_D`).
pub const GENERIC_MAX_HEAD_DIM: usize = 256;
const GENERIC_WARPS: usize = 4;

/// The path [`flash_attn`] takes: the Hopper kernel on an sm_90 device, else the mma.sync
/// tensor-core kernel, for bf16/f16 with a configured (dk, dv) and 16-byte aligned rows; the
/// generic kernel otherwise.
pub fn flash_path(dev: &CudaDevice, dtype: KernelDType, a: &FlashArgs) -> FlashPath {
    if dtype == KernelDType::F32 || !rows_aligned(a) {
        return FlashPath::Generic;
    }
    if let Some(c) = WG_CONFIGS.iter().find(|c| c.dk == a.dk && c.dv == a.dv)
        && hopper(dev)
    {
        return FlashPath::Hopper(*c);
    }
    match TC_CONFIGS.iter().find(|c| c.dk == a.dk && c.dv == a.dv) {
        Some(c) => FlashPath::TensorCore(*c),
        None => FlashPath::Generic,
    }
}

/// Every pointer and row of q, k, v and out 16-byte aligned (in 2-byte elements): what the
/// tensor-core and Hopper kernels' 16-byte copies need.
fn rows_aligned(a: &FlashArgs) -> bool {
    [a.q, a.k, a.v, a.out].iter().all(|p| p.is_multiple_of(16))
        && [a.q_stride, a.k_stride, a.v_stride, a.o_stride]
            .iter()
            .all(|s| s.is_multiple_of(8))
}

fn check_flash(a: &FlashArgs) -> Result<()> {
    if a.nkv == 0 || !a.nh.is_multiple_of(a.nkv) {
        candle_core::bail!("attention: {} query heads in {} KV groups", a.nh, a.nkv);
    }
    if a.tq > a.tk {
        candle_core::bail!("attention: {} queries but only {} keys", a.tq, a.tk);
    }
    if !(a.scale > 0.0 && a.scale.is_finite()) {
        candle_core::bail!("attention: softmax scale {} must be positive", a.scale);
    }
    Ok(())
}

/// Runs attention on the default path ([`flash_path`]) and says which one ran.
pub fn flash_attn(dev: &CudaDevice, dtype: KernelDType, a: &FlashArgs) -> Result<FlashPath> {
    let path = flash_path(dev, dtype, a);
    flash_attn_on(dev, dtype, a, path)?;
    Ok(path)
}

/// Runs attention on a chosen path (tests and benchmarks compare the paths).
pub fn flash_attn_on(
    dev: &CudaDevice,
    dtype: KernelDType,
    a: &FlashArgs,
    path: FlashPath,
) -> Result<()> {
    flash_attn_sinks_on(dev, dtype, a, None, path)
}

/// [`flash_attn_on`] with gpt-oss's attention sinks: `sinks` `[nh]` f32 on the device (one
/// logit per query head in every row's softmax denominator; kernels/attention.cu), or `None`.
/// Every path takes them.
pub fn flash_attn_sinks_on(
    dev: &CudaDevice,
    dtype: KernelDType,
    a: &FlashArgs,
    sinks: Option<DevPtr>,
    path: FlashPath,
) -> Result<()> {
    check_flash(a)?;
    // The kernels read a null pointer as "no sinks".
    let sinks: DevPtr = sinks.unwrap_or(0);
    if a.tq == 0 || a.nh == 0 {
        return Ok(());
    }
    let common = |name: &str| -> Result<[i32; 4]> {
        Ok([
            to_i32(a.tq, name)?,
            to_i32(a.tk, name)?,
            to_i32(a.nh, name)?,
            to_i32(a.nkv, name)?,
        ])
    };
    match path {
        FlashPath::Generic => {
            if a.dk > GENERIC_MAX_HEAD_DIM || a.dv > GENERIC_MAX_HEAD_DIM {
                candle_core::bail!(
                    "attention: head dims dk {} dv {} exceed {GENERIC_MAX_HEAD_DIM}",
                    a.dk,
                    a.dv
                );
            }
            let name = format!("flash_attn_generic_{}", dtype.suffix());
            let func = function(dev, Module::Attention, &name)?;
            let items = a
                .tq
                .checked_mul(a.nh)
                .ok_or_else(|| candle_core::Error::Msg("attention: tq * nh overflows".into()))?;
            let config = cfg(
                (grid_dim(items.div_ceil(GENERIC_WARPS), &name)?, 1, 1),
                (GENERIC_WARPS * 32) as u32,
                0,
            )?;
            let [tq, tk, nh, nkv] = common(&name)?;
            launch!(
                dev,
                func,
                name,
                config,
                [
                    a.q,
                    to_i64(a.q_stride, "q stride")?,
                    a.k,
                    to_i64(a.k_stride, "k stride")?,
                    a.v,
                    to_i64(a.v_stride, "v stride")?,
                    a.out,
                    to_i64(a.o_stride, "out stride")?,
                    tq,
                    tk,
                    nh,
                    nkv,
                    to_i32(a.dk, "dk")?,
                    to_i32(a.dv, "dv")?,
                    a.scale,
                    to_i32(a.window, "window")?,
                    sinks,
                ]
            );
        }
        FlashPath::TensorCore(c) => {
            if dtype == KernelDType::F32 || (c.dk, c.dv) != (a.dk, a.dv) {
                candle_core::bail!(
                    "attention: tile {} cannot run {dtype:?} with dk {} dv {}",
                    c.tag,
                    a.dk,
                    a.dv
                );
            }
            if !rows_aligned(a) {
                candle_core::bail!("attention: tile {} needs 16-byte aligned rows", c.tag);
            }
            let name = format!("flash_attn_tc_{}_{}", c.tag, dtype.suffix());
            let func = function(dev, Module::Attention, &name)?;
            let smem = c.shared_bytes(dtype.size());
            allow_shared_memory(&func, smem, &name)?;
            let config = cfg(
                (
                    grid_dim(a.nh, &name)?,
                    grid_dim_yz(a.tq.div_ceil(c.bm()), &name)?,
                    1,
                ),
                (c.nw * 32) as u32,
                smem,
            )?;
            let [tq, tk, nh, nkv] = common(&name)?;
            launch!(
                dev,
                func,
                name,
                config,
                [
                    a.q,
                    to_i64(a.q_stride, "q stride")?,
                    a.k,
                    to_i64(a.k_stride, "k stride")?,
                    a.v,
                    to_i64(a.v_stride, "v stride")?,
                    a.out,
                    to_i64(a.o_stride, "out stride")?,
                    tq,
                    tk,
                    nh,
                    nkv,
                    a.scale,
                    to_i32(a.window, "window")?,
                    sinks,
                ]
            );
        }
        FlashPath::Hopper(c) => {
            if dtype == KernelDType::F32 || (c.dk, c.dv) != (a.dk, a.dv) {
                candle_core::bail!(
                    "attention: kernel {} cannot run {dtype:?} with dk {} dv {}",
                    c.tag,
                    a.dk,
                    a.dv
                );
            }
            if !hopper(dev) {
                candle_core::bail!("attention: kernel {} needs an sm_90 device", c.tag);
            }
            if !rows_aligned(a) {
                candle_core::bail!("attention: kernel {} needs 16-byte aligned rows", c.tag);
            }
            let name = format!("flash_attn_{}_{}", c.tag, dtype.suffix());
            let func = function(dev, Module::AttentionSm90, &name)?;
            let smem = c.shared_bytes();
            allow_shared_memory(&func, smem, &name)?;
            let config = cfg(
                (
                    grid_dim(a.nh, &name)?,
                    grid_dim_yz(a.tq.div_ceil(WgConfig::BM), &name)?,
                    1,
                ),
                WgConfig::THREADS as u32,
                smem,
            )?;
            let box_rows = (WgConfig::BM / 2, WgConfig::BN);
            let q_map = tensor_map(dtype, a.q, a.nh * a.dk, a.tq, a.q_stride, box_rows.0)?;
            let k_map = tensor_map(dtype, a.k, a.nkv * a.dk, a.tk, a.k_stride, box_rows.1)?;
            let v_map = tensor_map(dtype, a.v, a.nkv * a.dv, a.tk, a.v_stride, box_rows.1)?;
            let [tq, tk, nh, nkv] = common(&name)?;
            launch!(
                dev,
                func,
                name,
                config,
                [
                    q_map,
                    k_map,
                    v_map,
                    a.out,
                    to_i64(a.o_stride, "out stride")?,
                    tq,
                    tk,
                    nh,
                    nkv,
                    a.scale,
                    to_i32(a.window, "window")?,
                    sinks,
                ]
            );
        }
    }
    Ok(())
}

/// A TMA tensor map (`CUtensorMap`), passed by value to the Hopper kernels.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub struct TensorMap(cudarc::driver::sys::CUtensorMap);

// SAFETY: a plain 128-byte, 128-aligned value that the kernel takes by value
// (`const __grid_constant__ CUtensorMap`); the launch copies it from this address.
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

/// The map of a `[rows, cols]` matrix of `dtype` at `base` (row stride `stride` elements) that
/// the Hopper kernels read in boxes of 64 columns (128 bytes) x `box_rows` rows with the 128-byte
/// swizzle; reads outside the matrix fill zeros.
pub fn tensor_map(
    dtype: KernelDType,
    base: DevPtr,
    cols: usize,
    rows: usize,
    stride: usize,
    box_rows: usize,
) -> Result<TensorMap> {
    use cudarc::driver::sys;
    let data_type = match dtype {
        KernelDType::BF16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        KernelDType::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        KernelDType::F32 => candle_core::bail!("tensor map: the Hopper kernels take bf16 or f16"),
    };
    let row_bytes = stride
        .checked_mul(dtype.size())
        .filter(|b| b.is_multiple_of(16) && *b < 1 << 40)
        .ok_or_else(|| {
            candle_core::Error::Msg(format!("tensor map: row stride {stride} elements"))
        })?;
    if !base.is_multiple_of(16) || cols == 0 || rows == 0 || cols > stride {
        candle_core::bail!(
            "tensor map: base {base:#x}, {rows} x {cols} at stride {stride} is not a TMA matrix"
        );
    }
    if !(1..=256).contains(&box_rows) {
        candle_core::bail!("tensor map: a box of {box_rows} rows (TMA takes 1..=256)");
    }
    let dims = [cols as u64, rows as u64];
    let strides = [row_bytes as u64];
    let boxes = [64u32, box_rows as u32];
    let element_strides = [1u32, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every array has the rank's length (2, and 1 stride); the driver only encodes the
    // map (no device access) and checks the values it is given.
    let status = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            data_type,
            2,
            base as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    status.result().map_err(|e| {
        candle_core::Error::Msg(format!(
            "tensor map of {rows} x {cols} (stride {stride}, box {box_rows}): {e:?}"
        ))
    })?;
    // SAFETY: cuTensorMapEncodeTiled succeeded, so it wrote the whole map.
    Ok(TensorMap(unsafe { map.assume_init() }))
}

/// `wg_tile_check_bf16` (kernels/attention_sm90.cu, for the device test): `s_out[64, 128]` =
/// `q[64, 128] k[128, 128]^T` and `o_out[64, 128]` = `p[64, 128] v[128, 128]`, f32 out, the
/// inputs bf16 and contiguous.
pub fn wg_tile_check(
    dev: &CudaDevice,
    q: DevPtr,
    k: DevPtr,
    v: DevPtr,
    p: DevPtr,
    s_out: DevPtr,
    o_out: DevPtr,
) -> Result<()> {
    let name = "wg_tile_check_bf16";
    let func = function(dev, Module::AttentionSm90, name)?;
    let smem = (2 * 64 * 128 + 4 * 128 * 128) + 1024;
    allow_shared_memory(&func, smem, name)?;
    let bf = KernelDType::BF16;
    let q_map = tensor_map(bf, q, 128, 64, 128, 64)?;
    let k_map = tensor_map(bf, k, 128, 128, 128, 128)?;
    let v_map = tensor_map(bf, v, 128, 128, 128, 128)?;
    launch!(
        dev,
        func,
        name,
        cfg((1, 1, 1), 128, smem)?,
        [q_map, k_map, v_map, p, s_out, o_out]
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

// ----------------------------------------------------------------------------- silu_mul.cu

/// `silu_mul_*`: see kernels/silu_mul.cu. Three `[rows, cols]` matrices at their row strides.
#[derive(Clone, Copy, Debug)]
pub struct SiluMulArgs {
    pub gate: DevPtr,
    pub g_stride: usize,
    pub up: DevPtr,
    pub u_stride: usize,
    pub out: DevPtr,
    pub o_stride: usize,
    pub rows: usize,
    pub cols: usize,
}

/// Which SiLU-mul kernel ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SiluKernel {
    /// `silu_mul_*`: one block per row, any layout.
    Row,
    /// `silu_mul_vec_*`: one thread per 16-byte vector over the whole matrix.
    Flat,
}

/// Threads per block of `silu_mul_vec_*`.
const SILU_VEC_THREADS: usize = 256;

/// [`SiluKernel::Flat`] when every row of the three matrices starts 16-byte aligned and `cols`
/// is a multiple of the vector width, [`SiluKernel::Row`] otherwise.
pub fn silu_kernel(dtype: KernelDType, a: &SiluMulArgs) -> SiluKernel {
    let size = dtype.size();
    let aligned = [a.gate, a.up, a.out].iter().all(|p| p.is_multiple_of(16))
        && [a.g_stride, a.u_stride, a.o_stride]
            .iter()
            .all(|s| (s * size).is_multiple_of(16));
    if aligned && a.cols.is_multiple_of(16 / size) {
        SiluKernel::Flat
    } else {
        SiluKernel::Row
    }
}

/// Runs the kernel [`silu_kernel`] picks and says which one ran.
pub fn silu_mul(dev: &CudaDevice, dtype: KernelDType, a: &SiluMulArgs) -> Result<SiluKernel> {
    let kernel = silu_kernel(dtype, a);
    if a.rows == 0 || a.cols == 0 {
        return Ok(kernel);
    }
    let (name, config) = match kernel {
        SiluKernel::Row => {
            let name = format!("silu_mul_{}", dtype.suffix());
            let config = cfg(
                (grid_dim(a.rows, &name)?, 1, 1),
                row_threads(a.cols, dtype.size()),
                0,
            )?;
            (name, config)
        }
        SiluKernel::Flat => {
            let name = format!("silu_mul_vec_{}", dtype.suffix());
            let vectors = a
                .rows
                .checked_mul(a.cols / (16 / dtype.size()))
                .ok_or_else(|| candle_core::Error::Msg("silu_mul: size overflows".into()))?;
            let config = cfg(
                (grid_dim(vectors.div_ceil(SILU_VEC_THREADS), &name)?, 1, 1),
                SILU_VEC_THREADS as u32,
                0,
            )?;
            (name, config)
        }
    };
    let func = function(dev, Module::SiluMul, &name)?;
    launch!(
        dev,
        func,
        name,
        config,
        [
            a.gate,
            to_i64(a.g_stride, "gate stride")?,
            a.up,
            to_i64(a.u_stride, "up stride")?,
            a.out,
            to_i64(a.o_stride, "out stride")?,
            to_i32(a.rows, "rows")?,
            to_i32(a.cols, "cols")?,
        ]
    );
    Ok(kernel)
}

// ------------------------------------------------------------------------------- gather.cu

/// `gather_rows_*`: see kernels/gather.cu. `src` is `[src_rows, cols]`, `idx` `[rows]` 32-bit,
/// `dst` `[rows, cols]`; an index outside `0..src_rows` gives a NaN row.
#[derive(Clone, Copy, Debug)]
pub struct GatherArgs {
    pub src: DevPtr,
    pub src_stride: usize,
    pub src_rows: usize,
    pub idx: DevPtr,
    pub dst: DevPtr,
    pub dst_stride: usize,
    pub rows: usize,
    pub cols: usize,
}

pub fn gather_rows(dev: &CudaDevice, dtype: KernelDType, a: &GatherArgs) -> Result<()> {
    if a.rows == 0 || a.cols == 0 {
        return Ok(());
    }
    let name = format!("gather_rows_{}", dtype.suffix());
    let func = function(dev, Module::Gather, &name)?;
    let config = cfg(
        (grid_dim(a.rows, &name)?, 1, 1),
        row_threads(a.cols, dtype.size()),
        0,
    )?;
    launch!(
        dev,
        func,
        name,
        config,
        [
            a.src,
            to_i64(a.src_stride, "src stride")?,
            a.idx,
            a.dst,
            to_i64(a.dst_stride, "dst stride")?,
            to_i32(a.rows, "rows")?,
            to_i32(a.cols, "cols")?,
            to_i32(a.src_rows, "src rows")?,
        ]
    );
    Ok(())
}

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

// -------------------------------------------------------------------------------- score.cu

/// `score_partials` + `score_finish`: see kernels/score.cu. `x` `[rows, x_stride]` f32 holds
/// `slots` slots of `cols`; `refs` `[n_states, ref_rows, ref_stride]` f32; `cand_state`,
/// `cand_shift` `[n_cand]` i32; writes `out` `[slots, n_cand, 3]` f64 and `rows_out`
/// `[slots, n_cand]` i32, using `workspace` (`score_workspace_len` doubles).
#[derive(Clone, Copy, Debug)]
pub struct ScoreArgs {
    pub x: DevPtr,
    pub x_stride: usize,
    pub rows: usize,
    pub cols: usize,
    pub slots: usize,
    pub refs: DevPtr,
    pub n_states: usize,
    pub ref_rows: usize,
    pub ref_stride: usize,
    pub cand_state: DevPtr,
    pub cand_shift: DevPtr,
    pub n_cand: usize,
    pub workspace: DevPtr,
    pub out: DevPtr,
    pub rows_out: DevPtr,
}

/// Captured rows per block of `score_partials`.
const SCORE_ROWS_PER_CHUNK: usize = 32;
/// Candidates per block (kernels/score.cu `SCORE_GROUP`).
const SCORE_GROUP: usize = 4;

/// Doubles of workspace [`score`] needs.
pub fn score_workspace_len(rows: usize, slots: usize, n_cand: usize) -> usize {
    slots * n_cand * rows.div_ceil(SCORE_ROWS_PER_CHUNK).max(1) * 3
}

/// Slots per block of `score_partials_vec` (kernels/score.cu `SCORE_SLOTS`).
const SCORE_SLOTS: usize = 4;
/// Threads per block of `score_partials_vec`.
const SCORE_VEC_THREADS: u32 = 128;

use crate::score::ScoreKernel;

/// Launches the scoring with `kernel`, or with `score_partials` where `Vec4` cannot read the
/// rows as float4s (a column count, stride or base not a multiple of 16 bytes). Returns the
/// kernel that ran.
pub fn score(dev: &CudaDevice, a: &ScoreArgs, kernel: ScoreKernel) -> Result<ScoreKernel> {
    if a.slots == 0 || a.n_cand == 0 {
        return Ok(kernel);
    }
    let aligned = a.cols.is_multiple_of(4)
        && a.x_stride.is_multiple_of(4)
        && a.ref_stride.is_multiple_of(4)
        && a.x.is_multiple_of(16)
        && a.refs.is_multiple_of(16);
    let kernel = match kernel {
        ScoreKernel::Vec4 if !aligned => ScoreKernel::PerSlot,
        k => k,
    };
    let chunks = a.rows.div_ceil(SCORE_ROWS_PER_CHUNK).max(1);
    let groups = a.n_cand.div_ceil(SCORE_GROUP);
    let (name, grid, threads) = match kernel {
        ScoreKernel::PerSlot => (
            "score_partials",
            (
                grid_dim(chunks, "score_partials")?,
                grid_dim_yz(a.slots, "score_partials slots")?,
                grid_dim_yz(groups, "score_partials candidates")?,
            ),
            256,
        ),
        ScoreKernel::Vec4 => (
            "score_partials_vec",
            (
                grid_dim(groups, "score_partials_vec candidates")?,
                grid_dim_yz(chunks, "score_partials_vec chunks")?,
                grid_dim_yz(a.slots.div_ceil(SCORE_SLOTS), "score_partials_vec slots")?,
            ),
            SCORE_VEC_THREADS,
        ),
    };
    let partials = function(dev, Module::Score, name)?;
    let n_cand = to_i32(a.n_cand, "candidates")?;
    let (rows, ref_rows) = (to_i32(a.rows, "rows")?, to_i32(a.ref_rows, "ref rows")?);
    launch!(
        dev,
        partials,
        name,
        cfg(grid, threads, 0)?,
        [
            a.x,
            to_i64(a.x_stride, "x stride")?,
            rows,
            to_i32(a.cols, "cols")?,
            to_i32(a.slots, "slots")?,
            a.refs,
            to_i32(a.n_states, "states")?,
            ref_rows,
            to_i64(a.ref_stride, "ref stride")?,
            a.cand_state,
            a.cand_shift,
            n_cand,
            SCORE_ROWS_PER_CHUNK as i32,
            a.workspace,
        ]
    );
    let finish = function(dev, Module::Score, "score_finish")?;
    let pairs = a.slots * a.n_cand;
    let config = cfg(
        (grid_dim(pairs.div_ceil(256), "score_finish")?, 1, 1),
        256,
        0,
    )?;
    launch!(
        dev,
        finish,
        "score_finish",
        config,
        [
            a.workspace,
            to_i32(chunks, "chunks")?,
            to_i32(a.slots, "slots")?,
            n_cand,
            rows,
            ref_rows,
            a.cand_shift,
            a.out,
            a.rows_out,
        ]
    );
    Ok(kernel)
}

// ---------------------------------------------------------------------------- expert_act.cu

/// The activation [`expert_act`] applies (the `act` argument of kernels/expert_act.cu).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ExpertActKind {
    SiluMul,
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

// -------------------------------------------------------------------------------- mxfp4.cu

/// `mxfp4_dequant_*`: see kernels/mxfp4.cu. `blocks` `[groups, 16]` bytes, `scales`
/// `[groups]` bytes, `out` `[groups, 32]`; contiguous.
#[derive(Clone, Copy, Debug)]
pub struct Mxfp4Args {
    pub blocks: DevPtr,
    pub scales: DevPtr,
    pub out: DevPtr,
    pub groups: usize,
}

pub fn mxfp4_dequant(dev: &CudaDevice, dtype: KernelDType, a: &Mxfp4Args) -> Result<()> {
    if a.groups == 0 {
        return Ok(());
    }
    let name = format!("mxfp4_dequant_{}", dtype.suffix());
    let func = function(dev, Module::Mxfp4, &name)?;
    // One thread per group, a grid-stride loop past 2^16 blocks of 256.
    let blocks = a.groups.div_ceil(256).min(1 << 16);
    let config = cfg((grid_dim(blocks, &name)?, 1, 1), 256, 0)?;
    launch!(
        dev,
        func,
        name,
        config,
        [a.blocks, a.scales, a.out, to_i64(a.groups, "groups")?]
    );
    Ok(())
}

// -------------------------------------------------------------------------- fp8_dequant.cu

/// `fp8_dequant_*`: see kernels/fp8_dequant.cu. `w` `[rows, cols]` E4M3 bytes, `scale_inv`
/// `[ceil(rows / block_rows), ceil(cols / block_cols)]` f32, `out` `[rows, cols]`; contiguous.
#[derive(Clone, Copy, Debug)]
pub struct Fp8Args {
    pub w: DevPtr,
    pub scale_inv: DevPtr,
    pub out: DevPtr,
    pub rows: usize,
    pub cols: usize,
    pub block_rows: usize,
    pub block_cols: usize,
}

pub fn fp8_dequant(dev: &CudaDevice, dtype: KernelDType, a: &Fp8Args) -> Result<()> {
    if a.block_rows == 0 || a.block_cols == 0 {
        candle_core::bail!(
            "fp8_dequant: block {}x{} must be positive",
            a.block_rows,
            a.block_cols
        );
    }
    if a.rows == 0 || a.cols == 0 {
        return Ok(());
    }
    let name = format!("fp8_dequant_{}", dtype.suffix());
    let func = function(dev, Module::Fp8, &name)?;
    let config = cfg((grid_dim(a.rows, &name)?, 1, 1), 256, 0)?;
    launch!(
        dev,
        func,
        name,
        config,
        [
            a.w,
            a.scale_inv,
            a.out,
            to_i32(a.rows, "rows")?,
            to_i32(a.cols, "cols")?,
            to_i32(a.block_rows, "block rows")?,
            to_i32(a.block_cols, "block cols")?,
        ]
    );
    Ok(())
}

/// Device `ordinal` as the runner uses it: one stream, so no cross-stream events (each costs a
/// driver call per tensor access), and freed memory kept for reuse ([`keep_freed_memory`]).
pub fn open_device(ordinal: usize) -> Result<CudaDevice> {
    use candle_core::backend::BackendDevice;
    let dev = CudaDevice::new(ordinal)?;
    // SAFETY: every tensor of a runner lives and is used on this device's one stream.
    unsafe { dev.disable_event_tracking() };
    keep_freed_memory(&dev, true)?;
    Ok(dev)
}

/// Whether the device's stream-ordered memory pool keeps the memory freed into it.
///
/// candle allocates with `cuMemAllocAsync` from the device's default pool, whose release
/// threshold is 0: at every synchronisation the pool hands its unused memory back to the
/// driver and the next allocations map it again. A capture synchronises between forwards (and
/// a MoE layer once, to read its expert counts), so each stretch after one maps its buffers
/// afresh; PyTorch's caching allocator keeps such memory. `keep` sets the threshold to its
/// maximum (the pool keeps what it reserved: at most the most memory ever in use at once, and
/// reuses it) or back to the driver's 0. Device memory sampled as `total - free` then reads
/// that reservation, which is at least the memory in use.
pub fn keep_freed_memory(dev: &CudaDevice, keep: bool) -> Result<()> {
    use cudarc::driver::{result, sys};
    let cu_device = dev.cuda_stream().context().cu_device();
    let mut threshold: u64 = if keep { u64::MAX } else { 0 };
    // SAFETY: `cu_device` belongs to a live context; the release threshold is a u64 attribute.
    unsafe {
        let pool =
            result::device::get_default_mem_pool(cu_device).map_err(candle_core::Error::wrap)?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .map_err(candle_core::Error::wrap)
    }
}

/// True when a CUDA driver and at least one device are present (asking candle for a device
/// without a driver panics, so callers check first).
pub fn device_available() -> bool {
    cudarc::driver::result::init().is_ok()
        && cudarc::driver::result::device::get_count().is_ok_and(|n| n > 0)
}

/// The device address of `t`'s first element (its layout's start offset). The address stays
/// valid while `t` lives; the caller checks that the layout is what its kernel reads.
pub fn tensor_ptr(t: &candle_core::Tensor) -> Result<DevPtr> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        candle_core::Storage::Cuda(s) => storage_ptr(s, layout.start_offset()),
        _ => candle_core::bail!(
            "expected a CUDA tensor, found one on {:?}",
            t.device().location()
        ),
    }
}

/// A tensor over a storage this module filled (contiguous, no gradient).
pub fn tensor(s: CudaStorage, shape: impl Into<candle_core::Shape>) -> candle_core::Tensor {
    candle_core::Tensor::from_storage(
        candle_core::Storage::Cuda(s),
        shape,
        candle_core::op::BackpropOp::none(),
        false,
    )
}
