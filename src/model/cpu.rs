//! The Llama-family decoder layer in f32 on the CPU, on plain slices: what the candle path
//! computes (HF's ops, in HF's order) with the projections fused (`q|k|v` and `gate|up`, one
//! GEMM each), attention done block by block with no mask and no `[heads, T, T]` tensor, and
//! each elementwise step one pass over rows spread over the cores. `llama.rs` runs it for f32
//! CPU targets on `ComputePath::Candle`; other dtypes and devices keep candle's ops.
//!
//! Why not candle's ops: on 2 cores a profile of the candle path spent half its time outside
//! the GEMMs (one allocation per op, a dozen passes for rope and softmax, two thread pools
//! waiting on each other); the GEMMs here are the same `gemm` crate calls candle makes.

use crate::model::nn::Linear;
use candle_core::{Result, Storage, StorageRef, Tensor, bail};
use gemm::Parallelism;
use rayon::prelude::*;

/// The f32 elements of a contiguous CPU tensor, read in place; the storage lock is held for
/// as long as this lives.
pub(crate) struct Held<'a> {
    storage: StorageRef<'a>,
    start: usize,
    len: usize,
}

impl<'a> Held<'a> {
    pub(crate) fn of(t: &'a Tensor) -> Result<Held<'a>> {
        let (storage, layout) = t.storage_and_layout();
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("cpu forward: a non-contiguous {:?} tensor", t.dims())
        };
        Ok(Held {
            storage,
            start,
            len: end - start,
        })
    }

    pub(crate) fn f32s(&self) -> Result<&[f32]> {
        match &*self.storage {
            Storage::Cpu(s) => Ok(&s.as_slice::<f32>()?[self.start..self.start + self.len]),
            _ => bail!("cpu forward: a tensor that is not on the CPU"),
        }
    }
}

