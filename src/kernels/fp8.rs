//! FP8 block dequantisation (kernels/fp8_dequant.cu): `out = T(e4m3(w) * scale_inv[block])`,
//! the GPU form of [`crate::model::fp8::dequantize_blocks_with`].

use super::{Elem, Matrix, with_float_type};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};

/// One E4M3 ("fn": bias 7, no infinities, NaN = 0x7f and 0xff) byte as f32, exactly.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = u32::from(b & 0x80) << 24;
    let (e, m) = (u32::from(b >> 3) & 0xf, u32::from(b & 7));
    if e == 15 && m == 7 {
        return f32::from_bits(0x7fc0_0000 | sign);
    }
    if e == 0 {
        let v = m as f32 * 2f32.powi(-9); // subnormal
        return if sign != 0 { -v } else { v };
    }
    f32::from_bits(sign | ((e + 120) << 23) | (m << 20))
}

/// The CPU reference. `w`: `[rows, cols]` E4M3 bytes; `scale_inv`: `[ceil(rows / br),
/// ceil(cols / bc)]`; both contiguous. The product is one f32 rounding, then one to `T`.
pub fn fp8_dequant_ref<T: Elem>(
    w: &[u8],
    scale_inv: &[f32],
    rows: usize,
    cols: usize,
    block: [usize; 2],
) -> Vec<T> {
    let [br, bc] = block;
    let scale_cols = cols.div_ceil(bc);
    (0..rows * cols)
        .map(|i| {
            let (r, c) = (i / cols, i % cols);
            T::from_f32(e4m3_to_f32(w[i]) * scale_inv[(r / br) * scale_cols + c / bc])
        })
        .collect()
}

struct Fp8Dequant {
    block: [usize; 2],
    dtype: DType,
}

impl Fp8Dequant {
    fn shapes(&self, wl: &Layout, sl: &Layout) -> Result<(Matrix, Matrix)> {
        let [br, bc] = self.block;
        if br == 0 || bc == 0 {
            candle_core::bail!("fp8_dequant: block {br}x{bc} must be positive");
        }
        let w = Matrix::of(wl, "fp8 weight")?;
        let s = Matrix::of(sl, "fp8 scale_inv")?;
        let want = (w.rows.div_ceil(br), w.cols.div_ceil(bc));
        if (s.rows, s.cols) != want {
            candle_core::bail!(
                "fp8_dequant: scale_inv {}x{} does not tile a {}x{} weight in {br}x{bc} blocks \
                 (expected {}x{})",
                s.rows,
                s.cols,
                w.rows,
                w.cols,
                want.0,
                want.1
            );
        }
        if !wl.is_contiguous() || !sl.is_contiguous() {
            candle_core::bail!("fp8_dequant: weight and scale_inv must be contiguous");
        }
        Ok((w, s))
    }
}

