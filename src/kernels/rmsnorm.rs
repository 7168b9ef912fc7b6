//! Residual add fused with RMSNorm (kernels/rmsnorm.cu): `resid = T(x + delta)`,
//! `normed = T(T(resid / sqrt(mean(resid^2) + eps)) * w)`, as HF `LlamaRMSNorm` computes it
//! after the decoder's residual add.

use super::{Elem, Matrix, round_to, with_float_type};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, WithDType};

/// The CPU reference. `x`: `[rows, cols]` at row stride `x_stride`; `delta`: the same shape at
/// its own stride, or none; `w`: `[cols]`. Returns `(resid, normed)`, both contiguous
/// `[rows, cols]` (`resid` is `x` itself, copied, when there is no delta).
pub fn add_rms_norm_ref<T: Elem>(
    x: &[T],
    x_stride: usize,
    delta: Option<(&[T], usize)>,
    w: &[T],
    rows: usize,
    cols: usize,
    eps: f32,
) -> (Vec<T>, Vec<T>) {
    let mut resid = Vec::with_capacity(rows * cols);
    let mut normed = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let row: Vec<f32> = (0..cols)
            .map(|c| {
                let v = x[r * x_stride + c].to_f32();
                match delta {
                    Some((d, ds)) => round_to::<T>(v + d[r * ds + c].to_f32()),
                    None => v,
                }
            })
            .collect();
        let ss: f32 = row.iter().map(|v| v * v).sum();
        let inv = 1.0 / (ss / cols as f32 + eps).sqrt();
        resid.extend(row.iter().map(|&v| T::from_f32(v)));
        normed.extend(
            row.iter()
                .zip(w)
                .map(|(&v, &wc)| T::from_f32(round_to::<T>(v * inv) * wc.to_f32())),
        );
    }
    (resid, normed)
}

/// `x`, optional `delta` and `w` checked against each other.
fn shapes(
    x: &Layout,
    delta: Option<&Layout>,
    w: &Layout,
) -> Result<(Matrix, Option<Matrix>, Matrix)> {
    let xm = Matrix::of(x, "rms_norm x")?;
    let dm = delta
        .map(|d| Matrix::with_cols(d, xm.cols, "rms_norm delta"))
        .transpose()?;
    if let Some(d) = dm
        && d.rows != xm.rows
    {
        candle_core::bail!("rms_norm: x has {} rows, delta {}", xm.rows, d.rows);
    }
    let wm = Matrix::with_cols(w, xm.cols, "rms_norm weight")?;
    if wm.rows != 1 {
        candle_core::bail!(
            "rms_norm: the weight must be [{}], found {} rows",
            xm.cols,
            wm.rows
        );
    }
    Ok((xm, dm, wm))
}

/// The candle op: output `[rows, cols]` (normed) without a delta, `[2, rows, cols]`
/// (resid, normed) with one.
struct AddRmsNorm {
    eps: f32,
}

