//! Causal flash attention (kernels/attention.cu) with grouped KV heads, an optional sliding
//! window and optional attention sinks (gpt-oss), reading q, k and v where they lie (column
//! windows of one fused QKV output work as they are) and writing `[tq, nh * dv]`: the layout
//! `o_proj` reads.

use super::{Elem, Matrix, with_float_type};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor, WithDType};

/// The largest head dim (dk and dv) the GPU's generic flash kernel takes
/// (kernels/attention.cu `GEN_MAX_D`); the CPU reference takes any.
pub const GENERIC_MAX_HEAD_DIM: usize = 256;

/// Heads and scaling of one attention call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    /// Query heads.
    pub nh: usize,
    /// KV heads (`nh` for MHA and MLA, fewer for GQA); query head h reads KV head
    /// `h / (nh / nkv)`.
    pub nkv: usize,
    /// Query/key head dim.
    pub dk: usize,
    /// Value head dim.
    pub dv: usize,
    /// Softmax scale (`dk^-0.5`, or DeepSeek's YaRN-adjusted one).
    pub scale: f64,
    /// Mistral's sliding window: query at position p sees keys j with `p - j < window`.
    pub window: Option<usize>,
}

impl AttnParams {
    fn check(&self) -> Result<()> {
        if self.nkv == 0 || !self.nh.is_multiple_of(self.nkv) {
            candle_core::bail!(
                "attention: {} query heads in {} KV groups",
                self.nh,
                self.nkv
            );
        }
        if self.dk == 0 || self.dv == 0 {
            candle_core::bail!(
                "attention: head dims dk {} dv {} must be positive",
                self.dk,
                self.dv
            );
        }
        if !(self.scale > 0.0 && self.scale.is_finite()) {
            candle_core::bail!("attention: softmax scale {} must be positive", self.scale);
        }
        if self.window == Some(0) {
            candle_core::bail!("attention: a sliding window of 0 sees nothing");
        }
        Ok(())
    }
}

/// A row-major input: `rows` rows at `stride`.
#[derive(Clone, Copy)]
pub struct Rows<'a, T> {
    pub data: &'a [T],
    pub stride: usize,
    pub rows: usize,
}

/// The CPU reference. Query i sits at position `i + tk - tq`. Per (query, head): scores
/// `scale * q.k` in f32 (dot products summed in order), softmax with the max subtracted, the
/// weighted sum of values in f32, rounded to `T` once. Returns `[tq, nh * dv]`. Heads are
/// spread over the available cores (the device tests check T = 2048 shapes against it).
pub fn flash_attention_ref<T: Elem>(q: Rows<T>, k: Rows<T>, v: Rows<T>, p: &AttnParams) -> Vec<T> {
    flash_attention_sinks_ref(q, k, v, p, None)
}

/// [`flash_attention_ref`] with gpt-oss's attention sinks: `sinks[h]` (`[nh]`, natural-log
/// units, not multiplied by the softmax scale) joins every row of head h as one more logit
/// with no value. As transformers 5.24 models/gpt_oss/modeling_gpt_oss.py
/// `eager_attention_forward`: the sink column is concatenated to the masked scores, the row
/// max is taken over both, softmax, the sink column dropped; so a row's weights are
/// `e^(s_j - m) / (sum_i e^(s_i - m) + e^(sink - m))` with `m` the max over scores and sink.
/// A sliding window masks keys only; the sink is in every row.
pub fn flash_attention_sinks_ref<T: Elem>(
    q: Rows<T>,
    k: Rows<T>,
    v: Rows<T>,
    p: &AttnParams,
    sinks: Option<&[f32]>,
) -> Vec<T> {
    let (tq, tk) = (q.rows, k.rows);
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(p.nh.max(1));
    let per_thread = p.nh.div_ceil(threads.max(1)).max(1);
    let heads: Vec<Vec<(usize, Vec<f32>)>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..p.nh)
            .step_by(per_thread)
            .map(|h0| {
                s.spawn(move || {
                    (h0..(h0 + per_thread).min(p.nh))
                        .map(|h| {
                            let sink = sinks.map(|s| s[h]);
                            (h, attend_head(q, k, v, p, h, sink, tq, tk))
                        })
                        .collect()
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("attention worker"))
            .collect()
    });
    let mut out = vec![T::from_f32(0.0); tq * p.nh * p.dv];
    for (h, o) in heads.into_iter().flatten() {
        for i in 0..tq {
            for d in 0..p.dv {
                out[i * p.nh * p.dv + h * p.dv + d] = T::from_f32(o[i * p.dv + d]);
            }
        }
    }
    out
}

/// One head's `[tq, dv]` output in f32; `sink`: the head's sink logit.
#[allow(clippy::too_many_arguments)]
fn attend_head<T: Elem>(
    q: Rows<T>,
    k: Rows<T>,
    v: Rows<T>,
    p: &AttnParams,
    h: usize,
    sink: Option<f32>,
    tq: usize,
    tk: usize,
) -> Vec<f32> {
    let g = h / (p.nh / p.nkv);
    let scale = p.scale as f32;
    let mut out = vec![0f32; tq * p.dv];
    let mut scores = Vec::with_capacity(tk);
    for i in 0..tq {
        let pos = i + tk - tq;
        let lo = p.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let qi = &q.data[i * q.stride + h * p.dk..][..p.dk];
        scores.clear();
        for j in lo..=pos {
            let kj = &k.data[j * k.stride + g * p.dk..][..p.dk];
            let dot: f32 = qi
                .iter()
                .zip(kj)
                .map(|(a, b)| a.to_f32() * b.to_f32())
                .sum();
            scores.push(dot * scale);
        }
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let max = sink.map_or(max, |s| max.max(s));
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        if let Some(s) = sink {
            sum += (s - max).exp();
        }
        let o = &mut out[i * p.dv..][..p.dv];
        for (j, &w) in (lo..=pos).zip(&scores) {
            let vj = &v.data[j * v.stride + g * p.dv..][..p.dv];
            for (od, vd) in o.iter_mut().zip(vj) {
                *od += w * vd.to_f32();
            }
        }
        o.iter_mut().for_each(|od| *od /= sum);
    }
    out
}

/// The rows of a CPU storage that `m` names.
fn cpu_rows<'a, T: WithDType>(s: &'a CpuStorage, m: &Matrix, what: &str) -> Result<Rows<'a, T>> {
    Ok(Rows {
        data: m.slice(s.as_slice::<T>()?, what)?,
        stride: m.stride,
        rows: m.rows,
    })
}

