//! cuBLAS GEMMs into preallocated outputs: `out[M, N] (+)= a[M, K] @ w[N, K]^T` (the layout of
//! every HF linear layer) through `cublasGemmEx`, `out = a @ w^T + c` with `c` another buffer
//! (a residual stream) through cublasLt, and the MoE experts as one
//! `cublasGemmGroupedBatchedEx` call over the rows each expert owns. f32 accumulation; row
//! strides honoured, so `a` and `out` may be column windows of wider buffers.

use super::KernelDType;
use super::cuda::{self, DevPtr};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{CpuStorage, InplaceOp3, Layout, Result, Tensor};
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t,
};
use std::ffi::{c_int, c_void};

fn data_type(dtype: KernelDType) -> cudaDataType_t {
    match dtype {
        KernelDType::F32 => cudaDataType_t::CUDA_R_32F,
        KernelDType::F16 => cudaDataType_t::CUDA_R_16F,
        KernelDType::BF16 => cudaDataType_t::CUDA_R_16BF,
    }
}

fn to_int(n: usize, what: &str) -> Result<c_int> {
    super::to_i32(n, what)
}

/// One GEMM on raw pointers: `out[m, n] = a[m, k] @ w[n, k]^T (+ out when accumulate)`, row
/// strides in elements, all in `dtype`.
#[derive(Clone, Copy, Debug)]
pub struct GemmArgs {
    pub out: DevPtr,
    pub out_stride: usize,
    pub a: DevPtr,
    pub a_stride: usize,
    pub w: DevPtr,
    pub w_stride: usize,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub accumulate: bool,
}