impl AddRmsNorm {
    fn cpu(
        &self,
        x: (&CpuStorage, &Layout),
        delta: Option<(&CpuStorage, &Layout)>,
        w: (&CpuStorage, &Layout),
    ) -> Result<(CpuStorage, Shape)> {
        let (xm, dm, wm) = shapes(x.1, delta.map(|d| d.1), w.1)?;
        with_float_type!(x.0.dtype(), T => {
            let xs = xm.slice(x.0.as_slice::<T>()?, "x")?;
            let ws = wm.slice(w.0.as_slice::<T>()?, "w")?;
            let ds = match (delta, dm) {
                (Some((d, _)), Some(m)) => Some((m.slice(d.as_slice::<T>()?, "delta")?, m.stride)),
                _ => None,
            };
            let (resid, normed) =
                add_rms_norm_ref(xs, xm.stride, ds, ws, xm.rows, xm.cols, self.eps);
            if ds.is_some() {
                let mut both = resid;
                both.extend(normed);
                Ok((T::to_cpu_storage_owned(both), Shape::from((2, xm.rows, xm.cols))))
            } else {
                Ok((T::to_cpu_storage_owned(normed), Shape::from((xm.rows, xm.cols))))
            }
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        x: (&candle_core::CudaStorage, &Layout),
        delta: Option<(&candle_core::CudaStorage, &Layout)>,
        w: (&candle_core::CudaStorage, &Layout),
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::{self, storage_ptr};
        let (xm, dm, wm) = shapes(x.1, delta.map(|d| d.1), w.1)?;
        let dtype = x.0.dtype();
        let kd = super::KernelDType::of(dtype)?;
        let dev = &x.0.device;
        let n = xm.rows * xm.cols;
        let out = cuda::alloc(dev, dtype, if delta.is_some() { 2 * n } else { n })?;
        let base = storage_ptr(&out, 0)?;
        let delta_ptr = match (delta, dm) {
            (Some((d, _)), Some(m)) => Some((storage_ptr(d, m.offset)?, m.stride)),
            _ => None,
        };
        let (resid, normed, shape) = match delta_ptr {
            Some(_) => (
                Some((base, xm.cols)),
                base + (n * kd.size()) as u64,
                Shape::from((2, xm.rows, xm.cols)),
            ),
            None => (None, base, Shape::from((xm.rows, xm.cols))),
        };
        launch::add_rmsnorm(
            dev,
            kd,
            &launch::RmsNormArgs {
                x: storage_ptr(x.0, xm.offset)?,
                x_stride: xm.stride,
                delta: delta_ptr,
                w: storage_ptr(w.0, wm.offset)?,
                resid,
                normed,
                normed_stride: xm.cols,
                rows: xm.rows,
                cols: xm.cols,
                eps: self.eps,
            },
        )?;
        Ok((out, shape))
    }
}

impl CustomOp2 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu((x, xl), None, (w, wl))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda((x, xl), None, (w, wl))
    }
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        d: &CpuStorage,
        dl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu((x, xl), Some((d, dl)), (w, wl))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        d: &candle_core::CudaStorage,
        dl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda((x, xl), Some((d, dl)), (w, wl))
    }
}

fn same_dtype(ts: &[&Tensor], what: &str) -> Result<()> {
    let d = ts[0].dtype();
    if let Some(t) = ts.iter().find(|t| t.dtype() != d) {
        candle_core::bail!("{what}: mixed dtypes {d:?} and {:?}", t.dtype());
    }
    Ok(())
}

/// RMSNorm of `x`: `[rows, cols]` (any row stride) with weight `w`: `[cols]`, same dtype.
/// Returns a contiguous `[rows, cols]`.
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    same_dtype(&[x, w], "rms_norm")?;
    x.apply_op2_no_bwd(w, &AddRmsNorm { eps: eps as f32 })
}

/// The decoder's residual add and the next norm in one pass: `resid = x + delta` (rounded to
/// the dtype, as HF adds) and `normed = rms_norm(resid)`. Without `delta`, `resid` is `x`.
/// `x`, `delta`: `[rows, cols]` (any row strides), `w`: `[cols]`, one dtype.
pub fn add_rms_norm(
    x: &Tensor,
    delta: Option<&Tensor>,
    w: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    let op = AddRmsNorm { eps: eps as f32 };
    match delta {
        None => Ok((x.clone(), rms_norm(x, w, eps)?)),
        Some(d) => {
            same_dtype(&[x, d, w], "add_rms_norm")?;
            let both = x.apply_op3_no_bwd(d, w, &op)?;
            Ok((both.get(0)?, both.get(1)?))
        }
    }
}

/// The launch of `add_rmsnorm_*` (kernels/rmsnorm.cu) from raw device pointers: its arguments and
/// the launch on the device's stream. The candle op above calls it, and so do the runner's forward
/// (`model::fast`) and DeepSeek's MLA on its own buffers.
#[cfg(feature = "cuda")]
pub mod launch {
    use crate::kernels::cuda::{DevPtr, Module, cfg, function, grid_dim, launch, row_threads};
    use crate::kernels::{KernelDType, to_i32, to_i64};
    use candle_core::Result;
    use candle_core::cuda_backend::CudaDevice;

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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{assert_close, random, values};
    use candle_core::{D, DType, Device};

