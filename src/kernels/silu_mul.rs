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
        cuda::silu_mul(
            &g.device,
            super::KernelDType::of(dtype)?,
            &cuda::SiluMulArgs {
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
                let args = crate::kernels::cuda::SiluMulArgs {
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
                    crate::kernels::cuda::silu_kernel(kd, &args)
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
