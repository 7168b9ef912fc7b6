//! Rotary position embedding in place (kernels/rope.cu), on the rotated part of every head of
//! a `[tokens, cols]` matrix (e.g. the q or k window of a fused QKV projection), in the
//! rotate-half layout (Llama, Qwen) or DeepSeek's interleaved one.

use super::{Elem, Matrix};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp3, Layout, Result, Tensor};

/// Where the rotated dimensions sit in each row: head `h` covers columns
/// `h * head_stride + rot_offset .. + rot_dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeParams {
    pub heads: usize,
    pub head_stride: usize,
    pub rot_offset: usize,
    pub rot_dim: usize,
    /// DeepSeek's pairs `(x[2i], x[2i+1])`, written back de-interleaved as transformers'
    /// `apply_rotary_pos_emb_interleave` does; false for rotate-half.
    pub interleaved: bool,
}

impl RopeParams {
    /// Rotate-half over whole heads of `head_dim` (Llama, Qwen, Mistral).
    pub fn half(heads: usize, head_dim: usize) -> RopeParams {
        RopeParams {
            heads,
            head_stride: head_dim,
            rot_offset: 0,
            rot_dim: head_dim,
            interleaved: false,
        }
    }

    fn check(&self, cols: usize) -> Result<()> {
        if self.rot_dim == 0 || !self.rot_dim.is_multiple_of(2) {
            candle_core::bail!("rope: rot_dim {} must be even and positive", self.rot_dim);
        }
        let last = self.heads.saturating_sub(1) * self.head_stride + self.rot_offset + self.rot_dim;
        if self.heads > 0 && last > cols {
            candle_core::bail!(
                "rope: head {} rotates columns up to {last}, the rows have {cols}",
                self.heads - 1
            );
        }
        Ok(())
    }
}

/// The CPU reference: rotates `x` (`tokens` rows at `row_stride`) in place with `cos`, `sin`:
/// `[tokens, rot_dim / 2]` f32, contiguous. Each product and the sum are rounded to f32 (no
/// fused multiply-add), then once to `T`.
pub fn rope_ref<T: Elem>(
    x: &mut [T],
    row_stride: usize,
    tokens: usize,
    p: &RopeParams,
    cos: &[f32],
    sin: &[f32],
) {
    let half = p.rot_dim / 2;
    let mut buf = vec![0f32; p.rot_dim];
    for t in 0..tokens {
        let (c, s) = (&cos[t * half..][..half], &sin[t * half..][..half]);
        for h in 0..p.heads {
            let start = t * row_stride + h * p.head_stride + p.rot_offset;
            let part = &mut x[start..start + p.rot_dim];
            for (b, v) in buf.iter_mut().zip(part.iter()) {
                *b = v.to_f32();
            }
            for i in 0..half {
                let (a, b) = if p.interleaved {
                    (buf[2 * i], buf[2 * i + 1])
                } else {
                    (buf[i], buf[i + half])
                };
                part[i] = T::from_f32(a * c[i] - b * s[i]);
                part[i + half] = T::from_f32(b * c[i] + a * s[i]);
            }
        }
    }
}

/// `cos`/`sin` checked: `[tokens, rot_dim / 2]` f32, contiguous.
fn table(layout: &Layout, tokens: usize, half: usize, what: &str) -> Result<Matrix> {
    let m = Matrix::with_cols(layout, half, what)?;
    if m.rows != tokens || (m.rows > 1 && m.stride != half) {
        candle_core::bail!(
            "rope: {what} must be a contiguous [{tokens}, {half}] table, found {} rows at stride {}",
            m.rows,
            m.stride
        );
    }
    Ok(m)
}

struct Rope(RopeParams);