impl CustomOp2 for Fp8Dequant {
    fn name(&self) -> &'static str {
        "fp8-dequant"
    }

    fn cpu_fwd(
        &self,
        w: &CpuStorage,
        wl: &Layout,
        s: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (wm, sm) = self.shapes(wl, sl)?;
        let bytes: Vec<u8> = match w {
            CpuStorage::U8(v) => wm.slice(v, "fp8 weight")?.to_vec(),
            CpuStorage::F8E4M3(v) => wm
                .slice(v, "fp8 weight")?
                .iter()
                .map(|f| f.to_bits())
                .collect(),
            other => candle_core::bail!(
                "fp8_dequant: weight must be F8E4M3 or U8, found {:?}",
                other.dtype()
            ),
        };
        let scale = sm.slice(s.as_slice::<f32>()?, "scale_inv")?;
        with_float_type!(self.dtype, T => {
            let out = fp8_dequant_ref::<T>(&bytes, scale, wm.rows, wm.cols, self.block);
            Ok((T::to_cpu_storage_owned(out), Shape::from((wm.rows, wm.cols))))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        w: &candle_core::CudaStorage,
        wl: &Layout,
        s: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use super::cuda::{self, storage_ptr};
        let (wm, sm) = self.shapes(wl, sl)?;
        if !matches!(w.dtype(), DType::U8 | DType::F8E4M3) || s.dtype() != DType::F32 {
            candle_core::bail!("fp8_dequant: expected F8E4M3/U8 weight and f32 scale_inv");
        }
        let out = cuda::alloc(&w.device, self.dtype, wm.rows * wm.cols)?;
        launch::fp8_dequant(
            &w.device,
            super::KernelDType::of(self.dtype)?,
            &launch::Fp8Args {
                w: storage_ptr(w, wm.offset)?,
                scale_inv: storage_ptr(s, sm.offset)?,
                out: storage_ptr(&out, 0)?,
                rows: wm.rows,
                cols: wm.cols,
                block_rows: self.block[0],
                block_cols: self.block[1],
            },
        )?;
        Ok((out, Shape::from((wm.rows, wm.cols))))
    }
}

/// Dequantises `w`: `[rows, cols]` F8E4M3 (or its raw bytes as U8) with `scale_inv`:
/// `[ceil(rows / block[0]), ceil(cols / block[1])]` (converted to f32 if it is not) into
/// `dtype` (f32, f16 or bf16). Equals `model::fp8::dequantize_blocks_with` in f32, bit for bit.
pub fn fp8_dequant(
    w: &Tensor,
    scale_inv: &Tensor,
    block: [usize; 2],
    dtype: DType,
) -> Result<Tensor> {
    super::KernelDType::of(dtype)?;
    let scale = scale_inv.to_dtype(DType::F32)?.contiguous()?;
    w.contiguous()?
        .apply_op2_no_bwd(&scale, &Fp8Dequant { block, dtype })
}

/// The launch of `fp8_dequant_*` (kernels/fp8_dequant.cu) from raw device pointers: its arguments
/// and the launch on the device's stream. The candle op above calls it.
#[cfg(feature = "cuda")]
pub mod launch {
    use crate::kernels::cuda::{DevPtr, Module, cfg, function, grid_dim, launch};
    use crate::kernels::{KernelDType, to_i32};
    use candle_core::Result;
    use candle_core::cuda_backend::CudaDevice;

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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{random, values};
    use crate::model::fp8::dequantize_blocks_with;
    use candle_core::Device;

    fn all_bytes_weight(rows: usize, cols: usize, dev: &Device) -> Tensor {
        let bytes: Vec<u8> = (0..rows * cols).map(|i| (i * 37 % 256) as u8).collect();
        Tensor::from_raw_buffer(&bytes, DType::F8E4M3, &[rows, cols], dev).unwrap()
    }

    #[test]
    fn decode_matches_float8_for_every_byte() {
        let bytes: Vec<u8> = (0..=255).collect();
        let w = Tensor::from_raw_buffer(&bytes, DType::F8E4M3, &[256], &Device::Cpu).unwrap();
        for (b, want) in bytes.iter().zip(values(&w)) {
            let got = e4m3_to_f32(*b);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "byte {b:#04x}: {got} vs {want}"
            );
        }
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    #[test]
    fn reference_matches_model_fp8() {
        let dev = Device::Cpu;
        for &(rows, cols, block) in &[(7, 8, [2, 128]), (130, 300, [128, 128]), (5, 5, [3, 2])] {
            let w = all_bytes_weight(rows, cols, &dev);
            let scale = random(
                &[rows.div_ceil(block[0]), cols.div_ceil(block[1])],
                DType::F32,
                3,
                &dev,
            );
            let want = values(&dequantize_blocks_with(&w, &scale, block).unwrap());
            let got = values(&fp8_dequant(&w, &scale, block, DType::F32).unwrap());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "element {i}: {g} vs {w}"
                );
            }
            // The raw bytes as U8 read the same.
            let (raw, _) = w.storage_and_layout();
            let bytes: Vec<u8> = match &*raw {
                candle_core::Storage::Cpu(CpuStorage::F8E4M3(v)) => {
                    v.iter().map(|f| f.to_bits()).collect()
                }
                _ => unreachable!("a CPU F8E4M3 tensor"),
            };
            drop(raw);
            let u8w = Tensor::from_vec(bytes, (rows, cols), &dev).unwrap();
            let again = values(&fp8_dequant(&u8w, &scale, block, DType::BF16).unwrap());
            let want_bf16: Vec<f32> = want
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect();
            for (g, w) in again.iter().zip(&want_bf16) {
                assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()));
            }
        }
        let w = all_bytes_weight(4, 4, &dev);
        let scale = random(&[2, 2], DType::F32, 1, &dev);
        assert!(fp8_dequant(&w, &scale, [128, 128], DType::F32).is_err());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_matches_reference() {
        let gpu = crate::kernels::testing::gpu();
        let cpu = Device::Cpu;
        // Ragged blocks, and DeepSeek-V3 kv_a_proj_with_mqa [576, 7168] in 128x128 blocks.
        for &(rows, cols, block) in &[
            (7, 8, [2, 128]),
            (130, 300, [128, 128]),
            (576, 7168, [128, 128]),
        ] {
            let w = all_bytes_weight(rows, cols, &cpu);
            let scale = random(
                &[rows.div_ceil(block[0]), cols.div_ceil(block[1])],
                DType::F32,
                5,
                &cpu,
            );
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let want = values(&fp8_dequant(&w, &scale, block, dtype).unwrap());
                let got = values(
                    &fp8_dequant(
                        &w.to_device(&gpu).unwrap(),
                        &scale.to_device(&gpu).unwrap(),
                        block,
                        dtype,
                    )
                    .unwrap(),
                );
                // Exact decode, one f32 product, one rounding on both sides: bit for bit.
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "{rows}x{cols} {dtype:?} element {i}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
