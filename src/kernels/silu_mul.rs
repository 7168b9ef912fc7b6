//! The SwiGLU gate (kernels/silu_mul.cu): `out = T(silu(gate) * up)` in f32, one rounding.

use super::{Elem, Matrix, with_float_type};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, WithDType};

/// The CPU reference. `gate`, `up`: `[rows, cols]` at their row strides; returns a contiguous
/// `[rows, cols]`.
pub fn silu_mul_ref<T: Elem>(
    gate: &[T],
    g_stride: usize,
    up: &[T],
    u_stride: usize,
    rows: usize,
    cols: usize,
) -> Vec<T> {
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let g = gate[r * g_stride + c].to_f32();
            let u = up[r * u_stride + c].to_f32();
            out.push(T::from_f32(g / (1.0 + (-g).exp()) * u));
        }
    }
    out
}

fn shapes(gl: &Layout, ul: &Layout) -> Result<(Matrix, Matrix)> {
    let g = Matrix::of(gl, "silu_mul gate")?;
    let u = Matrix::with_cols(ul, g.cols, "silu_mul up")?;
    if u.rows != g.rows {
        candle_core::bail!("silu_mul: gate has {} rows, up {}", g.rows, u.rows);
    }
    Ok((g, u))
}

struct SiluMul;

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    fn cpu_fwd(
        &self,
        g: &CpuStorage,
        gl: &Layout,
        u: &CpuStorage,
        ul: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (gm, um) = shapes(gl, ul)?;
        with_float_type!(g.dtype(), T => {
            let gs = gm.slice(g.as_slice::<T>()?, "gate")?;
            let us = um.slice(u.as_slice::<T>()?, "up")?;
            let out = silu_mul_ref(gs, gm.stride, us, um.stride, gm.rows, gm.cols);
            Ok((T::to_cpu_storage_owned(out), Shape::from((gm.rows, gm.cols))))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        gl: &Layout,
        u: &candle_core::CudaStorage,
        ul: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::{self, storage_ptr};
        let (gm, um) = shapes(gl, ul)?;
        let dtype = g.dtype();
        let out = cuda::alloc(&g.device, dtype, gm.rows * gm.cols)?;
        launch::silu_mul(
            &g.device,
            super::KernelDType::of(dtype)?,
            &launch::SiluMulArgs {
                gate: storage_ptr(g, gm.offset)?,
                g_stride: gm.stride,
                up: storage_ptr(u, um.offset)?,
                u_stride: um.stride,
                out: storage_ptr(&out, 0)?,
                o_stride: gm.cols,
                rows: gm.rows,
                cols: gm.cols,
            },
        )?;
        Ok((out, Shape::from((gm.rows, gm.cols))))
    }
}

/// `silu(gate) * up` for `[rows, cols]` inputs of one dtype (any row strides: the two halves
/// of a fused gate/up projection work as they are). Returns a contiguous `[rows, cols]`.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dtype() != up.dtype() {
        candle_core::bail!("silu_mul: gate is {:?}, up {:?}", gate.dtype(), up.dtype());
    }
    gate.apply_op2_no_bwd(up, &SiluMul)
}

/// The launch of `silu_mul_*` and `silu_mul_vec_*` (kernels/silu_mul.cu) from raw device pointers:
/// its arguments and the launch on the device's stream. The candle op above calls it, and so does
/// the runner's forward (`model::fast`).
#[cfg(feature = "cuda")]
pub mod launch {
    use crate::kernels::cuda::{DevPtr, Module, cfg, function, grid_dim, launch, row_threads};
    use crate::kernels::{KernelDType, to_i32, to_i64};
    use candle_core::Result;
    use candle_core::cuda_backend::CudaDevice;

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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{assert_close, random, values};
    use candle_core::{DType, Device};

    const SHAPES: &[(usize, usize)] = &[(1, 1), (37, 13), (4, 64), (3, 14336)];

    #[test]
    fn reference_matches_candle() {
        let dev = Device::Cpu;
        for &(rows, cols) in SHAPES {
            for dtype in [DType::F32, DType::BF16] {
                // gate and up as the two halves of one fused [rows, 2 * cols] output.
                let gu = random(&[rows, 2 * cols], dtype, 1, &dev);
                let (g, u) = (
                    gu.narrow(1, 0, cols).unwrap(),
                    gu.narrow(1, cols, cols).unwrap(),
                );
                let got = silu_mul(&g, &u).unwrap();
                let want = (g.silu().unwrap() * &u).unwrap();
                // f32: the same operations (candle's silu is v / (1 + exp(-v))): exact.
                // bf16: candle rounds silu(g) before the product, the reference does not: one
                // bf16 ulp (2^-7 relative at worst) in the factor and one in the result.
                let rtol = if dtype == DType::F32 { 0.0 } else { 1.0 / 64.0 };
                assert_close(&values(&got), &values(&want), 0.0, rtol, "silu_mul");
            }
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_matches_reference() {
        let gpu = crate::kernels::testing::gpu();
        let cpu = Device::Cpu;
        let mut shapes = SHAPES.to_vec();
        shapes.push((2048, 14336)); // Llama-3.1-8B MLP at T = 2048
        let mut kernels = std::collections::BTreeSet::new();
        for (rows, cols) in shapes {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let gu = random(&[rows, 2 * cols], dtype, 2, &cpu);
                let want = silu_mul(
                    &gu.narrow(1, 0, cols).unwrap(),
                    &gu.narrow(1, cols, cols).unwrap(),
                )
                .unwrap();
                let gug = gu.to_device(&gpu).unwrap();
                let (g, u) = (
                    gug.narrow(1, 0, cols).unwrap(),
                    gug.narrow(1, cols, cols).unwrap(),
                );
                let ptr = |t: &Tensor| crate::kernels::cuda::tensor_ptr(t).unwrap();
                let args = crate::kernels::silu_mul::launch::SiluMulArgs {
                    gate: ptr(&g),
                    g_stride: 2 * cols,
                    up: ptr(&u),
                    u_stride: 2 * cols,
                    out: 0, // the op's own fresh, aligned output
                    o_stride: cols,
                    rows,
                    cols,
                };
                let kd = crate::kernels::KernelDType::of(dtype).unwrap();
                kernels.insert(format!(
                    "{:?}",
                    crate::kernels::silu_mul::launch::silu_kernel(kd, &args)
                ));
                let got = silu_mul(&g, &u).unwrap();
                // CUDA's expf is within 2 ulp of the CPU's exp: a few f32 ulps, at most one
                // ulp of a 16-bit dtype.
                let rtol = match dtype {
                    DType::F32 => 1e-6,
                    DType::F16 => 1.0 / 1024.0,
                    _ => 1.0 / 128.0,
                };
                assert_close(
                    &values(&got),
                    &values(&want),
                    1e-7,
                    rtol,
                    &format!("{rows}x{cols} {dtype:?}"),
                );
            }
        }
        // The aligned shapes (Llama's among them) take the flat kernel, the ragged ones the
        // per-row kernel.
        assert_eq!(
            kernels.into_iter().collect::<Vec<_>>(),
            ["Flat", "Row"],
            "both SiLU-mul kernels ran"
        );
    }
}