    /// HF's LlamaRMSNorm as plain candle ops, independent of the kernel: normalise in f32,
    /// round to the dtype, times the weight.
    fn candle_rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
        let dtype = x.dtype();
        let x = x.to_dtype(DType::F32).unwrap();
        let var = x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
        let normed = x
            .broadcast_div(&(var + eps).unwrap().sqrt().unwrap())
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        normed.broadcast_mul(w).unwrap()
    }

    /// Ragged and realistic widths: a warp, not a multiple of 8 (scalar path), hidden sizes.
    const SHAPES: &[(usize, usize)] = &[(1, 16), (37, 24), (5, 100), (3, 4096), (2, 7168)];

    #[test]
    fn reference_matches_candle() {
        let dev = Device::Cpu;
        for &(rows, cols) in SHAPES {
            for dtype in [DType::F32, DType::BF16] {
                // A column window of a wider matrix with a row offset: strides and offsets count.
                let wide = random(&[rows + 1, cols + 5], dtype, 1, &dev);
                let x = wide.narrow(0, 1, rows).unwrap().narrow(1, 3, cols).unwrap();
                let delta = random(&[rows, cols], dtype, 2, &dev);
                let w = random(&[cols], dtype, 3, &dev);
                let (resid, normed) = add_rms_norm(&x, Some(&delta), &w, 1e-6).unwrap();
                let want_resid = (&x + &delta).unwrap();
                // The residual add is one rounding of the f32 sum in both: exact.
                assert_eq!(
                    values(&resid),
                    values(&want_resid),
                    "resid {rows}x{cols} {dtype:?}"
                );
                let want = candle_rms_norm(&want_resid, &w, 1e-6);
                // candle divides by sqrt where the reference multiplies by 1/sqrt (as HF's
                // rsqrt): one f32 ulp, which can move the normalised value one bf16 ulp (2^-7
                // relative at worst) and the product with the weight one more.
                let rtol = if dtype == DType::F32 {
                    2e-6
                } else {
                    1.0 / 64.0
                };
                assert_close(&values(&normed), &values(&want), 0.0, rtol, "normed");
                let plain = rms_norm(&x, &w, 1e-6).unwrap();
                let want_plain = candle_rms_norm(&x, &w, 1e-6);
                assert_close(&values(&plain), &values(&want_plain), 0.0, rtol, "plain");
            }
        }
    }

    #[test]
    fn refuses_a_transposed_input() {
        let x = random(&[8, 4], DType::F32, 1, &Device::Cpu).t().unwrap();
        let w = random(&[8], DType::F32, 2, &Device::Cpu);
        let err = rms_norm(&x, &w, 1e-6).unwrap_err().to_string();
        assert!(err.contains("unit stride"), "{err}");
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_matches_reference() {
        let gpu = crate::kernels::testing::gpu();
        let cpu = Device::Cpu;
        let mut shapes = SHAPES.to_vec();
        shapes.push((2048, 4096)); // Llama-3.1-8B at T = 2048
        for (rows, cols) in shapes {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let wide = random(&[rows, cols + 8], dtype, 4, &cpu);
                let x = wide.narrow(1, 8, cols).unwrap();
                let delta = random(&[rows, cols], dtype, 5, &cpu);
                let w = random(&[cols], dtype, 6, &cpu);
                let (r_cpu, n_cpu) = add_rms_norm(&x, Some(&delta), &w, 1e-5).unwrap();
                let xg = wide.to_device(&gpu).unwrap().narrow(1, 8, cols).unwrap();
                let (dg, wg) = (delta.to_device(&gpu).unwrap(), w.to_device(&gpu).unwrap());
                let (r_gpu, n_gpu) = add_rms_norm(&xg, Some(&dg), &wg, 1e-5).unwrap();
                let what = format!("{rows}x{cols} {dtype:?}");
                // The residual add is one rounding on both sides: exact.
                assert_eq!(values(&r_gpu), values(&r_cpu), "resid {what}");
                // The sum of squares is reduced in another order: a few f32 ulps in 1/rms,
                // at most one ulp of the dtype after rounding.
                let rtol = if dtype == DType::F32 {
                    1e-5
                } else {
                    1.0 / 64.0
                };
                assert_close(&values(&n_gpu), &values(&n_cpu), 0.0, rtol, &what);
                let plain = rms_norm(&xg, &wg, 1e-5).unwrap();
                let plain_cpu = rms_norm(&x, &w, 1e-5).unwrap();
                assert_close(&values(&plain), &values(&plain_cpu), 0.0, rtol, &what);
            }
        }
    }
}