impl InplaceOp3 for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(
        &self,
        x: &mut CpuStorage,
        xl: &Layout,
        cos: &CpuStorage,
        cl: &Layout,
        sin: &CpuStorage,
        sl: &Layout,
    ) -> Result<()> {
        let p = &self.0;
        let xm = Matrix::of(xl, "rope x")?;
        p.check(xm.cols)?;
        let half = p.rot_dim / 2;
        let cm = table(cl, xm.rows, half, "cos")?;
        let sm = table(sl, xm.rows, half, "sin")?;
        let cos = cm.slice(cos.as_slice::<f32>()?, "cos")?;
        let sin = sm.slice(sin.as_slice::<f32>()?, "sin")?;
        let span = xm.span();
        macro_rules! run {
            ($v:expr) => {{
                let data = $v
                    .get_mut(xm.offset..xm.offset + span)
                    .ok_or_else(|| candle_core::Error::Msg("rope: x outside its storage".into()))?;
                rope_ref(data, xm.stride, xm.rows, p, cos, sin);
                Ok(())
            }};
        }
        match x {
            CpuStorage::F32(v) => run!(v),
            CpuStorage::F16(v) => run!(v),
            CpuStorage::BF16(v) => run!(v),
            other => candle_core::bail!(
                "rope: x must be f32, f16 or bf16, found {:?}",
                other.dtype()
            ),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &mut candle_core::CudaStorage,
        xl: &Layout,
        cos: &candle_core::CudaStorage,
        cl: &Layout,
        sin: &candle_core::CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        use super::cuda::storage_ptr;
        let p = &self.0;
        let xm = Matrix::of(xl, "rope x")?;
        p.check(xm.cols)?;
        let half = p.rot_dim / 2;
        let cm = table(cl, xm.rows, half, "cos")?;
        let sm = table(sl, xm.rows, half, "sin")?;
        if cos.dtype() != DType::F32 || sin.dtype() != DType::F32 {
            candle_core::bail!("rope: cos and sin must be f32 tables");
        }
        let dtype = super::KernelDType::of(x.dtype())?;
        launch::rope(
            &x.device.clone(),
            dtype,
            &launch::RopeArgs {
                x: storage_ptr(x, xm.offset)?,
                row_stride: xm.stride,
                tokens: xm.rows,
                heads: p.heads,
                head_stride: p.head_stride,
                rot_offset: p.rot_offset,
                rot_dim: p.rot_dim,
                cos: storage_ptr(cos, cm.offset)?,
                sin: storage_ptr(sin, sm.offset)?,
                interleaved: p.interleaved,
            },
        )
        .map(|_| ())
    }
}

/// Rotates `x`: `[tokens, cols]` in place (a column window of a wider tensor, such as the q
/// part of a fused QKV output, writes into that tensor). `cos`, `sin`: `[tokens, rot_dim / 2]`
/// f32 (`model::nn::RopeTables` built in f32), made contiguous here if they are not.
pub fn rope_in_place(x: &Tensor, cos: &Tensor, sin: &Tensor, p: &RopeParams) -> Result<()> {
    if cos.dtype() != DType::F32 || sin.dtype() != DType::F32 {
        candle_core::bail!(
            "rope: cos and sin must be f32, found {:?} and {:?}",
            cos.dtype(),
            sin.dtype()
        );
    }
    super::KernelDType::of(x.dtype())?;
    x.inplace_op3(&cos.contiguous()?, &sin.contiguous()?, &Rope(*p))
}

/// [`rope_in_place`] on a contiguous copy of `x`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, p: &RopeParams) -> Result<Tensor> {
    let out = x.copy()?;
    rope_in_place(&out, cos, sin, p)?;
    Ok(out)
}