/// A matrix operand: element `(i, j)` at `data[i * rs + j * cs]`.
#[derive(Clone, Copy)]
struct Operand<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl Operand<'_> {
    /// Whether every element of a `[rows, cols]` matrix lies in `data`.
    fn holds(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// `dst[m, n]` (row stride `ld`) `= a[m, k] · b[k, n]`, through the `gemm` crate (the call
/// candle's CPU matmul makes). Bounds are checked before the unchecked call.
#[allow(clippy::too_many_arguments)]
fn gemm_into(
    (m, n, k): (usize, usize, usize),
    a: Operand,
    b: Operand,
    dst: &mut [f32],
    ld: usize,
    par: Parallelism,
) -> Result<()> {
    let out = Operand {
        data: dst,
        rs: ld,
        cs: 1,
    };
    if !(a.holds(m, k) && b.holds(k, n) && out.holds(m, n)) {
        bail!("cpu forward: gemm operands of {m}x{k} . {k}x{n} out of bounds");
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    // SAFETY: the three matrices lie within their slices (checked above) and `dst` is borrowed
    // mutably, so it overlaps neither input.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            ld as isize,
            false,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
    Ok(())
}

/// The GEMMs' threads: candle's count (`RAYON_NUM_THREADS`, else the physical cores).
fn threads() -> Parallelism {
    match candle_core::utils::get_num_threads() {
        0 | 1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// Rows per task of the row-wise passes: enough work to be worth a steal.
const ROWS_PER_TASK: usize = 8;

/// `x W^T (+ b)`: `x` [rows, k], `w` [n, k] -> [rows, n].
pub(crate) fn linear(
    x: &[f32],
    rows: usize,
    w: &[f32],
    n: usize,
    bias: Option<&[f32]>,
) -> Result<Vec<f32>> {
    let k = w.len().checked_div(n).unwrap_or(0);
    if x.len() != rows * k || w.len() != n * k {
        bail!(
            "cpu linear: x has {} elements for {rows} rows, w {} for [{n}, {k}]",
            x.len(),
            w.len()
        );
    }
    let mut out = vec![0f32; rows * n];
    let a = Operand {
        data: x,
        rs: k,
        cs: 1,
    };
    let wt = Operand {
        data: w,
        rs: 1,
        cs: k,
    };
    gemm_into((rows, n, k), a, wt, &mut out, n, threads())?;
    if let Some(b) = bias {
        if b.len() != n {
            bail!("cpu linear: bias of {} for {n} outputs", b.len());
        }
        out.par_chunks_mut(n)
            .with_min_len(ROWS_PER_TASK)
            .for_each(|row| row.iter_mut().zip(b).for_each(|(y, b)| *y += b));
    }
    Ok(out)
}

/// [`linear`] through a layer's projection (weight and bias read in place).
pub(crate) fn project(x: &[f32], rows: usize, lin: &Linear) -> Result<Vec<f32>> {
    let w = Held::of(&lin.weight)?;
    let b = lin.bias.as_ref().map(Held::of).transpose()?;
    let bias = b.as_ref().map(Held::f32s).transpose()?;
    linear(x, rows, w.f32s()?, lin.weight.dim(0)?, bias)
}

/// A row function compiled twice: for AVX2 (taken when the CPU has it) and for the baseline
/// target. The arithmetic is the same in both (no FMA contraction, no reordering: the
/// reductions below keep [`LANES`] partial results in a fixed order), so the results do not
/// depend on the machine; AVX2 only runs the lanes side by side.
macro_rules! simd_fn {
    ($(#[$m:meta])* fn $name:ident($($a:ident: $t:ty),* $(,)?) $(-> $r:ty)? $body:block) => {
        $(#[$m])*
        fn $name($($a: $t),*) $(-> $r)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                fn avx2($($a: $t),*) $(-> $r)? $body
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU has the one feature `avx2` is compiled for.
                    return unsafe { avx2($($a),*) };
                }
            }
            $body
        }
    };
}

/// Partial results a reduction keeps, summed in lane order at the end.
const LANES: usize = 16;

/// Sum of `f(x)` over `xs` in [`LANES`] partial sums.
#[inline(always)]
fn sum_lanes(xs: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += f(x);
        }
    }
    for (a, &x) in acc.iter_mut().zip(rest) {
        *a += f(x);
    }
    acc.iter().sum()
}

/// The largest of `xs` (`-inf` when empty), in [`LANES`] partial maxima.
#[inline(always)]
fn max_lanes(xs: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = if x > *a { x } else { *a };
        }
    }
    for (a, &x) in acc.iter_mut().zip(rest) {
        *a = if x > *a { x } else { *a };
    }
    acc.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `e^x` in f32 without a call, so loops of it vectorise: computed in f64 (`n = round(x log2 e)`,
/// `r = x - n ln 2`, `e^r` by its Taylor series to `r^9`, whose remainder is below 1e-11 for
/// `|r| <= ln2 / 2`, times `2^n` from the exponent bits) and rounded once, which gives the
/// correctly rounded f32 but for about 1 in 100,000 arguments (one ulp off; libm's `expf`
/// is one ulp off for about 1 in 1,000). `x` is clamped to `[-104, 89]`, beyond which the f32
/// result is 0 or infinity anyway; NaN stays NaN.
#[inline(always)]
fn exp(x: f32) -> f32 {
    const LN2: f64 = std::f64::consts::LN_2;
    const LOG2E: f64 = std::f64::consts::LOG2_E;
    // 1.5 * 2^52: adding it rounds to an integer, held in the low mantissa bits.
    const ROUND: f64 = 6_755_399_441_055_744.0;
    let x = f64::from(x.clamp(-104.0, 89.0));
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = x - n * LN2;
    let mut p = 1.0 / 362_880.0;
    p = p * r + 1.0 / 40_320.0;
    p = p * r + 1.0 / 5_040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits()) as i64;
    (p * f64::from_bits(((n_bits + 1023) as u64) << 52)) as f32
}

simd_fn! {
    /// `1 / sqrt(mean(x^2) + eps)` of one row, as kernels/rmsnorm.cu's reference computes it
    /// (the sum of squares in f32).
    fn inv_rms(x: &[f32], eps: f32) -> f32 {
        let ss = sum_lanes(x, |v| v * v);
        1.0 / (ss / x.len() as f32 + eps).sqrt()
    }
}

simd_fn! {
    /// `out = (x * inv) * w`, elementwise.
    fn scale_by(out: &mut [f32], x: &[f32], inv: f32, w: &[f32]) {
        out.iter_mut()
            .zip(x)
            .zip(w)
            .for_each(|((o, &v), &wc)| *o = v * inv * wc);
    }
}