/// Runs [`GemmArgs`] on the device's cuBLAS handle (bound to its stream).
pub fn gemm_raw(dev: &CudaDevice, dtype: KernelDType, g: &GemmArgs) -> Result<()> {
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    if g.a_stride < g.k || g.w_stride < g.k || g.out_stride < g.n {
        candle_core::bail!("gemm: row strides {g:?} shorter than the rows");
    }
    let (alpha, beta) = (1f32, if g.accumulate { 1f32 } else { 0f32 });
    let ty = data_type(dtype);
    let blas = dev.cublas_handle();
    // Row-major out = a w^T is column-major out^T [n, m] = w [k, n]^T (op T) x a^T [k, m].
    // SAFETY: the pointers name buffers of the documented shapes (the caller's contract); the
    // scalars are host values as the handle's default pointer mode expects.
    unsafe {
        cudarc::cublas::sys::cublasGemmEx(
            *blas.handle(),
            cublasOperation_t::CUBLAS_OP_T,
            cublasOperation_t::CUBLAS_OP_N,
            to_int(g.n, "gemm n")?,
            to_int(g.m, "gemm m")?,
            to_int(g.k, "gemm k")?,
            (&alpha as *const f32).cast(),
            g.w as *const c_void,
            ty,
            to_int(g.w_stride, "gemm w stride")?,
            g.a as *const c_void,
            ty,
            to_int(g.a_stride, "gemm a stride")?,
            (&beta as *const f32).cast(),
            g.out as *mut c_void,
            ty,
            to_int(g.out_stride, "gemm out stride")?,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .result()
    .map_err(|e| candle_core::Error::Msg(format!("cublasGemmEx {g:?}: {e}")))
}

/// `out[m, n] = a[m, k] @ w[n, k]^T + c[m, n]` with `c` (row stride `c_stride`) a buffer other
/// than `out`: the residual add of a decoder layer in the GEMM's epilogue, the f32 sum rounded
/// once. cuBLAS's `GemmEx` reads and writes one C; cublasLt takes C and D apart.
pub fn gemm_add_raw(
    dev: &CudaDevice,
    dtype: KernelDType,
    g: &GemmArgs,
    c: DevPtr,
    c_stride: usize,
) -> Result<()> {
    // The heuristic's first choice: within 1-5% of cublasGemmEx and of the best of the others
    // on the Llama projections (`gpu-bench gemm`, BENCHMARKS.md run 14).
    with_lt_plan(dev, dtype, g, Some(c_stride), |lt, plan| {
        lt.run(plan, 0, dev, g, Some(c))
    })
}

/// `out = a @ w^T` (or [`gemm_add_raw`]'s sum with `c`) through cublasLt, timed once per
/// algorithm that cublasLt's heuristic offers for its shape (up to [`LT_ALGOS`], best guess
/// first): ms per run, the median of `reps` runs between CUDA events after one warm-up run,
/// `None` where the algorithm failed. `out` is overwritten `reps + 1` times per algorithm, so it must not alias
/// an input. For the GPU bench (`gpu-bench gemm`).
pub fn gemm_lt_times(
    dev: &CudaDevice,
    dtype: KernelDType,
    g: &GemmArgs,
    c: Option<(DevPtr, usize)>,
    reps: usize,
) -> Result<Vec<Option<f64>>> {
    with_lt_plan(dev, dtype, g, c.map(|c| c.1), |lt, plan| {
        let stream = dev.cuda_stream();
        let event = || {
            stream
                .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| candle_core::Error::Msg(format!("event: {e:?}")))
        };
        let mut times = Vec::with_capacity(plan.algos.len());
        for i in 0..plan.algos.len() {
            if lt.run(plan, i, dev, g, c.map(|c| c.0)).is_err() {
                times.push(None);
                continue;
            }
            let mut ms = Vec::with_capacity(reps);
            for _ in 0..reps.max(1) {
                let start = event()?;
                lt.run(plan, i, dev, g, c.map(|c| c.0))?;
                let end = event()?;
                ms.push(f64::from(start.elapsed_ms(&end).map_err(|e| {
                    candle_core::Error::Msg(format!("event timing: {e:?}"))
                })?));
            }
            ms.sort_by(f64::total_cmp);
            times.push(Some(ms[ms.len() / 2]));
        }
        Ok(times)
    })
}

/// How many algorithms a plan asks cublasLt's heuristic for.
pub const LT_ALGOS: usize = 8;

/// Runs `f` on the plan of `g`'s shape (made on first use) and its device's cublasLt state.
fn with_lt_plan<R>(
    dev: &CudaDevice,
    dtype: KernelDType,
    g: &GemmArgs,
    c_stride: Option<usize>,
    f: impl FnOnce(&LtState, &LtPlan) -> Result<R>,
) -> Result<R> {
    if g.a_stride < g.k
        || g.w_stride < g.k
        || g.out_stride < g.n
        || c_stride.is_some_and(|c| c < g.n)
    {
        candle_core::bail!(
            "cublasLt gemm: row strides {g:?} (c {c_stride:?}) shorter than the rows"
        );
    }
    let key = LtKey {
        dtype,
        m: g.m,
        n: g.n,
        k: g.k,
        strides: [g.a_stride, g.w_stride, g.out_stride],
        c_stride,
    };
    let mut state = LT
        .lock()
        .map_err(|_| candle_core::Error::Msg("cublasLt state poisoned".into()))?;
    let ordinal = dev.cuda_stream().context().ordinal();
    let at = match state.iter().position(|s| s.ordinal == ordinal) {
        Some(i) => i,
        None => {
            state.push(LtState::new(dev, ordinal)?);
            state.len() - 1
        }
    };
    let lt = &mut state[at];
    let plan = match lt.plans.iter().position(|(k, _)| *k == key) {
        Some(i) => i,
        None => {
            let plan = LtPlan::new(lt, &key)?;
            lt.plans.push((key, plan));
            lt.plans.len() - 1
        }
    };
    let lt = &state[at];
    f(lt, &lt.plans[plan].1)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct LtKey {
    dtype: KernelDType,
    m: usize,
    n: usize,
    k: usize,
    /// a, w, out
    strides: [usize; 3],
    /// `Some` when the GEMM adds a `c` of this row stride.
    c_stride: Option<usize>,
}

/// One device's cublasLt handle and workspace, with the plans made on it.
struct LtState {
    ordinal: usize,
    handle: cudarc::cublaslt::sys::cublasLtHandle_t,
    /// Held for `workspace_ptr`'s sake.
    _workspace: cudarc::driver::CudaSlice<u8>,
    workspace_ptr: DevPtr,
    ws_bytes: usize,
    plans: Vec<(LtKey, LtPlan)>,
}

// SAFETY: the raw handles are only used under the `LT` mutex.
unsafe impl Send for LtState {}

/// Every device's cublasLt state, made on first use and kept for the process: a plan's
/// description, layouts and heuristic query cost about 10 us of host work, which every
/// projection of every layer would pay again otherwise.
static LT: std::sync::Mutex<Vec<LtState>> = std::sync::Mutex::new(Vec::new());

impl LtState {
    /// 32 MiB of workspace: cuBLAS's recommendation for Hopper.
    const WORKSPACE: usize = 32 << 20;

    fn new(dev: &CudaDevice, ordinal: usize) -> Result<LtState> {
        use cudarc::driver::DevicePtr;
        let handle = cudarc::cublaslt::result::create_handle()
            .map_err(|e| candle_core::Error::Msg(format!("cublasLtCreate: {e:?}")))?;
        let stream = dev.cuda_stream();
        // SAFETY: written by cuBLAS as scratch only.
        let workspace = unsafe { stream.alloc::<u8>(Self::WORKSPACE) }
            .map_err(|e| candle_core::Error::Msg(format!("cublasLt workspace: {e:?}")))?;
        let workspace_ptr = workspace.device_ptr(&stream).0;
        Ok(LtState {
            ordinal,
            handle,
            _workspace: workspace,
            workspace_ptr,
            ws_bytes: Self::WORKSPACE,
            plans: Vec::new(),
        })
    }

    /// `g` with the plan's algorithm `algo` (D = `g.out`; C = `c` when given, else `g.out` with
    /// beta 0).
    fn run(
        &self,
        plan: &LtPlan,
        algo: usize,
        dev: &CudaDevice,
        g: &GemmArgs,
        c: Option<DevPtr>,
    ) -> Result<()> {
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let (alpha, beta) = (1f32, if c.is_some() { 1f32 } else { 0f32 });
        let c_layout = if c.is_some() {
            plan.layouts[2]
        } else {
            plan.layouts[3]
        };
        let stream = dev.cuda_stream();
        // SAFETY: the plan's layouts describe the caller's buffers (its contract, as for
        // `gemm_raw`); the workspace is this state's own allocation of `ws_bytes`.
        unsafe {
            cudarc::cublaslt::result::matmul(
                self.handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                g.w as *const c_void,
                plan.layouts[0],
                g.a as *const c_void,
                plan.layouts[1],
                c.unwrap_or(g.out) as *const c_void,
                c_layout,
                g.out as *mut c_void,
                plan.layouts[3],
                &plan.algos[algo],
                self.workspace_ptr as *mut c_void,
                self.ws_bytes,
                stream.cu_stream() as *mut _,
            )
        }
        .map_err(|e| candle_core::Error::Msg(format!("cublasLtMatmul {g:?} (c {c:?}): {e:?}")))
    }
}

/// The description, the A, B, C, D layouts and the candidate algorithms of one shape.
struct LtPlan {
    desc: cudarc::cublaslt::sys::cublasLtMatmulDesc_t,
    layouts: [cudarc::cublaslt::sys::cublasLtMatrixLayout_t; 4],
    /// The heuristic's algorithms, best guess first.
    algos: Vec<cudarc::cublaslt::sys::cublasLtMatmulAlgo_t>,
}

impl LtPlan {
    /// Row-major `out = a w^T (+ c)` is column-major `out^T [n, m] = w^T (op T on w [k, n]) x
    /// a^T [k, m] (+ c^T)`, as in [`gemm_raw`].
    fn new(lt: &LtState, key: &LtKey) -> Result<LtPlan> {
        use cudarc::cublaslt::{result as lt_result, sys as lt_sys};
        let err = |what: &str, e: lt_result::CublasError| {
            candle_core::Error::Msg(format!("cublasLt {what} for {key:?}: {e:?}"))
        };
        let ty = match key.dtype {
            KernelDType::F32 => lt_sys::cudaDataType_t::CUDA_R_32F,
            KernelDType::F16 => lt_sys::cudaDataType_t::CUDA_R_16F,
            KernelDType::BF16 => lt_sys::cudaDataType_t::CUDA_R_16BF,
        };
        let desc = lt_result::create_matmul_desc(
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt_sys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(|e| err("matmul description", e))?;
        let trans = cublasOperation_t::CUBLAS_OP_T;
        // SAFETY: a live description and an attribute of the size it declares.
        unsafe {
            lt_result::set_matmul_desc_attribute(
                desc,
                lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&trans as *const cublasOperation_t).cast(),
                std::mem::size_of::<cublasOperation_t>(),
            )
        }
        .map_err(|e| err("transpose", e))?;
        let [a_stride, w_stride, out_stride] = key.strides.map(|s| s as i64);
        let c_stride = key.c_stride.map_or(out_stride, |s| s as i64);
        let (m, n, k) = (key.m as u64, key.n as u64, key.k as u64);
        let layout = |rows: u64, cols: u64, ld: i64| {
            lt_result::create_matrix_layout(ty, rows, cols, ld).map_err(|e| err("layout", e))
        };
        let layouts = [
            layout(k, n, w_stride)?,
            layout(k, m, a_stride)?,
            layout(n, m, c_stride)?,
            layout(n, m, out_stride)?,
        ];
        let pref = lt_result::create_matmul_pref().map_err(|e| err("preference", e))?;
        let ws = lt.ws_bytes as u64;
        let mut results = vec![
            // SAFETY: plain data that cuBLAS fills.
            unsafe { std::mem::zeroed::<lt_sys::cublasLtMatmulHeuristicResult_t>() };
            LT_ALGOS
        ];
        let mut found: std::ffi::c_int = 0;
        // SAFETY: live descriptors and layouts made above; `results` has room for LT_ALGOS.
        let status = unsafe {
            lt_result::set_matmul_pref_attribute(
                pref,
                lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const u64).cast(),
                std::mem::size_of::<u64>(),
            )
            .and_then(|_| {
                lt_sys::cublasLtMatmulAlgoGetHeuristic(
                    lt.handle,
                    desc,
                    layouts[0],
                    layouts[1],
                    layouts[2],
                    layouts[3],
                    pref,
                    LT_ALGOS as std::ffi::c_int,
                    results.as_mut_ptr(),
                    &mut found,
                )
                .result()
            })
        };
        // SAFETY: made above and used no more.
        let _ = unsafe { lt_result::destroy_matmul_pref(pref) };
        status.map_err(|e| err("heuristic", e))?;
        let algos: Vec<_> = results
            .iter()
            .take(found.max(0) as usize)
            .filter(|r| r.state == lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|r| r.algo)
            .collect();
        if algos.is_empty() {
            candle_core::bail!("cublasLt has no algorithm for {key:?}");
        }
        Ok(LtPlan {
            desc,
            layouts,
            algos,
        })
    }
}

/// The MoE experts on raw pointers: for each group, `out[rows] = a[rows] @ w^T` with `w`
/// `[n, k]` (one expert's weight), `a` and `out` at the group's first row. Groups with no rows
/// are skipped.
#[derive(Clone, Debug)]
pub struct GroupedGemmArgs {
    /// (a at the group's first row, that expert's w, out at the group's first row, rows)
    pub groups: Vec<(DevPtr, DevPtr, DevPtr, usize)>,
    pub a_stride: usize,
    pub w_stride: usize,
    pub out_stride: usize,
    pub n: usize,
    pub k: usize,
}

/// Runs [`GroupedGemmArgs`] as one `cublasGemmGroupedBatchedEx` (one group per expert with
/// rows, each of batch size 1). The pointer arrays go to the device in one small copy each.
pub fn grouped_gemm_raw(dev: &CudaDevice, dtype: KernelDType, g: &GroupedGemmArgs) -> Result<()> {
    let live: Vec<_> = g.groups.iter().filter(|grp| grp.3 > 0).collect();
    if live.is_empty() || g.n == 0 {
        return Ok(());
    }
    if g.a_stride < g.k || g.w_stride < g.k || g.out_stride < g.n {
        candle_core::bail!("grouped gemm: row strides shorter than the rows");
    }
    let count = live.len();
    let (n, k) = (to_int(g.n, "n")?, to_int(g.k, "k")?);
    let ms: Vec<c_int> = vec![n; count];
    let ns = live
        .iter()
        .map(|grp| to_int(grp.3, "group rows"))
        .collect::<Result<Vec<_>>>()?;
    let ks: Vec<c_int> = vec![k; count];
    let ldw = vec![to_int(g.w_stride, "w stride")?; count];
    let lda = vec![to_int(g.a_stride, "a stride")?; count];
    let ldo = vec![to_int(g.out_stride, "out stride")?; count];
    let ones: Vec<c_int> = vec![1; count];
    let trans_w = vec![cublasOperation_t::CUBLAS_OP_T; count];
    let trans_a = vec![cublasOperation_t::CUBLAS_OP_N; count];
    let alpha = vec![1f32; count];
    let beta = vec![0f32; count];
    let stream = dev.cuda_stream();
    let upload = |v: Vec<u64>| {
        stream
            .clone_htod(&v)
            .map_err(|e| candle_core::Error::Msg(format!("grouped gemm pointers: {e:?}")))
    };
    let w_ptrs = upload(live.iter().map(|grp| grp.1).collect())?;
    let a_ptrs = upload(live.iter().map(|grp| grp.0).collect())?;
    let o_ptrs = upload(live.iter().map(|grp| grp.2).collect())?;
    let ptr = |s: &cudarc::driver::CudaSlice<u64>| {
        use cudarc::driver::DevicePtr;
        s.device_ptr(&stream).0
    };
    let ty = data_type(dtype);
    let blas = dev.cublas_handle();
    // SAFETY: every array has `count` entries; the device pointer arrays live until the end of
    // this function and their frees are ordered after the call on the same stream.
    unsafe {
        cudarc::cublas::sys::cublasGemmGroupedBatchedEx(
            *blas.handle(),
            trans_w.as_ptr(),
            trans_a.as_ptr(),
            ms.as_ptr(),
            ns.as_ptr(),
            ks.as_ptr(),
            alpha.as_ptr().cast(),
            ptr(&w_ptrs) as *const *const c_void,
            ty,
            ldw.as_ptr(),
            ptr(&a_ptrs) as *const *const c_void,
            ty,
            lda.as_ptr(),
            beta.as_ptr().cast(),
            ptr(&o_ptrs) as *const *mut c_void,
            ty,
            ldo.as_ptr(),
            to_int(count, "groups")?,
            ones.as_ptr(),
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )
    }
    .result()
    .map_err(|e| {
        candle_core::Error::Msg(format!("cublasGemmGroupedBatchedEx ({count} groups): {e}"))
    })
}

/// [`GroupedGemmArgs`] as one `cublasGemmEx` per group with rows: the peer the GPU bench
/// measures the grouped call against (`gpu-bench moe-gemm`).
pub fn per_group_gemm_raw(dev: &CudaDevice, dtype: KernelDType, g: &GroupedGemmArgs) -> Result<()> {
    for &(a, w, out, rows) in g.groups.iter().filter(|grp| grp.3 > 0) {
        gemm_raw(
            dev,
            dtype,
            &GemmArgs {
                out,
                out_stride: g.out_stride,
                a,
                a_stride: g.a_stride,
                w,
                w_stride: g.w_stride,
                m: rows,
                n: g.n,
                k: g.k,
                accumulate: false,
            },
        )?;
    }
    Ok(())
}

/// The CPU form of [`gemm_into`] (f32 math, one rounding), for tests.
fn gemm_ref<T: super::Elem>(
    out: &mut [T],
    out_stride: usize,
    a: (&[T], usize),
    w: (&[T], usize),
    (m, n, k): (usize, usize, usize),
    accumulate: bool,
) {
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0f32;
            for p in 0..k {
                acc += a.0[i * a.1 + p].to_f32() * w.0[j * w.1 + p].to_f32();
            }
            let o = &mut out[i * out_stride + j];
            if accumulate {
                acc += o.to_f32();
            }
            *o = T::from_f32(acc);
        }
    }
}

