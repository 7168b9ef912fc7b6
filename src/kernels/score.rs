//! The diff engine's scoring on the GPU (kernels/score.cu): every captured slot against every
//! candidate reference state in one pass, returning the sums `x.x`, `x.c`, `c.c` and the row
//! count per (slot, candidate), from which [`crate::score::Score::from_sums`] derives cosine, relative error
//! and norm ratio exactly as [`crate::score::score_all`] does.

pub use crate::score::PairSums;
use candle_core::{DType, Device, Result, Tensor};

/// Which partial-sums kernel of kernels/score.cu runs on a CUDA device (the same sums, added
/// in another order: they agree to f32 rounding).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoreKernel {
    /// `score_partials`: one block per (chunk, slot, four candidates).
    PerSlot,
    /// `score_partials_vec`: one block per (four candidates, chunk, four slots), float4 reads,
    /// each reference value read once for every slot of the block; rows whose columns, stride
    /// or base are not 16-byte multiples take `PerSlot` instead.
    Vec4,
}

/// Where the slots and the reference states sit.
#[derive(Clone, Copy, Debug)]
pub struct ScoreShape {
    /// Captured rows.
    pub rows: usize,
    /// Columns of one slot; slot s is columns `s * cols .. (s + 1) * cols` of `x`.
    pub cols: usize,
    pub slots: usize,
    pub x_stride: usize,
    pub n_states: usize,
    pub ref_rows: usize,
    /// Row stride of the references (state q row r at `(q * ref_rows + r) * ref_stride`).
    pub ref_stride: usize,
}

/// The CPU reference, with `score_all`'s arithmetic: per row, f64 sums over the columns
/// (skipping non-finite captured values), added to the pair's totals row by row. Candidates are
/// `(state, shift)`: captured row t pairs with reference row t + shift. Returns the pairs
/// slot-major (`[slots, candidates]`).
pub fn score_slots_ref(
    x: &[f32],
    refs: &[f32],
    s: &ScoreShape,
    candidates: &[(usize, isize)],
) -> Vec<PairSums> {
    let mut out = vec![PairSums::default(); s.slots * candidates.len()];
    for slot in 0..s.slots {
        for (j, &(state, shift)) in candidates.iter().enumerate() {
            let pair = &mut out[slot * candidates.len() + j];
            for t in 0..s.rows {
                let rt = t as isize + shift;
                if rt < 0 || rt as usize >= s.ref_rows {
                    continue;
                }
                let xr = &x[t * s.x_stride + slot * s.cols..][..s.cols];
                let cr = &refs[(state * s.ref_rows + rt as usize) * s.ref_stride..][..s.cols];
                let (mut a, mut b, mut c) = (0f64, 0f64, 0f64);
                for (&xv, &cv) in xr.iter().zip(cr) {
                    if !xv.is_finite() {
                        continue;
                    }
                    let (xv, cv) = (f64::from(xv), f64::from(cv));
                    a += xv * xv;
                    b += xv * cv;
                    c += cv * cv;
                }
                pair.xx += a;
                pair.xc += b;
                pair.cc += c;
                pair.rows += 1;
            }
        }
    }
    out
}

/// The CPU form of [`score_slots`] on host buffers laid out as [`score_slots_ref`] takes them:
/// [`crate::score::pair_sums`], the matrix-product pass (f32 products summed per row,
/// rows in f64), so it agrees with the reference to about 1e-6 relative, as the GPU does.
pub fn score_slots_cpu(
    x: &[f32],
    refs: &[f32],
    s: &ScoreShape,
    candidates: &[(usize, isize)],
) -> Vec<PairSums> {
    use crate::score::{View, pair_sums};
    let xs: Vec<View> = (0..s.slots)
        .map(|slot| View {
            data: x,
            rows: s.rows,
            stride: s.x_stride,
            col: slot * s.cols,
            cols: s.cols,
        })
        .collect();
    let per_state = s.ref_rows * s.ref_stride;
    let states: Vec<View> = (0..s.n_states)
        .map(|q| View {
            data: &refs[q * per_state..(q + 1) * per_state],
            rows: s.ref_rows,
            stride: s.ref_stride,
            col: 0,
            cols: s.cols,
        })
        .collect();
    pair_sums(&xs, &states, candidates)
}