/// RMSNorm of each row of `x` [rows, w.len()]: `(x * inv_rms) * w`, as HF computes it in f32.
pub(crate) fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(w.len())
        .zip(x.par_chunks(w.len()))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(o, x)| scale_by(o, x, inv_rms(x, eps), w));
    out
}

/// `x + delta` and its RMSNorm, in one pass: the residual add of a decoder layer and the next
/// norm. Each [rows, w.len()]; returns (sum, normed).
pub(crate) fn add_rms_norm(x: &[f32], delta: &[f32], w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let mut sum = vec![0f32; x.len()];
    let mut normed = vec![0f32; x.len()];
    sum.par_chunks_mut(w.len())
        .zip(normed.par_chunks_mut(w.len()))
        .zip(x.par_chunks(w.len()).zip(delta.par_chunks(w.len())))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|((s, n), (x, d))| {
            s.iter_mut()
                .zip(x)
                .zip(d)
                .for_each(|((s, x), d)| *s = x + d);
            scale_by(n, s, inv_rms(s, eps), w);
        });
    (sum, normed)
}

/// `a + b`, elementwise.
pub(crate) fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut out = vec![0f32; a.len()];
    out.par_chunks_mut(4096)
        .zip(a.par_chunks(4096).zip(b.par_chunks(4096)))
        .for_each(|(o, (a, b))| {
            o.iter_mut()
                .zip(a)
                .zip(b)
                .for_each(|((o, a), b)| *o = a + b)
        });
    out
}

/// The heads of one fused `q|k|v` projection: `[T, ld]` rows holding `heads` query heads at
/// column 0, then `kv_heads` key heads, then `kv_heads` value heads, `head_dim` wide each.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Heads {
    /// The row width of the fused projection.
    pub(crate) fn ld(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }
}

/// Qwen3's per-head RMSNorm of q (`qn`) and k (`kn`), in place in the fused rows.
pub(crate) fn qk_norm_in_place(qkv: &mut [f32], hs: Heads, qn: &[f32], kn: &[f32], eps: f32) {
    let hd = hs.head_dim;
    qkv.par_chunks_mut(hs.ld())
        .with_min_len(ROWS_PER_TASK)
        .for_each(|row| {
            for (h, x) in row[..(hs.heads + hs.kv_heads) * hd]
                .chunks_mut(hd)
                .enumerate()
            {
                let w = if h < hs.heads { qn } else { kn };
                let inv = inv_rms(x, eps);
                x.iter_mut().zip(w).for_each(|(v, &wc)| *v = *v * inv * wc);
            }
        });
}

/// Rotate-half rope of every q and k head in place on its leading `rot` dims (the rest pass
/// through: partial rotary): row `t` at position `t`, `cos`/`sin` `[T, rot / 2]`.
/// `x * cos + rotate_half(x) * sin` with HF's roundings.
pub(crate) fn rope_in_place(qkv: &mut [f32], hs: Heads, rot: usize, cos: &[f32], sin: &[f32]) {
    let (hd, half) = (hs.head_dim, rot.min(hs.head_dim) / 2);
    qkv.par_chunks_mut(hs.ld())
        .zip(cos.par_chunks(half).zip(sin.par_chunks(half)))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(row, (c, s))| {
            for x in row[..(hs.heads + hs.kv_heads) * hd].chunks_mut(hd) {
                let (x1, x2) = x[..2 * half].split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (x1[i], x2[i]);
                    x1[i] = a * c[i] - b * s[i];
                    x2[i] = b * c[i] + a * s[i];
                }
            }
        });
}

/// Query rows per attention task: small enough to spread the causal triangle evenly over the
/// cores, large enough for the two GEMMs of a task to run at speed.
const QUERY_BLOCK: usize = 32;

/// The first key row `i` sees: 0, or the start of Mistral's sliding window (`i - j < window`).
fn first_key(i: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| (i + 1).saturating_sub(w))
}