/// q, k, v checked against the params.
fn shapes(p: &AttnParams, ql: &Layout, kl: &Layout, vl: &Layout) -> Result<[Matrix; 3]> {
    p.check()?;
    let q = Matrix::with_cols(ql, p.nh * p.dk, "attention q")?;
    let k = Matrix::with_cols(kl, p.nkv * p.dk, "attention k")?;
    let v = Matrix::with_cols(vl, p.nkv * p.dv, "attention v")?;
    if k.rows != v.rows {
        candle_core::bail!("attention: {} keys but {} values", k.rows, v.rows);
    }
    if q.rows > k.rows {
        candle_core::bail!("attention: {} queries but only {} keys", q.rows, k.rows);
    }
    Ok([q, k, v])
}

struct FlashAttention {
    p: AttnParams,
    /// `[nh]` f32, contiguous, on the inputs' device.
    sinks: Option<Tensor>,
    /// A tensor-core tile by tag, or "generic", instead of the default choice (tests, benches).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    path: Option<&'static str>,
}

impl CustomOp3 for FlashAttention {
    fn name(&self) -> &'static str {
        "flash-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let [qm, km, vm] = shapes(&self.p, ql, kl, vl)?;
        let sinks = self
            .sinks
            .as_ref()
            .map(Tensor::to_vec1::<f32>)
            .transpose()?;
        with_float_type!(q.dtype(), T => {
            let out = flash_attention_sinks_ref(
                cpu_rows::<T>(q, &qm, "q")?,
                cpu_rows::<T>(k, &km, "k")?,
                cpu_rows::<T>(v, &vm, "v")?,
                &self.p,
                sinks.as_deref(),
            );
            Ok((T::to_cpu_storage_owned(out), Shape::from((qm.rows, self.p.nh * self.p.dv))))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        q: &candle_core::CudaStorage,
        ql: &Layout,
        k: &candle_core::CudaStorage,
        kl: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::{self, storage_ptr};
        use launch::{FlashPath, TC_CONFIGS, WG_CONFIGS};
        let [qm, km, vm] = shapes(&self.p, ql, kl, vl)?;
        let p = &self.p;
        let dtype = q.dtype();
        let kd = super::KernelDType::of(dtype)?;
        let out = cuda::alloc(&q.device, dtype, qm.rows * p.nh * p.dv)?;
        let args = launch::FlashArgs {
            q: storage_ptr(q, qm.offset)?,
            q_stride: qm.stride,
            k: storage_ptr(k, km.offset)?,
            k_stride: km.stride,
            v: storage_ptr(v, vm.offset)?,
            v_stride: vm.stride,
            out: storage_ptr(&out, 0)?,
            o_stride: p.nh * p.dv,
            tq: qm.rows,
            tk: km.rows,
            nh: p.nh,
            nkv: p.nkv,
            dk: p.dk,
            dv: p.dv,
            scale: p.scale as f32,
            window: p.window.unwrap_or(0),
        };
        let path = match self.path {
            None => launch::flash_path(&q.device, kd, &args),
            Some("generic") => FlashPath::Generic,
            Some(tag) => match TC_CONFIGS.iter().find(|c| c.tag == tag) {
                Some(c) => FlashPath::TensorCore(*c),
                None => {
                    FlashPath::Hopper(*WG_CONFIGS.iter().find(|c| c.tag == tag).ok_or_else(
                        || candle_core::Error::Msg(format!("no attention tile {tag}")),
                    )?)
                }
            },
        };
        let sinks = self.sinks.as_ref().map(cuda::tensor_ptr).transpose()?;
        launch::flash_attn_sinks_on(&q.device, kd, &args, sinks, path)?;
        Ok((out, Shape::from((qm.rows, p.nh * p.dv))))
    }
}

/// Causal attention of `q`: `[tq, nh * dk]` over `k`: `[tk, nkv * dk]`, `v`: `[tk, nkv * dv]`
/// (one dtype, any row strides, `tq <= tk`: the queries are the last `tq` positions). Returns
/// `[tq, nh * dv]`. Never materialises the `tq x tk` scores.
pub fn flash_attention(q: &Tensor, k: &Tensor, v: &Tensor, p: &AttnParams) -> Result<Tensor> {
    flash_attention_on(q, k, v, p, None)
}

/// [`flash_attention`] with gpt-oss's attention sinks: `sinks` `[nh]` (any float dtype, read
/// as f32; on `q`'s device), one logit per query head that joins every softmax row's
/// denominator and has no value ([`flash_attention_sinks_ref`]). `None` is [`flash_attention`].
/// Works with a sliding window (gpt-oss alternates windowed and full layers) on every path.
/// Sinks already f32 and contiguous are used as they are (no cast op per call).
pub fn flash_attention_with_sinks(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttnParams,
    sinks: Option<&Tensor>,
) -> Result<Tensor> {
    flash_attention_sinks_on(q, k, v, p, sinks, None)
}

/// [`flash_attention`] on a chosen kernel (a tensor-core tile tag from `launch::TC_CONFIGS`, a
/// Hopper kernel's from `launch::WG_CONFIGS`, or "generic"); the CPU ignores the choice.
pub fn flash_attention_on(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttnParams,
    path: Option<&'static str>,
) -> Result<Tensor> {
    flash_attention_sinks_on(q, k, v, p, None, path)
}

/// [`flash_attention_with_sinks`] on a chosen kernel, as [`flash_attention_on`].
pub fn flash_attention_sinks_on(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    p: &AttnParams,
    sinks: Option<&Tensor>,
    path: Option<&'static str>,
) -> Result<Tensor> {
    let sinks = sinks
        .map(|s| -> Result<Tensor> {
            if s.dims() != [p.nh] {
                candle_core::bail!(
                    "attention: sinks {:?}, expected one per query head [{}]",
                    s.dims(),
                    p.nh
                );
            }
            if !s.device().same_device(q.device()) {
                candle_core::bail!(
                    "attention: sinks on {:?}, q on {:?}",
                    s.device().location(),
                    q.device().location()
                );
            }
            super::to_dtype(s, candle_core::DType::F32)?.contiguous()
        })
        .transpose()?;
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
        candle_core::bail!(
            "attention: mixed dtypes q {:?} k {:?} v {:?}",
            q.dtype(),
            k.dtype(),
            v.dtype()
        );
    }
    q.apply_op3_no_bwd(k, v, &FlashAttention { p: *p, sinks, path })
}

