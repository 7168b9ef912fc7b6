//! MXFP4 dequantisation (kernels/mxfp4.cu): gpt-oss checkpoints store the routed experts'
//! weights as `*_blocks` (u8 `[..., G, 16]`: 32 FP4 e2m1 values per group, two per byte) and
//! `*_scales` (u8 `[..., G]`: one E8M0 exponent per group); [`mxfp4_dequant`] turns them into
//! `[..., G * 32]` floats.
//!
//! Semantics, element by element, are transformers 5.24 integrations/mxfp4.py
//! `_convert_moe_packed_tensors` (called by `convert_moe_packed_tensors`): group g, byte b
//! gives `out[..., 32 g + 2 b] = FP4[byte & 0x0F] * 2^(s - 127)` (the low nibble first) and
//! `out[..., 32 g + 2 b + 1] = FP4[byte >> 4] * 2^(s - 127)`, with `FP4` = `FP4_VALUES`
//! (0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated; nibble 8 is -0). HF computes
//! `torch.ldexp(lut[idx], scale - 127)`, which is `lut * torch.pow(2.0, exp)` with the power in
//! f32, rounded to the output dtype; so the scale byte 0 is the subnormal 2^-127 (kept: the
//! products stay exact in f32), and the byte 255 is 2^128 = +inf in f32: nonzero nibbles give
//! +-inf and the two zero nibbles NaN (0 * inf). We do the same. HF's last step, the
//! `transpose(1, 2)` that turns `[E, rows, cols]` into `[E, cols, rows]`, is left to the caller
//! (this returns the `[..., G * 32]` row order of the blocks).

use super::{Elem, with_float_type};
use candle_core::{DType, Device, Result, Tensor};

/// transformers' `FP4_VALUES` (integrations/mxfp4.py): the e2m1 value of each nibble.
pub const FP4_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// `2^(s - 127)` in f32 as torch's `pow(2.0, s - 127)` gives it: the subnormal 2^-127 for
/// `s = 0`, +inf for `s = 255`, exact powers of two between.
pub fn mxfp4_scale(s: u8) -> f32 {
    f32::from_bits(if s == 0 {
        0x0040_0000
    } else {
        u32::from(s) << 23
    })
}

/// The CPU reference: `blocks` `[groups * 16]`, `scales` `[groups]`, contiguous; returns
/// `[groups * 32]` in the element order the module doc states. One f32 product (exact unless
/// it is infinite or NaN), rounded once to `T`.
pub fn mxfp4_dequant_ref<T: Elem>(blocks: &[u8], scales: &[u8]) -> Vec<T> {
    let mut out = Vec::with_capacity(blocks.len() * 2);
    for (group, &s) in blocks.chunks_exact(16).zip(scales) {
        let scale = mxfp4_scale(s);
        for &b in group {
            out.push(T::from_f32(FP4_VALUES[usize::from(b & 0x0f)] * scale));
            out.push(T::from_f32(FP4_VALUES[usize::from(b >> 4)] * scale));
        }
    }
    out
}