/// Causal attention over the fused `q|k|v` rows `[T, hs.ld()]` (rope already applied), query
/// head `h` reading KV head `h / (heads / kv_heads)`. Per block of queries and head: scores
/// `scale * q.k` for the keys the block can see, softmax (the max subtracted, in f32) over each
/// query's own keys, then the weighted sum of values. Returns `[T, heads * head_dim]`.
pub(crate) fn attention(
    qkv: &[f32],
    t: usize,
    hs: Heads,
    scale: f32,
    window: Option<usize>,
) -> Result<Vec<f32>> {
    let (nh, nkv, hd, ld) = (hs.heads, hs.kv_heads, hs.head_dim, hs.ld());
    if nkv == 0 || !nh.is_multiple_of(nkv) || qkv.len() != t * ld {
        bail!(
            "cpu attention: {nh} heads in {nkv} groups over {} elements",
            qkv.len()
        );
    }
    let width = nh * hd;
    let (k_col, v_col) = (width, width + nkv * hd);
    let mut out = vec![0f32; t * width];
    out.par_chunks_mut(QUERY_BLOCK * width)
        .enumerate()
        .with_max_len(1)
        .try_for_each(|(blk, rows)| -> Result<()> {
            let i0 = blk * QUERY_BLOCK;
            let bm = rows.len() / width;
            let lo = first_key(i0, window);
            let nk = i0 + bm - lo;
            let mut s = vec![0f32; bm * nk];
            for h in 0..nh {
                let g = h / (nh / nkv);
                let q = Operand {
                    data: &qkv[i0 * ld + h * hd..],
                    rs: ld,
                    cs: 1,
                };
                // k^T: element (d, j) is key j's d.
                let kt = Operand {
                    data: &qkv[lo * ld + k_col + g * hd..],
                    rs: 1,
                    cs: ld,
                };
                gemm_into((bm, nk, hd), q, kt, &mut s, nk, Parallelism::None)?;
                for (r, row) in s.chunks_mut(nk).enumerate() {
                    let i = i0 + r;
                    softmax_visible(row, first_key(i, window) - lo, i - lo, scale);
                }
                let p = Operand {
                    data: &s,
                    rs: nk,
                    cs: 1,
                };
                let v = Operand {
                    data: &qkv[lo * ld + v_col + g * hd..],
                    rs: ld,
                    cs: 1,
                };
                gemm_into(
                    (bm, hd, nk),
                    p,
                    v,
                    &mut rows[h * hd..],
                    width,
                    Parallelism::None,
                )?;
            }
            Ok(())
        })?;
    Ok(out)
}

simd_fn! {
    /// One query's scores in place: `scale * s` over the visible keys `from..=to`, their
    /// softmax (max subtracted, `exp`, divided by the sum), and 0 for every key outside.
    fn softmax_visible(row: &mut [f32], from: usize, to: usize, scale: f32) {
        let seen = &mut row[from..=to];
        seen.iter_mut().for_each(|x| *x *= scale);
        let max = max_lanes(seen);
        seen.iter_mut().for_each(|x| *x = exp(*x - max));
        let sum = sum_lanes(seen, |x| x);
        seen.iter_mut().for_each(|x| *x /= sum);
        row[..from].fill(0.0);
        row[to + 1..].fill(0.0);
    }
}

simd_fn! {
    /// `out = silu(g) * u` elementwise (`g / (1 + e^-g) * u`).
    fn silu_mul_row(out: &mut [f32], g: &[f32], u: &[f32]) {
        out.iter_mut()
            .zip(g)
            .zip(u)
            .for_each(|((o, &g), &u)| *o = g / (1.0 + exp(-g)) * u);
    }
}

/// SwiGLU's gate on the fused `gate|up` rows `[rows, 2 * inter]`: `silu(gate) * up` in f32
/// (kernels/silu_mul.cu's formula), `[rows, inter]`.
pub(crate) fn silu_mul(gate_up: &[f32], inter: usize) -> Vec<f32> {
    let mut out = vec![0f32; gate_up.len() / 2];
    out.par_chunks_mut(inter)
        .zip(gate_up.par_chunks(2 * inter))
        .with_min_len(ROWS_PER_TASK)
        .for_each(|(o, gu)| {
            let (g, u) = gu.split_at(inter);
            silu_mul_row(o, g, u);
        });
    out
}