struct Gemm {
    accumulate: bool,
}

fn gemm_shapes(ol: &Layout, al: &Layout, wl: &Layout) -> Result<[super::Matrix; 3]> {
    let o = super::Matrix::of(ol, "gemm out")?;
    let a = super::Matrix::of(al, "gemm a")?;
    let w = super::Matrix::with_cols(wl, a.cols, "gemm w")?;
    if o.rows != a.rows || o.cols != w.rows {
        candle_core::bail!(
            "gemm: out [{}, {}] cannot hold a [{}, {}] @ w[{}, {}]^T",
            o.rows,
            o.cols,
            a.rows,
            a.cols,
            w.rows,
            w.cols
        );
    }
    o.check_rows_disjoint("gemm out")?;
    Ok([o, a, w])
}

impl InplaceOp3 for Gemm {
    fn name(&self) -> &'static str {
        "gemm-into"
    }

    fn cpu_fwd(
        &self,
        out: &mut CpuStorage,
        ol: &Layout,
        a: &CpuStorage,
        al: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<()> {
        let [om, am, wm] = gemm_shapes(ol, al, wl)?;
        macro_rules! run {
            ($o:expr, $T:ty) => {{
                let av = am.slice(a.as_slice::<$T>()?, "a")?;
                let wv = wm.slice(w.as_slice::<$T>()?, "w")?;
                let span = om.span();
                let ov = $o.get_mut(om.offset..om.offset + span).ok_or_else(|| {
                    candle_core::Error::Msg("gemm: out outside its storage".into())
                })?;
                gemm_ref(
                    ov,
                    om.stride,
                    (av, am.stride),
                    (wv, wm.stride),
                    (am.rows, wm.rows, am.cols),
                    self.accumulate,
                );
                Ok(())
            }};
        }
        match out {
            CpuStorage::F32(o) => run!(o, f32),
            CpuStorage::F16(o) => run!(o, half::f16),
            CpuStorage::BF16(o) => run!(o, half::bf16),
            other => candle_core::bail!("gemm: no {:?} GEMM", other.dtype()),
        }
    }

    fn cuda_fwd(
        &self,
        out: &mut candle_core::CudaStorage,
        ol: &Layout,
        a: &candle_core::CudaStorage,
        al: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<()> {
        let [om, am, wm] = gemm_shapes(ol, al, wl)?;
        let dtype = KernelDType::of(out.dtype())?;
        if a.dtype() != out.dtype() || w.dtype() != out.dtype() {
            candle_core::bail!("gemm: a, w and out must share a dtype");
        }
        let dev = out.device.clone();
        gemm_raw(
            &dev,
            dtype,
            &GemmArgs {
                out: cuda::storage_ptr(out, om.offset)?,
                out_stride: om.stride,
                a: cuda::storage_ptr(a, am.offset)?,
                a_stride: am.stride,
                w: cuda::storage_ptr(w, wm.offset)?,
                w_stride: wm.stride,
                m: am.rows,
                n: wm.rows,
                k: am.cols,
                accumulate: self.accumulate,
            },
        )
    }
}

/// `out = a @ w^T`, or `out += a @ w^T` when `accumulate`, written into `out`: `[M, N]` (any
/// row stride, e.g. a window of a fused output). `a`: `[M, K]`, `w`: `[N, K]`, one dtype.
/// `out` must not share storage with `a` or `w`.
pub fn gemm_into(out: &Tensor, a: &Tensor, w: &Tensor, accumulate: bool) -> Result<()> {
    out.inplace_op3(a, w, &Gemm { accumulate })
}

/// The MoE experts: for expert e, rows `offsets[e]..offsets[e+1]` of `out` (`[R, N]`) become
/// the same rows of `a` (`[R, K]`, the tokens gathered by `moe_plan`'s `perm_token`) times
/// `weights[e]^T` (`[N, K]` each: per-expert tensors or `.get(e)` of a stacked `[E, N, K]`).
/// `counts` are the plan's counts, copied to the host once by the caller.
pub fn grouped_gemm_into(
    out: &Tensor,
    a: &Tensor,
    weights: &[&Tensor],
    counts: &[usize],
) -> Result<()> {
    if weights.len() != counts.len() {
        candle_core::bail!(
            "grouped gemm: {} weights for {} counts",
            weights.len(),
            counts.len()
        );
    }
    let dtype = KernelDType::of(out.dtype())?;
    let om = super::Matrix::of(out.layout(), "grouped gemm out")?;
    let am = super::Matrix::of(a.layout(), "grouped gemm a")?;
    let total: usize = counts.iter().sum();
    if total != am.rows || total != om.rows {
        candle_core::bail!(
            "grouped gemm: counts sum to {total}, a has {} rows, out {}",
            am.rows,
            om.rows
        );
    }
    let (n, k) = (om.cols, am.cols);
    let candle_core::Device::Cuda(dev) = out.device() else {
        candle_core::bail!("grouped gemm runs on CUDA tensors");
    };
    let elem = dtype.size() as u64;
    let (a_ptr, o_ptr) = (cuda::tensor_ptr(a)?, cuda::tensor_ptr(out)?);
    let mut groups = Vec::with_capacity(counts.len());
    let mut row = 0usize;
    let mut w_stride = None;
    for (e, (w, &rows)) in weights.iter().zip(counts).enumerate() {
        let wm = super::Matrix::with_cols(w.layout(), k, "expert weight")?;
        if wm.rows != n || w.dtype() != out.dtype() || a.dtype() != out.dtype() {
            candle_core::bail!(
                "grouped gemm: expert {e} weight {:?} {:?}, expected {:?} [{n}, {k}]",
                w.dtype(),
                w.dims(),
                out.dtype()
            );
        }
        if *w_stride.get_or_insert(wm.stride) != wm.stride {
            candle_core::bail!("grouped gemm: expert weights with different row strides");
        }
        groups.push((
            a_ptr + (row * am.stride) as u64 * elem,
            cuda::tensor_ptr(w)?,
            o_ptr + (row * om.stride) as u64 * elem,
            rows,
        ));
        row += rows;
    }
    grouped_gemm_raw(
        dev,
        dtype,
        &GroupedGemmArgs {
            groups,
            a_stride: am.stride,
            w_stride: w_stride.unwrap_or(k),
            out_stride: om.stride,
            n,
            k,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{assert_close, random, values};
    use candle_core::{DType, Device};

    #[test]
    fn gemm_into_a_window_on_the_cpu() {
        let dev = Device::Cpu;
        let a = random(&[5, 7], DType::F32, 1, &dev);
        let w = random(&[3, 7], DType::F32, 2, &dev);
        let out = Tensor::zeros((5, 10), DType::F32, &dev).unwrap();
        let window = out.narrow(1, 4, 3).unwrap();
        gemm_into(&window, &a, &w, false).unwrap();
        gemm_into(&window, &a, &w, true).unwrap();
        let want = (a.matmul(&w.t().unwrap()).unwrap() * 2.0).unwrap();
        assert_close(
            &values(&out.narrow(1, 4, 3).unwrap()),
            &values(&want),
            1e-6,
            1e-5,
            "window",
        );
        assert!(
            values(&out.narrow(1, 0, 4).unwrap())
                .iter()
                .all(|&v| v == 0.0)
        );
    }

    /// (atol, rtol) of a cuBLAS GEMM against f32 products `want`: f32 accumulation in another
    /// order (cuBLAS tiles) costs a few ulps of the largest partial sums, which reach max |out|
    /// (an element that cancels to ~0 keeps that absolute error: the tolerance is absolute in
    /// max |out|); a bf16 output one ulp more.
    fn tolerance(want: &Tensor, dtype: DType) -> (f32, f32) {
        let scale = values(want).iter().fold(0f32, |m, v| m.max(v.abs()));
        if dtype == DType::F32 {
            (1e-5 * scale.max(1.0), 1e-4)
        } else {
            (1e-2 * scale.max(1.0), 1.0 / 128.0)
        }
    }

    #[test]
    fn device_gemm_matches_reference() {
        let gpu = crate::kernels::testing::gpu();
        // Ragged, and Llama-3.1-8B's down projection at T = 2048 into a window of a wider out.
        for &(m, n, k) in &[(1, 1, 1), (37, 13, 24), (2048, 4096, 14336)] {
            for dtype in [DType::F32, DType::BF16] {
                let a = random(&[m, k], dtype, 3, &Device::Cpu);
                let w = random(&[n, k], dtype, 4, &Device::Cpu);
                let want = a
                    .to_dtype(DType::F32)
                    .unwrap()
                    .matmul(&w.to_dtype(DType::F32).unwrap().t().unwrap())
                    .unwrap();
                let out = random(&[m, n + 8], dtype, 5, &gpu); // poisoned by its random contents
                let window = out.narrow(1, 8, n).unwrap();
                gemm_into(
                    &window,
                    &a.to_device(&gpu).unwrap(),
                    &w.to_device(&gpu).unwrap(),
                    false,
                )
                .unwrap();
                let (atol, rtol) = tolerance(&want, dtype);
                assert_close(
                    &values(&window),
                    &values(&want),
                    atol,
                    rtol,
                    &format!("{m}x{n}x{k} {dtype:?}"),
                );
            }
        }
    }

    #[test]
    fn device_gemm_add_matches_reference() {
        let gpu = crate::kernels::testing::gpu();
        let Device::Cuda(dev) = &gpu else {
            unreachable!("cuda_device is a CUDA device")
        };
        // Ragged; Llama-3.1-8B's o projection at T = 2048 reading c from a window of a wider
        // buffer (a capture row block) and writing another; the same shape again (the kept plan).
        for &(m, n, k, c_pad) in &[
            (1, 1, 1, 0),
            (37, 24, 40, 8),
            (2048, 4096, 4096, 0),
            (2048, 4096, 4096, 0),
        ] {
            for dtype in [DType::F32, DType::BF16] {
                let kd = KernelDType::of(dtype).unwrap();
                let a = random(&[m, k], dtype, 3, &Device::Cpu);
                let w = random(&[n, k], dtype, 4, &Device::Cpu);
                let c = random(&[m, n + c_pad], dtype, 6, &Device::Cpu);
                let c_win = c.narrow(1, c_pad, n).unwrap();
                let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                let want =
                    (f32s(&a).matmul(&f32s(&w).t().unwrap()).unwrap() + f32s(&c_win)).unwrap();
                let (ag, wg, cg) = (
                    a.to_device(&gpu).unwrap(),
                    w.to_device(&gpu).unwrap(),
                    c.to_device(&gpu).unwrap(),
                );
                let out = random(&[m, n], dtype, 5, &gpu); // poisoned by its random contents
                let ptr = |t: &Tensor| cuda::tensor_ptr(t).unwrap();
                gemm_add_raw(
                    dev,
                    kd,
                    &GemmArgs {
                        out: ptr(&out),
                        out_stride: n,
                        a: ptr(&ag),
                        a_stride: k,
                        w: ptr(&wg),
                        w_stride: k,
                        m,
                        n,
                        k,
                        accumulate: true,
                    },
                    ptr(&cg.narrow(1, c_pad, n).unwrap()),
                    n + c_pad,
                )
                .unwrap();
                // One rounding of the sum with c, as of the product alone.
                let (atol, rtol) = tolerance(&want, dtype);
                let what = format!("{m}x{n}x{k} + c {dtype:?}");
                assert_close(&values(&out), &values(&want), atol, rtol, &what);
                // c is read, not written.
                assert_eq!(values(&cg), values(&c), "{what}: c changed");
            }
        }
    }

    #[test]
    fn device_grouped_gemm_matches_per_expert_matmuls() {
        let gpu = crate::kernels::testing::gpu();
        // DeepSeek-V3-like experts (smaller): 16 experts, one of them empty, [256, 512] weights.
        let (experts, n, k) = (16, 256, 512);
        let counts: Vec<usize> = (0..experts)
            .map(|e| if e == 3 { 0 } else { (e * 37) % 50 + 1 })
            .collect();
        let rows: usize = counts.iter().sum();
        let a = random(&[rows, k], DType::BF16, 6, &gpu);
        let stacked = random(&[experts, n, k], DType::BF16, 7, &gpu);
        let ws: Vec<Tensor> = (0..experts).map(|e| stacked.get(e).unwrap()).collect();
        let out = random(&[rows, n], DType::BF16, 8, &gpu);
        grouped_gemm_into(&out, &a, &ws.iter().collect::<Vec<_>>(), &counts).unwrap();
        let mut row = 0;
        for (e, &c) in counts.iter().enumerate() {
            if c == 0 {
                continue;
            }
            let want = a
                .narrow(0, row, c)
                .unwrap()
                .matmul(&ws[e].t().unwrap())
                .unwrap();
            let got = out.narrow(0, row, c).unwrap();
            // Both are cuBLAS bf16 GEMMs with f32 accumulation: one bf16 ulp apart at most.
            assert_close(
                &values(&got),
                &values(&want),
                1e-2,
                1.0 / 128.0,
                &format!("expert {e}"),
            );
            row += c;
        }
    }
}