/// Dequantises MXFP4 weights: `blocks` u8 `[..., G, 16]`, `scales` u8 `[..., G]` (the same
/// leading dims, same device) into `dtype` (f32, f16 or bf16) `[..., G * 32]`. See the module
/// doc for the element order and the edge cases; no transpose is applied.
pub fn mxfp4_dequant(blocks: &Tensor, scales: &Tensor, dtype: DType) -> Result<Tensor> {
    let bd = blocks.dims();
    if blocks.dtype() != DType::U8 || scales.dtype() != DType::U8 {
        candle_core::bail!(
            "mxfp4_dequant: blocks and scales must be u8, found {:?} and {:?}",
            blocks.dtype(),
            scales.dtype()
        );
    }
    if bd.len() < 2 || bd[bd.len() - 1] != 16 || scales.dims() != &bd[..bd.len() - 1] {
        candle_core::bail!(
            "mxfp4_dequant: blocks {bd:?} and scales {:?} are not [..., G, 16] and [..., G]",
            scales.dims()
        );
    }
    if !blocks.device().same_device(scales.device()) {
        candle_core::bail!("mxfp4_dequant: blocks and scales are on different devices");
    }
    super::KernelDType::of(dtype)?;
    let mut out_dims = bd[..bd.len() - 1].to_vec();
    *out_dims.last_mut().expect("rank >= 2") *= 32;
    let groups = scales.elem_count();
    let (blocks, scales) = (blocks.contiguous()?, scales.contiguous()?);
    match blocks.device() {
        Device::Cpu => {
            let b = blocks.flatten_all()?.to_vec1::<u8>()?;
            let s = scales.flatten_all()?.to_vec1::<u8>()?;
            with_float_type!(dtype, T => {
                Tensor::from_vec(mxfp4_dequant_ref::<T>(&b, &s), out_dims, &Device::Cpu)
            })
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => {
            use super::cuda;
            let out = cuda::alloc(dev, dtype, groups * 32)?;
            launch::mxfp4_dequant(
                dev,
                super::KernelDType::of(dtype)?,
                &launch::Mxfp4Args {
                    blocks: cuda::tensor_ptr(&blocks)?,
                    scales: cuda::tensor_ptr(&scales)?,
                    out: cuda::storage_ptr(&out, 0)?,
                    groups,
                },
            )?;
            Ok(cuda::tensor(out, out_dims))
        }
        other => {
            let _ = groups;
            candle_core::bail!("mxfp4_dequant: no kernel for {:?}", other.location())
        }
    }
}

/// The launch of `mxfp4_dequant_*` (kernels/mxfp4.cu) from raw device pointers: its arguments and
/// the launch on the device's stream. [`mxfp4_dequant`] calls it.
#[cfg(feature = "cuda")]
pub mod launch {
    use crate::kernels::cuda::{DevPtr, Module, cfg, function, grid_dim, launch};
    use crate::kernels::{KernelDType, to_i64};
    use candle_core::Result;
    use candle_core::cuda_backend::CudaDevice;

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
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// Every nibble in both positions with hand-computed values: byte `(hi << 4) | lo` for
    /// lo = 0..15 (hi = 15 - lo), so a group holds all 16 values low-first and all 16
    /// high-first; at scale bytes 127 (x1), 128 (x2), 126 (x0.5), 130 (x8), 1 (x2^-126, the
    /// smallest normal), 0 (x2^-127, subnormal), 254 (x2^127) and 255 (inf).
    #[test]
    fn reference_matches_hand_computed_values() {
        let lut = [
            0.0f32, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
            -6.0,
        ];
        let group: Vec<u8> = (0..16u8).map(|lo| ((15 - lo) << 4) | lo).collect();
        // Element 2b is lut[b] (low nibble), element 2b + 1 is lut[15 - b] (high nibble).
        let unit: Vec<f32> = (0..16).flat_map(|b| [lut[b], lut[15 - b]]).collect();
        for (s, factor) in [
            (127u8, 1.0f32),
            (128, 2.0),
            (126, 0.5),
            (130, 8.0),
            (1, f32::MIN_POSITIVE),
            (0, f32::MIN_POSITIVE / 2.0),
            (254, 2f32.powi(127)),
        ] {
            let got = mxfp4_dequant_ref::<f32>(&group, &[s]);
            let want: Vec<f32> = unit.iter().map(|v| v * factor).collect();
            // Exact, signed zeros included: compare bits.
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "scale byte {s}");
        }
        // Spot values written out by hand.
        let one = mxfp4_dequant_ref::<f32>(&group, &[127]);
        assert_eq!(&one[..6], &[0.0, -6.0, 0.5, -4.0, 1.0, -3.0]);
        assert_eq!(one[14], 6.0); // byte 7 = 0x87: low nibble 7 -> 6
        assert_eq!(one[15].to_bits(), (-0.0f32).to_bits()); // its high nibble 8 -> -0
        let sub = mxfp4_dequant_ref::<f32>(&group, &[0]);
        assert_eq!(sub[2], f32::from_bits(1 << 21)); // 0.5 * 2^-127 = 2^-128, a subnormal
        assert_eq!(sub[14], 6.0 * 2f32.powi(-127));
        // Scale 255: 2^128 overflows f32 as in torch, so +-inf and 0 * inf = NaN.
        let inf = mxfp4_dequant_ref::<f32>(&group, &[255]);
        for (i, (v, u)) in inf.iter().zip(&unit).enumerate() {
            if *u == 0.0 {
                assert!(v.is_nan(), "element {i}: {v}");
            } else {
                assert_eq!(*v, u.signum() * f32::INFINITY, "element {i}");
            }
        }
        // Rounded once to bf16 / f16: bf16 keeps the subnormals and the range, f16 flushes
        // 2^-127 products to signed zeros and overflows 2^127 ones.
        let b = mxfp4_dequant_ref::<bf16>(&group, &[0]);
        assert_eq!(b[14].to_f32(), 6.0 * 2f32.powi(-127));
        let h = mxfp4_dequant_ref::<f16>(&group, &[254]);
        assert!(h[2].to_f32().is_infinite() && h[0].to_f32() == 0.0);
        let h = mxfp4_dequant_ref::<f16>(&group, &[0]);
        assert!(h.iter().all(|v| v.to_f32() == 0.0));
        assert!(h[1].is_sign_negative()); // -6 * 2^-127 -> -0
    }

    /// The tensor op: leading dims kept, the last two folded into G * 32, groups in order, and
    /// shape or dtype mistakes refused.
    #[test]
    fn tensor_op_keeps_leading_dims() {
        let cpu = Device::Cpu;
        // [2 experts, 3 rows, 2 groups, 16]
        let bytes: Vec<u8> = (0..2 * 3 * 2 * 16).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<u8> = (0..12).map(|i| 120 + i as u8).collect();
        let b = Tensor::from_vec(bytes.clone(), (2, 3, 2, 16), &cpu).unwrap();
        let s = Tensor::from_vec(scales.clone(), (2, 3, 2), &cpu).unwrap();
        let got = mxfp4_dequant(&b, &s, DType::F32).unwrap();
        assert_eq!(got.dims(), [2, 3, 64]);
        let want = mxfp4_dequant_ref::<f32>(&bytes, &scales);
        assert_eq!(got.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want);
        // Group 1 of row (1, 2) starts at element 32 of that row: byte 16 of the row's blocks.
        let row = got
            .get(1)
            .unwrap()
            .get(2)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let byte = bytes[((3 + 2) * 2 + 1) * 16];
        let scale = mxfp4_scale(scales[(3 + 2) * 2 + 1]);
        assert_eq!(row[32], FP4_VALUES[usize::from(byte & 15)] * scale);
        assert_eq!(row[33], FP4_VALUES[usize::from(byte >> 4)] * scale);
        assert!(mxfp4_dequant(&b, &s.narrow(2, 0, 1).unwrap(), DType::F32).is_err());
        assert!(mxfp4_dequant(&b, &s, DType::U8).is_err());
        let f = b.to_dtype(DType::F32).unwrap();
        assert!(mxfp4_dequant(&f, &s, DType::F32).is_err());
    }

    /// The kernel against the reference, bit for bit (NaNs as NaNs): every byte value in every
    /// nibble position and every scale byte, bf16, f16 and f32, plus a gpt-oss-sized tensor.
    #[cfg(feature = "cuda")]
    #[test]
    fn device_matches_reference() {
        let Some(gpu) = crate::kernels::testing::cuda_device() else {
            return;
        };
        let cpu = Device::Cpu;
        let cases: [(usize, usize); 3] = [(256, 3), (1, 1), (2880, 90)];
        for (rows, g) in cases {
            let n = rows * g;
            let bytes: Vec<u8> = (0..n * 16)
                .map(|i| ((i * 131 + i / 7) % 256) as u8)
                .collect();
            let scales: Vec<u8> = (0..n).map(|i| (i % 256) as u8).collect();
            let b = Tensor::from_vec(bytes, (rows, g, 16), &cpu).unwrap();
            let s = Tensor::from_vec(scales, (rows, g), &cpu).unwrap();
            let (gb, gs) = (b.to_device(&gpu).unwrap(), s.to_device(&gpu).unwrap());
            for dtype in [DType::BF16, DType::F16, DType::F32] {
                let want = mxfp4_dequant(&b, &s, dtype).unwrap();
                let got = mxfp4_dequant(&gb, &gs, dtype).unwrap();
                assert_eq!(got.dims(), want.dims());
                let f = |t: &Tensor| crate::kernels::testing::values(t);
                let (got, want) = (f(&got), f(&want));
                let bad = (0..want.len()).find(|&i| {
                    let (a, w) = (got[i], want[i]);
                    !(a.to_bits() == w.to_bits() || (a.is_nan() && w.is_nan()))
                });
                if let Some(i) = bad {
                    panic!(
                        "mxfp4 {rows}x{g} {dtype:?}: element {i}: got {} want {}",
                        got[i], want[i]
                    );
                }
                eprintln!("mxfp4_dequant {rows}x{g} {dtype:?}: pass");
            }
        }
    }
}