/// The launch of `rope_*` and `rope_half_vec_*` (kernels/rope.cu) from raw device pointers: its
/// arguments and the launch on the device's stream. The candle op above calls it, and so does the
/// runner's forward (`model::fast`).
#[cfg(feature = "cuda")]
pub mod launch {
    use crate::kernels::cuda::{DevPtr, Module, cfg, function, grid_dim, launch};
    use crate::kernels::{KernelDType, to_i32, to_i64};
    use candle_core::Result;
    use candle_core::cuda_backend::CudaDevice;

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
                    .ok_or_else(|| {
                        candle_core::Error::Msg("rope: thread count overflows".into())
                    })?;
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
                    common.0, common.1, common.2, common.3, common.4, common.5, common.6, a.cos,
                    a.sin,
                ]
            ),
        }
        Ok(kernel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Rope as RopeConfig, RopeScaling};
    use crate::kernels::testing::{random, values};
    use crate::model::nn::RopeTables;
    use candle_core::Device;

    fn tables(dim: usize, tokens: usize, device: &Device) -> RopeTables {
        let rope = RopeConfig {
            theta: 10_000.0,
            scaling: RopeScaling::None,
        };
        RopeTables::new(&rope, dim, tokens, DType::F32, device).unwrap()
    }

    /// `[tokens, heads * dim]` -> `[heads, tokens, dim]` and back, for model::nn's layout.
    fn heads_first(x: &Tensor, heads: usize) -> Tensor {
        let (t, c) = x.dims2().unwrap();
        x.reshape((t, heads, c / heads))
            .unwrap()
            .transpose(0, 1)
            .unwrap()
            .contiguous()
            .unwrap()
    }

    fn tokens_first(x: &Tensor) -> Tensor {
        let (h, t, d) = x.dims3().unwrap();
        x.transpose(0, 1)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((t, h * d))
            .unwrap()
    }

    #[test]
    fn reference_matches_rope_tables() {
        let dev = Device::Cpu;
        for &(tokens, heads, dim) in &[(1, 1, 2), (37, 3, 16), (5, 2, 24), (64, 4, 128)] {
            let tab = tables(dim, tokens, &dev);
            let x = random(&[tokens, heads * dim], DType::F32, 11, &dev);
            for interleaved in [false, true] {
                let p = RopeParams {
                    interleaved,
                    ..RopeParams::half(heads, dim)
                };
                let got = rope(&x, &tab.cos, &tab.sin, &p).unwrap();
                let hf = heads_first(&x, heads);
                let want = if interleaved {
                    tab.apply_interleaved(&hf)
                } else {
                    tab.apply_half(&hf)
                }
                .unwrap();
                // Same f32 operations in the same order: exact.
                assert_eq!(
                    values(&got),
                    values(&tokens_first(&want)),
                    "{tokens}x{heads}x{dim}"
                );
            }
        }
    }

    #[test]
    fn rotates_a_window_of_a_fused_qkv_in_place() {
        // q: 2 heads of 8, k: 1 head of 8, v: 1 head of 8, in one [T, 32] matrix; rope on k only.
        let dev = Device::Cpu;
        let (t, d) = (5, 8);
        let qkv = random(&[t, 4 * d], DType::F32, 3, &dev);
        let before = values(&qkv);
        let tab = tables(d, t, &dev);
        let k = qkv.narrow(1, 2 * d, d).unwrap();
        rope_in_place(&k, &tab.cos, &tab.sin, &RopeParams::half(1, d)).unwrap();
        let after = values(&qkv);
        for (i, (a, b)) in after.iter().zip(&before).enumerate() {
            let col = i % (4 * d);
            let in_k = (2 * d..3 * d).contains(&col);
            // Row 0 has angle 0 and stays as it was.
            assert_eq!(a == b, !in_k || i / (4 * d) == 0, "element {i}");
        }
    }

    #[test]
    fn rope_on_a_part_of_each_head() {
        // DeepSeek q: heads of 6 = 4 nope + 2 rope; only the last 2 of each head rotate.
        let dev = Device::Cpu;
        let (t, heads) = (3, 2);
        let x = random(&[t, heads * 6], DType::F32, 5, &dev);
        let tab = tables(2, t, &dev);
        let p = RopeParams {
            heads,
            head_stride: 6,
            rot_offset: 4,
            rot_dim: 2,
            interleaved: true,
        };
        let got = values(&rope(&x, &tab.cos, &tab.sin, &p).unwrap());
        let xs = values(&x);
        let (c, s) = (values(&tab.cos), values(&tab.sin));
        for r in 0..t {
            for h in 0..heads {
                let b = r * 12 + h * 6;
                assert_eq!(&got[b..b + 4], &xs[b..b + 4]);
                let (a0, a1) = (xs[b + 4], xs[b + 5]);
                assert_eq!(got[b + 4], a0 * c[r] - a1 * s[r]);
                assert_eq!(got[b + 5], a1 * c[r] + a0 * s[r]);
            }
        }
        let bad = RopeParams { rot_offset: 5, ..p };
        assert!(rope(&x, &tab.cos, &tab.sin, &bad).is_err());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_matches_reference() {
        let gpu = crate::kernels::testing::gpu();
        let cpu = Device::Cpu;
        // (tokens, row width, params): tiny ragged heads, Llama-3.1-8B q and k inside a fused
        // QKV at T = 2048, DeepSeek q (heads of 192, rope on the last 64, interleaved).
        let cases: Vec<(usize, usize, usize, RopeParams)> = vec![
            (1, 16, 0, RopeParams::half(1, 16)),
            (37, 3 * 24 + 5, 5, RopeParams::half(3, 24)),
            (2048, 48 * 128, 0, RopeParams::half(32, 128)),
            (2048, 48 * 128, 32 * 128, RopeParams::half(8, 128)),
            (
                300,
                16 * 192,
                0,
                RopeParams {
                    heads: 16,
                    head_stride: 192,
                    rot_offset: 128,
                    rot_dim: 64,
                    interleaved: true,
                },
            ),
        ];
        let mut kernels = std::collections::BTreeSet::new();
        for (tokens, width, col, p) in cases {
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let tab = tables(p.rot_dim, tokens, &cpu);
                let x = random(&[tokens, width], dtype, 7, &cpu);
                let cols = width - col;
                let want = rope(&x.narrow(1, col, cols).unwrap(), &tab.cos, &tab.sin, &p).unwrap();
                let xg = x.to_device(&gpu).unwrap();
                let (cg, sg) = (
                    tab.cos.to_device(&gpu).unwrap(),
                    tab.sin.to_device(&gpu).unwrap(),
                );
                let window = xg.narrow(1, col, cols).unwrap();
                let ptr = |t: &Tensor| crate::kernels::cuda::tensor_ptr(t).unwrap();
                let args = crate::kernels::rope::launch::RopeArgs {
                    x: ptr(&window),
                    row_stride: width,
                    tokens,
                    heads: p.heads,
                    head_stride: p.head_stride,
                    rot_offset: p.rot_offset,
                    rot_dim: p.rot_dim,
                    cos: ptr(&cg),
                    sin: ptr(&sg),
                    interleaved: p.interleaved,
                };
                let kd = crate::kernels::KernelDType::of(dtype).unwrap();
                kernels.insert(format!(
                    "{:?}",
                    crate::kernels::rope::launch::rope_kernel(kd, &args)
                ));
                rope_in_place(&window, &cg, &sg, &p).unwrap();
                let got = xg.narrow(1, col, cols).unwrap();
                // The kernel does the reference's f32 operations without fused multiply-adds:
                // bit-exact in every dtype.
                assert_eq!(
                    values(&got),
                    values(&want),
                    "{tokens}x{width} {p:?} {dtype:?}"
                );
                // Columns outside the window are untouched.
                if col > 0 {
                    assert_eq!(
                        values(&xg.narrow(1, 0, col).unwrap()),
                        values(&x.narrow(1, 0, col).unwrap())
                    );
                }
            }
        }
        // The Llama cases take the vector kernel, the ragged and interleaved ones the warp one.
        assert_eq!(
            kernels.into_iter().collect::<Vec<_>>(),
            ["HalfVec", "Warp"],
            "both rope kernels ran"
        );
    }
}