/// The kernel [`score_slots`] launches.
pub const SCORE_KERNEL: ScoreKernel = ScoreKernel::Vec4;

/// Scores `slots` slots of `cols` columns of `x`: `[rows, >= slots * cols]` f32 (any row
/// stride) against `refs`: `[n_states, ref_rows, >= cols]` f32 for every candidate
/// `(state, shift)`. Returns the sums slot-major (`[slots, candidates]`), on the host.
///
/// On the GPU each thread sums in f32 before a double reduction (the CPU sums each row in f64),
/// so the sums agree to about 1e-6 relative, not bit for bit.
pub fn score_slots(
    x: &Tensor,
    slots: usize,
    cols: usize,
    refs: &Tensor,
    candidates: &[(usize, isize)],
) -> Result<Vec<PairSums>> {
    if x.dtype() != DType::F32 || refs.dtype() != DType::F32 {
        candle_core::bail!("score_slots: x and refs must be f32");
    }
    let (rows, x_cols) = x.dims2()?;
    let (n_states, ref_rows, ref_cols) = refs.dims3()?;
    if x_cols < slots * cols || ref_cols < cols {
        candle_core::bail!(
            "score_slots: {slots} slots of {cols} need {} columns of x (found {x_cols}) and {cols} \
             of the references (found {ref_cols})",
            slots * cols
        );
    }
    if let Some(&(q, _)) = candidates.iter().find(|(q, _)| *q >= n_states) {
        candle_core::bail!("score_slots: candidate state {q} outside 0..{n_states}");
    }
    let refs = refs.contiguous()?;
    let xm = super::Matrix::of(x.layout(), "score x")?;
    let shape = ScoreShape {
        rows,
        cols,
        slots,
        x_stride: xm.stride,
        n_states,
        ref_rows,
        ref_stride: ref_cols,
    };
    match x.device() {
        Device::Cpu => {
            let (xs, _) = x.storage_and_layout();
            let xv = match &*xs {
                candle_core::Storage::Cpu(c) => xm.slice(c.as_slice::<f32>()?, "score x")?.to_vec(),
                _ => unreachable!("a CPU tensor has CPU storage"),
            };
            drop(xs);
            let rv = refs.flatten_all()?.to_vec1::<f32>()?;
            Ok(score_slots_cpu(&xv, &rv, &shape, candidates))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(dev) => Ok(score_on_gpu(dev, x, &refs, &shape, candidates, SCORE_KERNEL)?.0),
        other => candle_core::bail!("score_slots: no kernel for {:?}", other.location()),
    }
}

#[cfg(feature = "cuda")]
fn score_on_gpu(
    dev: &candle_core::CudaDevice,
    x: &Tensor,
    refs: &Tensor,
    s: &ScoreShape,
    candidates: &[(usize, isize)],
    kernel: ScoreKernel,
) -> Result<(Vec<PairSums>, ScoreKernel)> {
    use super::cuda;
    let n = candidates.len();
    if n == 0 || s.slots == 0 {
        return Ok((Vec::new(), kernel));
    }
    let gpu = Device::Cuda(dev.clone());
    let states = candidates
        .iter()
        .map(|&(q, _)| super::to_i32(q, "candidate state"))
        .collect::<Result<Vec<_>>>()?;
    let shifts = candidates
        .iter()
        .map(|&(_, d)| {
            i32::try_from(d).map_err(|_| candle_core::Error::Msg(format!("shift {d} exceeds i32")))
        })
        .collect::<Result<Vec<_>>>()?;
    let states = Tensor::new(states.as_slice(), &gpu)?;
    let shifts = Tensor::new(shifts.as_slice(), &gpu)?;
    let ws = cuda::alloc(
        dev,
        DType::F64,
        launch::score_workspace_len(s.rows, s.slots, n),
    )?;
    let out = cuda::alloc(dev, DType::F64, s.slots * n * 3)?;
    let rows_out = cuda::alloc(dev, DType::I32, s.slots * n)?;
    let ran = launch::score(
        dev,
        &launch::ScoreArgs {
            x: cuda::tensor_ptr(x)?,
            x_stride: s.x_stride,
            rows: s.rows,
            cols: s.cols,
            slots: s.slots,
            refs: cuda::tensor_ptr(refs)?,
            n_states: s.n_states,
            ref_rows: s.ref_rows,
            ref_stride: s.ref_stride,
            cand_state: cuda::tensor_ptr(&states)?,
            cand_shift: cuda::tensor_ptr(&shifts)?,
            n_cand: n,
            workspace: cuda::storage_ptr(&ws, 0)?,
            out: cuda::storage_ptr(&out, 0)?,
            rows_out: cuda::storage_ptr(&rows_out, 0)?,
        },
        kernel,
    )?;
    let sums = cuda::tensor(out, s.slots * n * 3).to_vec1::<f64>()?;
    let rows = cuda::tensor(rows_out, s.slots * n).to_vec1::<i32>()?;
    let sums = sums
        .chunks(3)
        .zip(rows)
        .map(|(v, r)| PairSums {
            xx: v[0],
            xc: v[1],
            cc: v[2],
            rows: r.max(0) as usize,
        })
        .collect();
    Ok((sums, ran))
}

/// The launch of `score_partials`, `score_partials_vec` and `score_finish` (kernels/score.cu) from
/// raw device pointers: its arguments and the launch on the device's stream. [`score_slots`] calls
/// it.
#[cfg(feature = "cuda")]
pub mod launch {
    use super::ScoreKernel;
    use crate::kernels::cuda::{DevPtr, Module, cfg, function, grid_dim, grid_dim_yz, launch};
    use crate::kernels::{to_i32, to_i64};
    use candle_core::Result;
    use candle_core::cuda_backend::CudaDevice;

    /// `score_partials` + `score_finish`: see kernels/score.cu. `x` `[rows, x_stride]` f32 holds
    /// `slots` slots of `cols`; `refs` `[n_states, ref_rows, ref_stride]` f32; `cand_state`,
    /// `cand_shift` `[n_cand]` i32; writes `out` `[slots, n_cand, 3]` f64 and `rows_out`
    /// `[slots, n_cand]` i32, using `workspace` (`score_workspace_len` doubles).
    #[derive(Clone, Copy, Debug)]
    pub struct ScoreArgs {
        pub x: DevPtr,
        pub x_stride: usize,
        pub rows: usize,
        pub cols: usize,
        pub slots: usize,
        pub refs: DevPtr,
        pub n_states: usize,
        pub ref_rows: usize,
        pub ref_stride: usize,
        pub cand_state: DevPtr,
        pub cand_shift: DevPtr,
        pub n_cand: usize,
        pub workspace: DevPtr,
        pub out: DevPtr,
        pub rows_out: DevPtr,
    }

    /// Captured rows per block of `score_partials`.
    const SCORE_ROWS_PER_CHUNK: usize = 32;
    /// Candidates per block (kernels/score.cu `SCORE_GROUP`).
    const SCORE_GROUP: usize = 4;

    /// Doubles of workspace [`score`] needs.
    pub fn score_workspace_len(rows: usize, slots: usize, n_cand: usize) -> usize {
        slots * n_cand * rows.div_ceil(SCORE_ROWS_PER_CHUNK).max(1) * 3
    }

    /// Slots per block of `score_partials_vec` (kernels/score.cu `SCORE_SLOTS`).
    const SCORE_SLOTS: usize = 4;
    /// Threads per block of `score_partials_vec`.
    const SCORE_VEC_THREADS: u32 = 128;

    /// Launches the scoring with `kernel`, or with `score_partials` where `Vec4` cannot read the
    /// rows as float4s (a column count, stride or base not a multiple of 16 bytes). Returns the
    /// kernel that ran.
    pub fn score(dev: &CudaDevice, a: &ScoreArgs, kernel: ScoreKernel) -> Result<ScoreKernel> {
        if a.slots == 0 || a.n_cand == 0 {
            return Ok(kernel);
        }
        let aligned = a.cols.is_multiple_of(4)
            && a.x_stride.is_multiple_of(4)
            && a.ref_stride.is_multiple_of(4)
            && a.x.is_multiple_of(16)
            && a.refs.is_multiple_of(16);
        let kernel = match kernel {
            ScoreKernel::Vec4 if !aligned => ScoreKernel::PerSlot,
            k => k,
        };
        let chunks = a.rows.div_ceil(SCORE_ROWS_PER_CHUNK).max(1);
        let groups = a.n_cand.div_ceil(SCORE_GROUP);
        let (name, grid, threads) = match kernel {
            ScoreKernel::PerSlot => (
                "score_partials",
                (
                    grid_dim(chunks, "score_partials")?,
                    grid_dim_yz(a.slots, "score_partials slots")?,
                    grid_dim_yz(groups, "score_partials candidates")?,
                ),
                256,
            ),
            ScoreKernel::Vec4 => (
                "score_partials_vec",
                (
                    grid_dim(groups, "score_partials_vec candidates")?,
                    grid_dim_yz(chunks, "score_partials_vec chunks")?,
                    grid_dim_yz(a.slots.div_ceil(SCORE_SLOTS), "score_partials_vec slots")?,
                ),
                SCORE_VEC_THREADS,
            ),
        };
        let partials = function(dev, Module::Score, name)?;
        let n_cand = to_i32(a.n_cand, "candidates")?;
        let (rows, ref_rows) = (to_i32(a.rows, "rows")?, to_i32(a.ref_rows, "ref rows")?);
        launch!(
            dev,
            partials,
            name,
            cfg(grid, threads, 0)?,
            [
                a.x,
                to_i64(a.x_stride, "x stride")?,
                rows,
                to_i32(a.cols, "cols")?,
                to_i32(a.slots, "slots")?,
                a.refs,
                to_i32(a.n_states, "states")?,
                ref_rows,
                to_i64(a.ref_stride, "ref stride")?,
                a.cand_state,
                a.cand_shift,
                n_cand,
                SCORE_ROWS_PER_CHUNK as i32,
                a.workspace,
            ]
        );
        let finish = function(dev, Module::Score, "score_finish")?;
        let pairs = a.slots * a.n_cand;
        let config = cfg(
            (grid_dim(pairs.div_ceil(256), "score_finish")?, 1, 1),
            256,
            0,
        )?;
        launch!(
            dev,
            finish,
            "score_finish",
            config,
            [
                a.workspace,
                to_i32(chunks, "chunks")?,
                to_i32(a.slots, "slots")?,
                n_cand,
                rows,
                ref_rows,
                a.cand_shift,
                a.out,
                a.rows_out,
            ]
        );
        Ok(kernel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::random_vec;
    use crate::score::{Pairing, View, score_all};

    fn case(
        rows: usize,
        cols: usize,
        slots: usize,
        ref_rows: usize,
        n_states: usize,
        seed: u64,
    ) -> (Tensor, Tensor) {
        let mut xv = random_vec(rows * (slots * cols + 3), seed);
        if xv.len() > 7 {
            xv[5] = f32::NAN; // a non-finite captured value is skipped
            xv[7] = f32::INFINITY;
        }
        let x = Tensor::from_vec(xv, (rows, slots * cols + 3), &Device::Cpu).unwrap();
        let refs = Tensor::from_vec(
            random_vec(n_states * ref_rows * (cols + 2), seed + 1),
            (n_states, ref_rows, cols + 2),
            &Device::Cpu,
        )
        .unwrap();
        (x, refs)
    }

    fn candidates(n_states: usize) -> Vec<(usize, isize)> {
        (0..n_states)
            .flat_map(|q| [(q, 0), (q, 1), (q, -1), (q, -40)])
            .collect()
    }

    #[test]
    fn reference_matches_score_all() {
        let (rows, cols, slots, ref_rows, n_states) = (37, 24, 3, 38, 5);
        let (x, refs) = case(rows, cols, slots, ref_rows, n_states, 1);
        let cands = candidates(n_states);
        let got = reference_of(
            &x.narrow(1, 1, slots * cols).unwrap(),
            slots,
            cols,
            &refs,
            &cands,
        );
        let xv = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let rv = refs.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let xview = View {
            data: &xv[1..],
            rows,
            stride: slots * cols + 3,
            col: 0,
            cols: slots * cols,
        };
        let per_state = ref_rows * (cols + 2);
        let pairings: Vec<Pairing> = cands
            .iter()
            .map(|&(q, shift)| Pairing {
                reference: View {
                    data: &rv[q * per_state..(q + 1) * per_state],
                    rows: ref_rows,
                    stride: cols + 2,
                    col: 0,
                    cols,
                },
                shift,
            })
            .collect();
        for slot in 0..slots {
            let want = score_all(xview.columns(slot * cols, cols), &pairings);
            for (j, w) in want.iter().enumerate() {
                let g = got[slot * cands.len() + j].score();
                // The same f64 arithmetic in the same order: exact.
                assert_eq!(
                    (
                        g.cosine.to_bits(),
                        g.rel_err.to_bits(),
                        g.norm_ratio.to_bits(),
                        g.rows
                    ),
                    (
                        w.cosine.to_bits(),
                        w.rel_err.to_bits(),
                        w.norm_ratio.to_bits(),
                        w.rows
                    ),
                    "slot {slot} candidate {j}"
                );
            }
        }
        assert_eq!(got[3].rows, 0, "a shift of -40 leaves no rows");
        assert!(score_slots(&x, slots, cols, &refs, &[(5, 0)]).is_err());
    }

    /// [`score_slots_ref`] on the buffers [`score_slots`] would read.
    fn reference_of(
        x: &Tensor,
        slots: usize,
        cols: usize,
        refs: &Tensor,
        cands: &[(usize, isize)],
    ) -> Vec<PairSums> {
        let x = x.to_device(&Device::Cpu).unwrap();
        let refs = refs.to_device(&Device::Cpu).unwrap();
        let (rows, _) = x.dims2().unwrap();
        let (n_states, ref_rows, ref_cols) = refs.dims3().unwrap();
        let xm = crate::kernels::Matrix::of(x.layout(), "x").unwrap();
        let (xs, _) = x.storage_and_layout();
        let xv = match &*xs {
            candle_core::Storage::Cpu(c) => xm
                .slice(c.as_slice::<f32>().unwrap(), "x")
                .unwrap()
                .to_vec(),
            _ => unreachable!(),
        };
        let shape = ScoreShape {
            rows,
            cols,
            slots,
            x_stride: xm.stride,
            n_states,
            ref_rows,
            ref_stride: ref_cols,
        };
        let rv = refs.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        score_slots_ref(&xv, &rv, &shape, cands)
    }

    /// f32 products summed per row (the CPU pass, the GPU's per-thread partials) against f64
    /// sums: a few f32 ulps of the partial sums' size. For the cross term that size is
    /// sqrt(xx * cc) (it may cancel to near 0), so the bound is relative to it: a cosine error
    /// of at most 1e-5.
    fn assert_sums_close(got: &[PairSums], want: &[PairSums]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g.rows, w.rows, "pair {i}");
            let scale = (w.xx * w.cc).sqrt();
            for (a, b, size) in [(g.xx, w.xx, w.xx), (g.xc, w.xc, scale), (g.cc, w.cc, w.cc)] {
                assert!((a - b).abs() <= 1e-5 * (1.0 + size), "pair {i}: {a} vs {b}");
            }
        }
    }

    /// The CPU pass (`score_slots` on the CPU: the matrix-product form) against the scalar
    /// reference, over ragged shapes, shifts beyond the rows, non-finite captured values and
    /// more captured than reference rows.
    #[test]
    fn cpu_pass_matches_reference() {
        for &(rows, cols, slots, ref_rows, n_states) in &[
            (1, 1, 1, 1, 1),
            (37, 24, 3, 38, 5),
            (40, 9, 2, 38, 3),
            (45, 7, 2, 38, 2),
            (300, 1000, 4, 301, 9),
        ] {
            let (x, refs) = case(rows, cols, slots, ref_rows, n_states, 5);
            let cands = candidates(n_states);
            let xw = x.narrow(1, 2, slots * cols).unwrap();
            let got = score_slots(&xw, slots, cols, &refs, &cands).unwrap();
            let want = reference_of(&xw, slots, cols, &refs, &cands);
            assert_sums_close(&got, &want);
        }
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn device_matches_reference() {
        let gpu = crate::kernels::testing::gpu();
        // Tiny ragged, five slots (two slot batches of the float4 kernel), candidates not a
        // multiple of four, and a realistic diff: 3 slots of 4096 at T = 2048 against 33 states.
        // Each in two layouts: column windows at odd strides (the float4 kernel cannot read
        // them and hands over to the per-slot one) and contiguous rows of 16-byte multiples.
        for &(rows, cols, slots, ref_rows, n_states) in &[
            (1, 4, 1, 1, 1),
            (37, 24, 3, 38, 5),
            (70, 300, 5, 66, 3),
            (2048, 4096, 3, 2049, 33),
        ] {
            let (x, refs) = case(rows, cols, slots, ref_rows, n_states, 3);
            let mut cands = candidates(n_states);
            cands.pop();
            let windows = (
                x.narrow(1, 2, slots * cols).unwrap(),
                refs.narrow(2, 1, cols).unwrap(),
                false,
            );
            // Fresh buffers (a one-row window counts as contiguous and keeps its offset).
            let fresh = |t: &Tensor| {
                Tensor::from_vec(
                    t.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    t.shape(),
                    &Device::Cpu,
                )
                .unwrap()
            };
            let packed = (fresh(&windows.0), fresh(&windows.1), true);
            for (xw, rw, aligned) in [windows, packed] {
                let want = reference_of(&xw, slots, cols, &rw, &cands);
                let xg = xw.to_device(&gpu).unwrap();
                let rg = rw.to_device(&gpu).unwrap().contiguous().unwrap();
                let Device::Cuda(dev) = &gpu else {
                    unreachable!()
                };
                let shape = ScoreShape {
                    rows,
                    cols,
                    slots,
                    x_stride: crate::kernels::Matrix::of(xg.layout(), "x").unwrap().stride,
                    n_states,
                    ref_rows,
                    ref_stride: rg.dim(2).unwrap(),
                };
                for kernel in [ScoreKernel::PerSlot, ScoreKernel::Vec4] {
                    let (got, ran) = score_on_gpu(dev, &xg, &rg, &shape, &cands, kernel).unwrap();
                    let expected = match kernel {
                        ScoreKernel::Vec4 if !aligned => ScoreKernel::PerSlot,
                        k => k,
                    };
                    assert_eq!(ran, expected, "rows {rows} slots {slots} aligned {aligned}");
                    assert_sums_close(&got, &want);
                }
            }
        }
    }
}