/// The attention kernels (kernels/attention.cu, kernels/attention_sm90.cu) launched from raw
/// device pointers: their tile tables, the choice between them ([`launch::flash_path`]), their
/// arguments and the launches on the device's stream. The candle op above calls them, and so
/// does the runner's forward (`model::fast`).
#[cfg(feature = "cuda")]
pub mod launch {
    use crate::kernels::cuda::{
        DevPtr, Module, TensorMap, allow_shared_memory, cfg, function, grid_dim, grid_dim_yz,
        launch, tensor_map,
    };
    use crate::kernels::dispatch::hopper;
    use crate::kernels::{KernelDType, to_i32, to_i64};
    use candle_core::Result;
    use candle_core::cuda_backend::CudaDevice;
    use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};

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

    pub use super::GENERIC_MAX_HEAD_DIM;
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
    /// Every path takes them. In three steps: the path is checked against the arguments
    /// (`check_path`), its entry point and launch shape chosen (`flash_entry`), and the one
    /// launch made with the path's q, k and v (`flash_inputs`, `launch_flash`).
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
        check_path(dev, dtype, a, path)?;
        let entry = flash_entry(dtype, a, path)?;
        let func = function(dev, entry.module, &entry.name)?;
        allow_shared_memory(&func, entry.smem, &entry.name)?;
        let config = cfg(
            (
                grid_dim(entry.blocks.0, &entry.name)?,
                grid_dim_yz(entry.blocks.1, &entry.name)?,
                1,
            ),
            entry.threads as u32,
            entry.smem,
        )?;
        let inputs = flash_inputs(dtype, a, path)?;
        let head_dims = path == FlashPath::Generic;
        launch_flash(
            dev,
            &func,
            &entry.name,
            config,
            a,
            &inputs,
            head_dims,
            sinks,
        )
    }

    /// Refuses a path that cannot run these arguments: head dims past the generic kernel's, a
    /// tile or Hopper kernel for other head dims or for f32, the Hopper kernel off an sm_90
    /// device (or with the mma.sync kernels preferred), rows not 16-byte aligned.
    fn check_path(
        dev: &CudaDevice,
        dtype: KernelDType,
        a: &FlashArgs,
        path: FlashPath,
    ) -> Result<()> {
        let (what, tag, dims) = match path {
            FlashPath::Generic => {
                if a.dk > GENERIC_MAX_HEAD_DIM || a.dv > GENERIC_MAX_HEAD_DIM {
                    candle_core::bail!(
                        "attention: head dims dk {} dv {} exceed {GENERIC_MAX_HEAD_DIM}",
                        a.dk,
                        a.dv
                    );
                }
                return Ok(());
            }
            FlashPath::TensorCore(c) => ("tile", c.tag, (c.dk, c.dv)),
            FlashPath::Hopper(c) => ("kernel", c.tag, (c.dk, c.dv)),
        };
        if dtype == KernelDType::F32 || dims != (a.dk, a.dv) {
            candle_core::bail!(
                "attention: {what} {tag} cannot run {dtype:?} with dk {} dv {}",
                a.dk,
                a.dv
            );
        }
        if matches!(path, FlashPath::Hopper(_)) && !hopper(dev) {
            candle_core::bail!("attention: kernel {tag} needs an sm_90 device");
        }
        if !rows_aligned(a) {
            candle_core::bail!("attention: {what} {tag} needs 16-byte aligned rows");
        }
        Ok(())
    }

    /// The entry point a path launches and its launch shape.
    struct FlashEntry {
        name: String,
        module: Module,
        /// Grid (x, y).
        blocks: (usize, usize),
        threads: usize,
        /// Dynamic shared memory, bytes.
        smem: usize,
    }

    /// The generic kernel: one warp per (query row, head), [`GENERIC_WARPS`] a block. A
    /// tensor-core tile or the Hopper kernel: a block per (head, `BM` query rows) with the
    /// tile's shared memory.
    fn flash_entry(dtype: KernelDType, a: &FlashArgs, path: FlashPath) -> Result<FlashEntry> {
        let suffix = dtype.suffix();
        Ok(match path {
            FlashPath::Generic => {
                let items = a.tq.checked_mul(a.nh).ok_or_else(|| {
                    candle_core::Error::Msg("attention: tq * nh overflows".into())
                })?;
                FlashEntry {
                    name: format!("flash_attn_generic_{suffix}"),
                    module: Module::Attention,
                    blocks: (items.div_ceil(GENERIC_WARPS), 1),
                    threads: GENERIC_WARPS * 32,
                    smem: 0,
                }
            }
            FlashPath::TensorCore(c) => FlashEntry {
                name: format!("flash_attn_tc_{}_{suffix}", c.tag),
                module: Module::Attention,
                blocks: (a.nh, a.tq.div_ceil(c.bm())),
                threads: c.nw * 32,
                smem: c.shared_bytes(dtype.size()),
            },
            FlashPath::Hopper(c) => FlashEntry {
                name: format!("flash_attn_{}_{suffix}", c.tag),
                module: Module::AttentionSm90,
                blocks: (a.nh, a.tq.div_ceil(WgConfig::BM)),
                threads: WgConfig::THREADS,
                smem: c.shared_bytes(),
            },
        })
    }

    /// How an entry point reads q, k and v: at their pointers with their row strides (the
    /// generic and tensor-core kernels), or through TMA maps (the Hopper kernel). One lives on
    /// the stack for one launch, so the maps' 384 bytes are not boxed.
    #[allow(clippy::large_enum_variant)]
    enum FlashInputs {
        Rows([(DevPtr, i64); 3]),
        Maps([TensorMap; 3]),
    }

    /// The Hopper kernel's maps read q in boxes of one consumer warpgroup's 64 rows and k and v
    /// in boxes of a key tile.
    fn flash_inputs(dtype: KernelDType, a: &FlashArgs, path: FlashPath) -> Result<FlashInputs> {
        Ok(match path {
            FlashPath::Hopper(_) => {
                let (q_box, kv_box) = (WgConfig::BM / 2, WgConfig::BN);
                FlashInputs::Maps([
                    tensor_map(dtype, a.q, a.nh * a.dk, a.tq, a.q_stride, q_box)?,
                    tensor_map(dtype, a.k, a.nkv * a.dk, a.tk, a.k_stride, kv_box)?,
                    tensor_map(dtype, a.v, a.nkv * a.dv, a.tk, a.v_stride, kv_box)?,
                ])
            }
            FlashPath::Generic | FlashPath::TensorCore(_) => FlashInputs::Rows([
                (a.q, to_i64(a.q_stride, "q stride")?),
                (a.k, to_i64(a.k_stride, "k stride")?),
                (a.v, to_i64(a.v_stride, "v stride")?),
            ]),
        })
    }

    /// Launches an attention entry point with the arguments every one takes, in its order
    /// (kernels/attention.cu, kernels/attention_sm90.cu): q, k and v (`inputs`), `out` and its
    /// row stride, tq, tk, nh, nkv, dk and dv (`head_dims`: the generic kernel only), the scale,
    /// the window and the sinks.
    #[allow(clippy::too_many_arguments)]
    fn launch_flash(
        dev: &CudaDevice,
        func: &CudaFunction,
        name: &str,
        config: LaunchConfig,
        a: &FlashArgs,
        inputs: &FlashInputs,
        head_dims: bool,
        sinks: DevPtr,
    ) -> Result<()> {
        let o_stride = to_i64(a.o_stride, "out stride")?;
        let sizes = [
            to_i32(a.tq, name)?,
            to_i32(a.tk, name)?,
            to_i32(a.nh, name)?,
            to_i32(a.nkv, name)?,
        ];
        let dims = [to_i32(a.dk, "dk")?, to_i32(a.dv, "dv")?];
        let window = to_i32(a.window, "window")?;
        let stream = dev.cuda_stream();
        let mut args = stream.launch_builder(func);
        match inputs {
            FlashInputs::Rows(rows) => {
                for (ptr, stride) in rows {
                    args.arg(ptr).arg(stride);
                }
            }
            FlashInputs::Maps(maps) => {
                for map in maps {
                    args.arg(map);
                }
            }
        }
        args.arg(&a.out).arg(&o_stride);
        for n in &sizes {
            args.arg(n);
        }
        if head_dims {
            args.arg(&dims[0]).arg(&dims[1]);
        }
        args.arg(&a.scale).arg(&window).arg(&sinks);
        // SAFETY: the arguments are the entry points' signatures (kernels/attention.cu,
        // kernels/attention_sm90.cu, checked by the device tests); the buffers' sizes are the
        // caller's contract, documented on `FlashArgs`.
        unsafe { args.launch(config) }
            .map_err(|e| candle_core::Error::Msg(format!("launching {name}: {e:?}")))?;
        Ok(())
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{assert_close, random, values};
    use crate::model::nn::attention;
    use candle_core::{DType, Device};

    /// (tq, tk, nh, nkv, dk, dv, window)
    type Case = (usize, usize, usize, usize, usize, usize, Option<usize>);

    /// T = 1, ragged T, tq < tk, GQA 1 and 4, dk != dv, a window shorter than T.
    const SMALL: &[Case] = &[
        (1, 1, 1, 1, 16, 16, None),
        (37, 37, 4, 1, 24, 24, None),
        (37, 37, 4, 4, 32, 16, Some(7)),
        (5, 50, 8, 2, 16, 24, None),
        (20, 45, 2, 2, 32, 32, Some(30)),
    ];

    fn params(nh: usize, nkv: usize, dk: usize, dv: usize, window: Option<usize>) -> AttnParams {
        AttnParams {
            nh,
            nkv,
            dk,
            dv,
            scale: (dk as f64).powf(-0.5),
            window,
        }
    }

    /// `[t, heads * d]` -> `[heads, t, d]`
    fn heads_first(x: &Tensor, heads: usize) -> Tensor {
        let (t, c) = x.dims2().unwrap();
        x.reshape((t, heads, c / heads))
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .contiguous()
            .unwrap()
    }

    #[test]
    fn reference_matches_candle() {
        let dev = Device::Cpu;
        for &(tq, tk, nh, nkv, dk, dv, window) in SMALL {
            let p = params(nh, nkv, dk, dv, window);
            // q, k, v as column windows of one fused [tk, ...] QKV output.
            let width = nh * dk + nkv * dk + nkv * dv;
            let qkv = random(&[tk, width], DType::F32, 1, &dev);
            let q = qkv
                .narrow(0, tk - tq, tq)
                .unwrap()
                .narrow(1, 0, nh * dk)
                .unwrap();
            let k = qkv.narrow(1, nh * dk, nkv * dk).unwrap();
            let v = qkv.narrow(1, nh * dk + nkv * dk, nkv * dv).unwrap();
            let got = flash_attention(&q, &k, &v, &p).unwrap();
            let mut mask = vec![0f32; tq * tk];
            for i in 0..tq {
                let pos = i + tk - tq;
                for j in 0..tk {
                    if j > pos || window.is_some_and(|w| pos - j >= w) {
                        mask[i * tk + j] = f32::NEG_INFINITY;
                    }
                }
            }
            let mask = Tensor::from_vec(mask, (tq, tk), &dev).unwrap();
            let want = attention(
                &heads_first(&q, nh),
                &heads_first(&k, nkv),
                &heads_first(&v, nkv),
                &mask,
                p.scale,
            )
            .unwrap();
            assert_eq!(want.dims(), got.dims());
            // f32 both ways, sums in other orders (candle's matmul): a few ulps.
            assert_close(
                &values(&got),
                &values(&want),
                1e-6,
                1e-5,
                &format!("{tq}x{tk} {p:?}"),
            );
        }
        let x = random(&[4, 16], DType::F32, 1, &dev);
        assert!(
            flash_attention(
                &x,
                &x.narrow(0, 0, 3).unwrap(),
                &x.narrow(0, 0, 3).unwrap(),
                &params(1, 1, 16, 16, None)
            )
            .is_err()
        );
    }

    /// Sinks for `nh` heads: below, near and above the scores' range (|scale q.k| stays
    /// within a few units for these inputs), so that some rows are dominated by the sink.
    fn test_sinks(nh: usize) -> Tensor {
        let s: Vec<f32> = (0..nh)
            .map(|h| 3.0 * (h % 3) as f32 - 2.0 + h as f32 / 8.0)
            .collect();
        Tensor::from_vec(s, nh, &Device::Cpu).unwrap()
    }

    /// transformers' `eager_attention_forward` for gpt-oss (models/gpt_oss/modeling_gpt_oss.py)
    /// on candle ops in f32: masked scores, the sink column concatenated, the row max over both
    /// subtracted, softmax, the sink column dropped, weights times values. `q`, `k`, `v` as
    /// `[heads, t, d]`; returns `[tq, nh * dv]`.
    fn eager_with_sinks(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: &Tensor,
        sinks: &Tensor,
        scale: f64,
    ) -> Tensor {
        let (nh, tq, _) = q.dims3().unwrap();
        let nkv = k.dims3().unwrap().0;
        let rep = |x: &Tensor| {
            let parts: Vec<Tensor> = (0..nh)
                .map(|h| x.narrow(0, h / (nh / nkv), 1).unwrap())
                .collect();
            Tensor::cat(&parts, 0).unwrap()
        };
        let (k, v) = (rep(k), rep(v));
        let scores = (q.matmul(&k.t().unwrap()).unwrap() * scale)
            .unwrap()
            .broadcast_add(mask)
            .unwrap();
        let sink_col = sinks
            .reshape((nh, 1, 1))
            .unwrap()
            .repeat((1, tq, 1))
            .unwrap();
        let combined = Tensor::cat(&[&scores, &sink_col], 2).unwrap();
        let combined = combined
            .broadcast_sub(&combined.max_keepdim(2).unwrap())
            .unwrap();
        let e = combined.exp().unwrap();
        let probs = e.broadcast_div(&e.sum_keepdim(2).unwrap()).unwrap();
        let tk = scores.dims3().unwrap().2;
        let out = probs.narrow(2, 0, tk).unwrap().matmul(&v).unwrap();
        let dv = out.dims3().unwrap().2;
        out.transpose(0, 1).unwrap().reshape((tq, nh * dv)).unwrap()
    }

    /// The reference with sinks against transformers' formulation ([`eager_with_sinks`]) on
    /// the small shapes (windows, tq < tk, GQA); and the same inputs without sinks are far
    /// outside the tolerance, so a reference that ignored its sinks would fail here.
    #[test]
    fn sinks_reference_matches_eager_softmax_with_sink() {
        let dev = Device::Cpu;
        for &(tq, tk, nh, nkv, dk, dv, window) in SMALL {
            let p = params(nh, nkv, dk, dv, window);
            let width = nh * dk + nkv * dk + nkv * dv;
            let qkv = random(&[tk, width], DType::F32, 2, &dev);
            let q = qkv
                .narrow(0, tk - tq, tq)
                .unwrap()
                .narrow(1, 0, nh * dk)
                .unwrap();
            let k = qkv.narrow(1, nh * dk, nkv * dk).unwrap();
            let v = qkv.narrow(1, nh * dk + nkv * dk, nkv * dv).unwrap();
            let sinks = test_sinks(nh);
            let got = flash_attention_with_sinks(&q, &k, &v, &p, Some(&sinks)).unwrap();
            let mut mask = vec![0f32; tq * tk];
            for i in 0..tq {
                let pos = i + tk - tq;
                for j in 0..tk {
                    if j > pos || window.is_some_and(|w| pos - j >= w) {
                        mask[i * tk + j] = f32::NEG_INFINITY;
                    }
                }
            }
            let mask = Tensor::from_vec(mask, (tq, tk), &dev).unwrap();
            let want = eager_with_sinks(
                &heads_first(&q, nh),
                &heads_first(&k, nkv),
                &heads_first(&v, nkv),
                &mask,
                &sinks,
                p.scale,
            );
            let what = format!("{tq}x{tk} {p:?}");
            // f32 both ways, sums in other orders: a few ulps, as `reference_matches_candle`.
            let (atol, rtol) = (1e-6, 1e-5);
            assert_close(&values(&got), &values(&want), atol, rtol, &what);
            // The planted bug: the sink ignored. Some head's sink (up to 4.x) dominates its
            // rows, so outputs move by far more than the tolerance.
            let no_sink = values(&flash_attention(&q, &k, &v, &p).unwrap());
            let worst = no_sink
                .iter()
                .zip(values(&want))
                .map(|(a, b)| (a - b).abs() / (atol + rtol * b.abs()))
                .fold(0f32, f32::max);
            assert!(
                worst > 100.0,
                "{what}: ignoring the sinks moved outputs by only {worst}x the tolerance"
            );
        }
        // Sinks of the wrong length or on another device are refused.
        let x = random(&[4, 16], DType::F32, 1, &dev);
        let bad = Tensor::zeros(2, DType::F32, &dev).unwrap();
        let p = params(1, 1, 16, 16, None);
        assert!(flash_attention_with_sinks(&x, &x, &x, &p, Some(&bad)).is_err());
    }

    /// A sink of -inf is no sink at all (e^-inf = 0); a huge sink takes the whole row's mass
    /// (the output goes to 0) without overflowing: the max is taken with the sink.
    #[test]
    fn sink_extremes() {
        let dev = Device::Cpu;
        let (t, nh, d) = (9, 2, 16);
        let x = random(&[t, nh * d], DType::F32, 3, &dev);
        let p = params(nh, nh, d, d, Some(4));
        let plain = values(&flash_attention(&x, &x, &x, &p).unwrap());
        let minus_inf = Tensor::new(&[f32::NEG_INFINITY; 2], &dev).unwrap();
        let got = values(&flash_attention_with_sinks(&x, &x, &x, &p, Some(&minus_inf)).unwrap());
        assert_eq!(got, plain);
        let huge = Tensor::new(&[1e30f32, 200.0], &dev).unwrap();
        let got = values(&flash_attention_with_sinks(&x, &x, &x, &p, Some(&huge)).unwrap());
        assert!(
            got.iter().all(|v| v.is_finite() && v.abs() < 1e-30),
            "{got:?}"
        );
    }

    #[cfg(feature = "cuda")]
    mod device {
        use super::*;
        use crate::kernels::attention::launch::{TC_CONFIGS, WG_CONFIGS};

        /// The CUDA device when it runs the Hopper kernels (sm_90), else `None` after saying why.
        fn hopper_device() -> Option<Device> {
            let gpu = crate::kernels::testing::cuda_device()?;
            let Device::Cuda(dev) = &gpu else {
                return None;
            };
            if !crate::kernels::dispatch::hopper(dev) {
                eprintln!("skipped: not an sm_90 device (or EAGLE_CHECK_ATTENTION=mma)");
                return None;
            }
            Some(gpu)
        }

        /// Runs `path` on the GPU and the reference on the CPU; `q`, `k`, `v` are windows of a
        /// fused QKV made in `dtype`.
        fn check(gpu: &Device, dtype: DType, case: Case, path: Option<&'static str>) {
            check_inputs(gpu, dtype, case, path, false, false);
        }

        /// [`check`]; with `ramp`, key j is scaled by 1 + j / 32 and the softmax scale is 0.5,
        /// so every row's maximum keeps growing along the keys (by tens of log2 units over
        /// 300 keys): the path where flash_tc2's lazy rescaling moves its reference maximum.
        /// With `sinks`, both sides take [`test_sinks`].
        fn check_inputs(
            gpu: &Device,
            dtype: DType,
            (tq, tk, nh, nkv, dk, dv, window): Case,
            path: Option<&'static str>,
            ramp: bool,
            sinks: bool,
        ) {
            let mut p = params(nh, nkv, dk, dv, window);
            let width = nh * dk + nkv * dk + nkv * dv;
            let mut qkv = random(
                &[tk, width],
                DType::F32,
                (tq * 31 + tk) as u64,
                &Device::Cpu,
            );
            if ramp {
                p.scale = 0.5;
                let mut x = values(&qkv);
                for (j, row) in x.chunks_mut(width).enumerate() {
                    for v in &mut row[nh * dk..nh * dk + nkv * dk] {
                        *v *= 1.0 + j as f32 / 32.0;
                    }
                }
                qkv = Tensor::from_vec(x, (tk, width), &Device::Cpu).unwrap();
            }
            let qkv = qkv.to_dtype(dtype).unwrap();
            let split = |t: &Tensor| {
                (
                    t.narrow(0, tk - tq, tq)
                        .unwrap()
                        .narrow(1, 0, nh * dk)
                        .unwrap(),
                    t.narrow(1, nh * dk, nkv * dk).unwrap(),
                    t.narrow(1, nh * dk + nkv * dk, nkv * dv).unwrap(),
                )
            };
            let (q, k, v) = split(&qkv);
            let sinks = sinks.then(|| test_sinks(nh));
            let want = flash_attention_with_sinks(&q, &k, &v, &p, sinks.as_ref()).unwrap();
            let qkv_gpu = qkv.to_device(gpu).unwrap();
            let (q, k, v) = split(&qkv_gpu);
            let gsinks = sinks.map(|s| s.to_device(gpu).unwrap());
            let got = flash_attention_sinks_on(&q, &k, &v, &p, gsinks.as_ref(), path).unwrap();
            // Tolerances: the reference rounds once from f32. The generic kernel differs only in
            // summation order (a few f32 ulps), so one ulp of the dtype. The tensor-core path
            // also rounds P to the dtype for P.V (as FA2): each weight off by up to 2^-9 (bf16)
            // or 2^-12 (f16) relative, so outputs (averages of values in [-1, 1]) move by up to
            // that absolute amount, plus the output rounding.
            let tensor_core = path != Some("generic") && dtype != DType::F32;
            let (atol, rtol) = match (dtype, tensor_core) {
                (DType::F32, _) => (1e-6, 1e-5),
                (DType::BF16, false) => (1e-5, 1.0 / 128.0),
                (DType::F16, false) => (1e-5, 1.0 / 1024.0),
                (DType::BF16, true) => (1.0 / 256.0, 1.0 / 128.0),
                _ => (1.0 / 2048.0, 1.0 / 1024.0),
            };
            let what = format!(
                "{dtype:?} {path:?} tq {tq} tk {tk} ramp {ramp} sinks {} {p:?}",
                gsinks.is_some()
            );
            assert_close(&values(&got), &values(&want), atol, rtol, &what);
        }

        /// `TC_CONFIGS` against the instantiations in kernels/attention.cu and the emulator's
        /// table (kernels/emu/attention_emu.cpp): the same tags with the same (dk, dv, MT, NW,
        /// BN, stages), and shared memory within the 227 KiB a block may have. No GPU needed.
        #[test]
        fn tile_table_matches_the_instantiations() {
            fn args(line: &str, head: &str) -> Option<Vec<String>> {
                let rest = line.trim().strip_prefix(head)?.strip_suffix(')')?;
                Some(rest.split(',').map(|a| a.trim().to_string()).collect())
            }
            let num = |a: &String| a.parse::<usize>().unwrap();
            let mut cu = Vec::new();
            for line in include_str!("../../kernels/attention.cu").lines() {
                if let Some(a) = args(line, "FLASH_TC_TYPES(").filter(|a| a.len() == 6) {
                    let [dk, dv, mt, nw, bn] = [1, 2, 3, 4, 5].map(|i| num(&a[i]));
                    cu.push((a[0].clone(), dk, dv, mt, nw, bn, 2));
                }
                if let Some(a) = args(line, "FLASH_TC2_TYPES(").filter(|a| a.len() == 10) {
                    let [dk, dv, mt, nw, bn, bc, st] = [1, 2, 3, 4, 5, 6, 7].map(|i| num(&a[i]));
                    assert!(
                        bn.is_multiple_of(bc) && bc.is_multiple_of(16),
                        "{}: BC {bc} BN {bn}",
                        a[0]
                    );
                    cu.push((a[0].clone(), dk, dv, mt, nw, bn, st));
                }
            }
            let mut emu = Vec::new();
            for line in include_str!("../../kernels/emu/attention_emu.cpp").lines() {
                if let Some(a) = args(line.trim_end_matches(','), "CFG(").filter(|a| a.len() == 7) {
                    let [dk, dv, mt, nw, bn, st] = [1, 2, 3, 4, 5, 6].map(|i| num(&a[i]));
                    emu.push((a[0].clone(), dk, dv, mt, nw, bn, st));
                }
            }
            // TC_CONFIGS is in preference order (the first tile of a head shape is its
            // default); the files list theirs in any order: the same tiles are compared.
            let mut rust: Vec<_> = TC_CONFIGS
                .iter()
                .map(|c| (c.tag.to_string(), c.dk, c.dv, c.mt, c.nw, c.bn, c.stages))
                .collect();
            rust.sort();
            cu.sort();
            emu.sort();
            assert_eq!(rust, cu, "TC_CONFIGS vs kernels/attention.cu");
            assert_eq!(rust, emu, "TC_CONFIGS vs kernels/emu/attention_emu.cpp");
            for c in TC_CONFIGS {
                assert!(c.shared_bytes(2) <= 227 * 1024, "{}: shared memory", c.tag);
            }
        }

        /// `WG_CONFIGS` against the instantiations in kernels/attention_sm90.cu (the same tags,
        /// head dims and stages) and their shared memory within the 227 KiB a block may have.
        /// No GPU needed.
        #[test]
        fn hopper_table_matches_the_instantiations() {
            let mut cu = Vec::new();
            for line in include_str!("../../kernels/attention_sm90.cu").lines() {
                let Some(rest) = line.trim().strip_prefix("FLASH_WG_TYPES(") else {
                    continue;
                };
                let a: Vec<&str> = rest
                    .trim_end_matches(')')
                    .split(',')
                    .map(str::trim)
                    .collect();
                if let [tag, dk, dv, st] = a[..] {
                    let num = |x: &str| x.parse::<usize>().unwrap();
                    cu.push((format!("wg_{tag}"), num(dk), num(dv), num(st)));
                }
            }
            let rust: Vec<_> = WG_CONFIGS
                .iter()
                .map(|c| (c.tag.to_string(), c.dk, c.dv, c.stages))
                .collect();
            assert_eq!(rust, cu, "WG_CONFIGS vs kernels/attention_sm90.cu");
            for c in WG_CONFIGS {
                assert!(c.shared_bytes() <= 227 * 1024, "{}: shared memory", c.tag);
            }
        }

        #[test]
        fn device_generic_matches_reference() {
            let Some(gpu) = crate::kernels::testing::cuda_device() else {
                return;
            };
            for &shape in SMALL {
                for dtype in [DType::F32, DType::BF16, DType::F16] {
                    check(&gpu, dtype, shape, None);
                }
            }
            // Llama-3.1-8B at T = 2048 in f32 (only the generic kernel takes f32).
            check(&gpu, DType::F32, (2048, 2048, 32, 8, 128, 128, None), None);
            check(
                &gpu,
                DType::BF16,
                (300, 300, 32, 8, 128, 128, Some(100)),
                Some("generic"),
            );
        }

        /// Runs kernel `tag` (dk, dv) on ragged shapes against the reference: T = 1, T below and
        /// across one block, tq < tk, a short window, a window with tq < tk over many tiles
        /// (every stage of a 4-stage ring, tiles skipped before the window), growing row maxima
        /// (the rescale paths).
        fn ragged_cases(gpu: &Device, tag: &'static str, dk: usize, dv: usize) {
            let (nh, nkv) = if dk != dv { (16, 16) } else { (8, 2) };
            for (tq, tk, window, ramp) in [
                (1, 1, None, false),
                (37, 37, None, false),
                (129, 129, None, false),
                (70, 300, None, false),
                (200, 200, Some(33), false),
                (100, 600, Some(150), false),
                (300, 300, None, true),
                (257, 257, Some(70), true),
            ] {
                for dtype in [DType::BF16, DType::F16] {
                    check_inputs(
                        gpu,
                        dtype,
                        (tq, tk, nh, nkv, dk, dv, window),
                        Some(tag),
                        ramp,
                        false,
                    );
                }
            }
        }

        /// Realistic shapes on the kernel `tag_for` names for (dk, dv): Llama-3.1-8B and a
        /// Mistral window at T = 2048, DeepSeek MLA heads, f16 with tq < tk.
        fn realistic_cases(gpu: &Device, tag_for: impl Fn(usize, usize) -> Option<&'static str>) {
            for (dtype, case) in [
                (DType::BF16, (2048, 2048, 32, 8, 128, 128, None)),
                (DType::BF16, (2048, 2048, 32, 8, 128, 128, Some(1000))),
                (DType::BF16, (2048, 2048, 16, 16, 192, 128, None)),
                (DType::F16, (512, 2048, 32, 8, 128, 128, None)),
            ] {
                check(gpu, dtype, case, tag_for(case.4, case.5));
            }
        }

        #[test]
        fn device_tensor_core_matches_reference() {
            let Some(gpu) = crate::kernels::testing::cuda_device() else {
                return;
            };
            for c in TC_CONFIGS {
                ragged_cases(&gpu, c.tag, c.dk, c.dv);
            }
            // Each head shape's mma.sync tile (the default off sm_90).
            realistic_cases(&gpu, |dk, dv| {
                TC_CONFIGS
                    .iter()
                    .find(|c| (c.dk, c.dv) == (dk, dv))
                    .map(|c| c.tag)
            });
        }

        /// The Hopper kernels' building blocks: one S = Q K^T tile (both operands K-major from
        /// TMA copies) and one O = P V tile (P from registers, V N-major) against f32 products
        /// of the same bf16 values. A wrong descriptor (swizzle, leading or stride offset, the
        /// transpose) permutes or mixes elements: errors of the size of the values, not ulps.
        #[test]
        fn device_wgmma_tile_matches_reference() {
            let Some(gpu) = hopper_device() else {
                return;
            };
            let Device::Cuda(dev) = &gpu else {
                unreachable!("hopper_device is a CUDA device")
            };
            let host =
                |rows: usize, seed: u64| random(&[rows, 128], DType::BF16, seed, &Device::Cpu);
            let (q, k, v, p) = (host(64, 1), host(128, 2), host(128, 3), host(64, 4));
            let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
            let want_s = values(&f32s(&q).matmul(&f32s(&k).t().unwrap()).unwrap());
            let want_o = values(&f32s(&p).matmul(&f32s(&v)).unwrap());
            let on_gpu = |t: &Tensor| t.to_device(&gpu).unwrap();
            let (gq, gk, gv, gp) = (on_gpu(&q), on_gpu(&k), on_gpu(&v), on_gpu(&p));
            let out = |n: usize| {
                crate::kernels::cuda::tensor(
                    crate::kernels::cuda::alloc(dev, DType::F32, n).unwrap(),
                    n,
                )
            };
            let (s_out, o_out) = (out(64 * 128), out(64 * 128));
            let ptr = |t: &Tensor| crate::kernels::cuda::tensor_ptr(t).unwrap();
            crate::kernels::attention::launch::wg_tile_check(
                dev,
                ptr(&gq),
                ptr(&gk),
                ptr(&gv),
                ptr(&gp),
                ptr(&s_out),
                ptr(&o_out),
            )
            .unwrap();
            // f32 sums of 128 exact products (bf16 x bf16) of magnitude <= 1: the order of the
            // additions moves the last bits only.
            assert_close(&values(&s_out), &want_s, 1e-4, 1e-5, "wgmma S = Q K^T");
            assert_close(&values(&o_out), &want_o, 1e-4, 1e-5, "wgmma O = P V");
        }

        /// The Hopper kernels against the reference on the ragged cases and realistic shapes;
        /// and the default path on an sm_90 device is the Hopper kernel.
        #[test]
        fn device_hopper_matches_reference() {
            let Some(gpu) = hopper_device() else {
                return;
            };
            for c in WG_CONFIGS {
                ragged_cases(&gpu, c.tag, c.dk, c.dv);
            }
            let Device::Cuda(dev) = &gpu else {
                unreachable!("hopper_device is a CUDA device")
            };
            let llama = crate::kernels::attention::launch::FlashArgs {
                q: 0,
                q_stride: 6144,
                k: 8192,
                k_stride: 6144,
                v: 10240,
                v_stride: 6144,
                out: 0,
                o_stride: 4096,
                tq: 2048,
                tk: 2048,
                nh: 32,
                nkv: 8,
                dk: 128,
                dv: 128,
                scale: 1.0,
                window: 0,
            };
            assert_eq!(
                crate::kernels::attention::launch::flash_path(
                    dev,
                    crate::kernels::KernelDType::BF16,
                    &llama
                ),
                crate::kernels::attention::launch::FlashPath::Hopper(WG_CONFIGS[0])
            );
            // The default path, which is the Hopper kernel here.
            realistic_cases(&gpu, |_, _| None);
        }

        /// Llama-4-Scout's heads (40 query heads of 128 over 8 KV heads: five queries a group,
        /// where the other realistic cases have four or one) on the default path against the
        /// reference, at T = 128 and 2048. Run 27 saw the full-width Scout forward stall on an
        /// H100; this and `moe::tests::device_llama4_scout_experts_agree` isolate its kernels.
        #[test]
        fn device_llama4_scout_heads_match_reference() {
            let Some(gpu) = crate::kernels::testing::cuda_device() else {
                return;
            };
            for t in [128, 2048] {
                check(&gpu, DType::BF16, (t, t, 40, 8, 128, 128, None), None);
            }
        }

        /// gpt-oss's attention sinks on every path against the CPU reference with sinks: the
        /// generic kernel (f32, bf16), every tensor-core tile and, on an sm_90 device, every
        /// Hopper kernel; full and sliding-window rows (gpt-oss alternates them, window 128),
        /// tq < tk, a window over several tiles, growing row maxima, and gpt-oss-20b's heads
        /// (64 query heads of 64 over 8 KV heads) at T = 1024 on the default path. Prints one
        /// line per path.
        #[test]
        fn device_sinks_match_reference() {
            let Some(gpu) = crate::kernels::testing::cuda_device() else {
                return;
            };
            let shapes = [
                (1, 1, None, false),
                (37, 37, None, false),
                (200, 200, Some(33), false),
                (100, 600, Some(150), false),
                (257, 257, Some(70), true),
            ];
            let run = |path: Option<&'static str>, dk: usize, dv: usize, dtypes: &[DType]| {
                let (nh, nkv) = if dk != dv { (16, 16) } else { (8, 2) };
                for &(tq, tk, window, ramp) in &shapes {
                    // Growing maxima only in bf16/f16, as `ragged_cases`: scores of tens make
                    // f32 summation-order differences exceed `check_inputs`' f32 ulps
                    // (measured on the H200: 3.4x at 257 keys with a window of 70 and sinks; the
                    // sink adds one exp term, the scores' rounding is the error).
                    for &dtype in dtypes.iter().filter(|&&d| !(ramp && d == DType::F32)) {
                        let case = (tq, tk, nh, nkv, dk, dv, window);
                        check_inputs(&gpu, dtype, case, path, ramp, true);
                    }
                }
                eprintln!("sinks: {path:?} (dk {dk}, dv {dv}) pass");
            };
            run(Some("generic"), 64, 64, &[DType::F32, DType::BF16]);
            run(Some("generic"), 128, 128, &[DType::BF16]);
            for c in TC_CONFIGS {
                run(Some(c.tag), c.dk, c.dv, &[DType::BF16, DType::F16]);
            }
            if hopper_device().is_some() {
                for c in WG_CONFIGS {
                    run(Some(c.tag), c.dk, c.dv, &[DType::BF16, DType::F16]);
                }
            }
            for window in [None, Some(128)] {
                check_inputs(
                    &gpu,
                    DType::BF16,
                    (1024, 1024, 64, 8, 64, 64, window),
                    None,
                    false,
                    true,
                );
            }
            eprintln!("sinks: gpt-oss-20b heads at T = 1024, default path: pass");
        }

        /// Throughput of every tensor-core tile on Llama-3.1-8B heads (nh 32, nkv 8, hd 128) and
        /// DeepSeek MLA heads at T = 2048..8192. A benchmark, not a check: run with
        /// `--ignored --nocapture`.
        /// A kernel's tag and head dims, for the throughput table.
        struct Tile {
            tag: &'static str,
            dk: usize,
            dv: usize,
        }

        #[test]
        #[ignore = "benchmark; run with --ignored --nocapture"]
        fn device_throughput() {
            let Some(gpu) = crate::kernels::testing::cuda_device() else {
                return;
            };
            let hopper = hopper_device().is_some();
            let tiles = TC_CONFIGS
                .iter()
                .filter(|c| c.dk >= 128)
                .map(|c| (c.tag, c.dk, c.dv))
                .chain(
                    WG_CONFIGS
                        .iter()
                        .filter(|_| hopper)
                        .map(|c| (c.tag, c.dk, c.dv)),
                )
                .collect::<Vec<_>>();
            for t in [2048, 4096, 8192] {
                for &(tag, dk, dv) in &tiles {
                    let c = Tile { tag, dk, dv };
                    let (nh, nkv) = if c.dk != c.dv { (128, 128) } else { (32, 8) };
                    let width = nh * c.dk + nkv * c.dk + nkv * c.dv;
                    let qkv = random(&[t, width], DType::BF16, 1, &gpu);
                    let q = qkv.narrow(1, 0, nh * c.dk).unwrap();
                    let k = qkv.narrow(1, nh * c.dk, nkv * c.dk).unwrap();
                    let v = qkv.narrow(1, nh * c.dk + nkv * c.dk, nkv * c.dv).unwrap();
                    let p = params(nh, nkv, c.dk, c.dv, None);
                    let run = || flash_attention_on(&q, &k, &v, &p, Some(c.tag)).unwrap();
                    run();
                    gpu.synchronize().unwrap();
                    let iters = 20;
                    let start = std::time::Instant::now();
                    for _ in 0..iters {
                        run();
                    }
                    gpu.synchronize().unwrap();
                    let secs = start.elapsed().as_secs_f64() / iters as f64;
                    // Causal: half of the T x T scores, two products of (dk + dv) / 2 each.
                    let flops = (t * t) as f64 * nh as f64 * (c.dk + c.dv) as f64;
                    eprintln!(
                        "attention {} T {t} nh {nh} nkv {nkv}: {:.3} ms, {:.0} TFLOP/s",
                        c.tag,
                        secs * 1e3,
                        flops / secs / 1e12
                    );
                }
            }
        }
    }
}
