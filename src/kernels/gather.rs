//! Row gather (kernels/gather.cu): `dst[r] = src[idx[r]]`, the embedding lookup and the MoE
//! token gather.

use super::{Matrix, with_float_type};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, WithDType};

/// The CPU reference. `src`: `[src_rows, cols]` at `src_stride`; returns `[idx.len(), cols]`.
/// An index outside `0..src_rows` is an error (the kernel, which cannot return one, writes a
/// NaN row instead).
pub fn gather_rows_ref<T: Copy>(
    src: &[T],
    src_stride: usize,
    src_rows: usize,
    cols: usize,
    idx: &[u32],
) -> Result<Vec<T>> {
    let mut out = Vec::with_capacity(idx.len() * cols);
    for &i in idx {
        let i = i as usize;
        if i >= src_rows {
            candle_core::bail!("gather_rows: index {i} outside 0..{src_rows}");
        }
        out.extend_from_slice(&src[i * src_stride..i * src_stride + cols]);
    }
    Ok(out)
}

/// The indices as u32 (u32 as they are, i32 reinterpreted: negatives become out of range).
fn indices(storage: &CpuStorage, m: &Matrix) -> Result<Vec<u32>> {
    Ok(match storage {
        CpuStorage::U32(v) => m.slice(v, "idx")?.to_vec(),
        CpuStorage::I32(v) => m.slice(v, "idx")?.iter().map(|&i| i as u32).collect(),
        other => candle_core::bail!(
            "gather_rows: indices must be u32 or i32, found {:?}",
            other.dtype()
        ),
    })
}

fn shapes(sl: &Layout, il: &Layout) -> Result<(Matrix, Matrix)> {
    let s = Matrix::of(sl, "gather_rows src")?;
    let i = Matrix::of(il, "gather_rows idx")?;
    if il.dims().len() != 1 {
        candle_core::bail!(
            "gather_rows: idx must be rank 1, found shape {:?}",
            il.dims()
        );
    }
    Ok((s, i))
}

struct GatherRows;

impl CustomOp2 for GatherRows {
    fn name(&self) -> &'static str {
        "gather-rows"
    }

    fn cpu_fwd(
        &self,
        src: &CpuStorage,
        sl: &Layout,
        idx: &CpuStorage,
        il: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (sm, im) = shapes(sl, il)?;
        let idx = indices(idx, &im)?;
        with_float_type!(src.dtype(), T => {
            let s = sm.slice(src.as_slice::<T>()?, "src")?;
            let out = gather_rows_ref(s, sm.stride, sm.rows, sm.cols, &idx)?;
            Ok((T::to_cpu_storage_owned(out), Shape::from((idx.len(), sm.cols))))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        src: &candle_core::CudaStorage,
        sl: &Layout,
        idx: &candle_core::CudaStorage,
        il: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::{self, storage_ptr};
        let (sm, im) = shapes(sl, il)?;
        if !matches!(
            idx.dtype(),
            candle_core::DType::U32 | candle_core::DType::I32
        ) {
            candle_core::bail!(
                "gather_rows: indices must be u32 or i32, found {:?}",
                idx.dtype()
            );
        }
        let rows = im.cols; // a rank-1 index tensor is one row of `len` columns
        let dtype = src.dtype();
        let out = cuda::alloc(&src.device, dtype, rows * sm.cols)?;
        launch::gather_rows(
            &src.device,
            super::KernelDType::of(dtype)?,
            &launch::GatherArgs {
                src: storage_ptr(src, sm.offset)?,
                src_stride: sm.stride,
                src_rows: sm.rows,
                idx: storage_ptr(idx, im.offset)?,
                dst: storage_ptr(&out, 0)?,
                dst_stride: sm.cols,
                rows,
                cols: sm.cols,
            },
        )?;
        Ok((out, Shape::from((rows, sm.cols))))
    }
}

/// Rows `idx` (u32 or i32, rank 1) of `src`: `[src_rows, cols]` (any row stride). Returns a
/// contiguous `[idx.len(), cols]`. On the GPU an out-of-range index gives a NaN row; on the CPU,
/// an error.
pub fn gather_rows(src: &Tensor, idx: &Tensor) -> Result<Tensor> {
    src.apply_op2_no_bwd(idx, &GatherRows)
}

/// The launch of `gather_rows_*` (kernels/gather.cu) from raw device pointers: its arguments and
/// the launch on the device's stream. The candle op above calls it, and so does the runner's
/// forward (`model::fast`).
#[cfg(feature = "cuda")]
pub mod launch {
    use crate::kernels::cuda::{DevPtr, Module, cfg, function, grid_dim, launch, row_threads};
    use crate::kernels::{KernelDType, to_i32, to_i64};
    use candle_core::Result;
    use candle_core::cuda_backend::CudaDevice;

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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{random, values};
    use candle_core::{DType, Device};

    fn index(n: usize, src_rows: usize, seed: u32) -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed)) % src_rows as u32)
            .collect()
    }

    #[test]
    fn reference_matches_candle() {
        let dev = Device::Cpu;
        for &(src_rows, cols, n) in &[(1, 1, 1), (50, 13, 37), (128, 64, 300)] {
            for dtype in [DType::F32, DType::BF16] {
                let src = random(&[src_rows, cols + 3], dtype, 1, &dev)
                    .narrow(1, 2, cols)
                    .unwrap();
                let idx = Tensor::new(index(n, src_rows, 7).as_slice(), &dev).unwrap();
                let got = gather_rows(&src, &idx).unwrap();
                let want = src.contiguous().unwrap().index_select(&idx, 0).unwrap();
                assert_eq!(values(&got), values(&want));
                let as_i32 = idx.to_dtype(DType::I32).unwrap();
                assert_eq!(values(&gather_rows(&src, &as_i32).unwrap()), values(&want));
            }
        }
        let src = random(&[4, 2], DType::F32, 1, &dev);
        let bad = Tensor::new(&[1u32, 4], &dev).unwrap();
        assert!(
            gather_rows(&src, &bad)
                .unwrap_err()
                .to_string()
                .contains("index 4")
        );
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_matches_reference() {
        let gpu = crate::kernels::testing::gpu();
        let cpu = Device::Cpu;
        // Tiny ragged rows, a Llama-3.1-8B embedding lookup at T = 2048 (from a 4096-row slice of
        // the table), a DeepSeek MoE token gather (T * K = 16384 rows of 7168).
        for &(src_rows, cols, n) in &[
            (1, 1, 1),
            (50, 13, 37),
            (4096, 4096, 2048),
            (2048, 7168, 16384),
        ] {
            for dtype in [DType::F32, DType::BF16] {
                let src = random(&[src_rows, cols], dtype, 3, &cpu);
                let idx = Tensor::new(index(n, src_rows, 11).as_slice(), &cpu).unwrap();
                let want = gather_rows(&src, &idx).unwrap();
                let got = gather_rows(&src.to_device(&gpu).unwrap(), &idx.to_device(&gpu).unwrap())
                    .unwrap();
                assert_eq!(
                    values(&got),
                    values(&want),
                    "{src_rows}x{cols} x{n} {dtype:?}"
                );
            }
        }
        // An out-of-range index is a NaN row, not a fault.
        let src = random(&[4, 8], DType::F32, 1, &gpu);
        let idx = Tensor::new(&[1u32, 9], &gpu).unwrap();
        let got = values(&gather_rows(&src, &idx).unwrap());
        assert!(got[..8].iter().all(|v| v.is_finite()) && got[8..].iter().all(|v| v.is_nan()));
    }
}
