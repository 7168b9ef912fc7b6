//! Scoring a captured slot against every candidate reference state: the arithmetic the diff
//! engine ([`crate::diff`]) and the GPU scoring kernel ([`crate::kernels::score`]) share.
//!
//! For each (slot, candidate) pair the scores follow from three sums over the rows both cover:
//! `x.x`, `x.c` and `c.c`. [`pair_sums`] computes them for every pair at once, shaped as the
//! matrix product `[slots x shifts, width] . [width, states]` taken in one pass over the
//! reference states (each reference row is read once; the slots sit in cache beside it), with
//! f32 products summed per row and the rows summed in f64. The GPU runs the same product in
//! kernels/score.cu. Those sums rank the candidates; [`score_all`] then recomputes the chosen
//! pair in f64 throughout, so the reported relative error (`x.x - 2 x.c + c.c`, which cancels
//! for a match) keeps full precision.

use serde::Serialize;

/// A row-major window of a matrix: `rows` rows of `cols` values starting at column `col`.
#[derive(Clone, Copy, Debug)]
pub struct View<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub stride: usize,
    pub col: usize,
    pub cols: usize,
}

impl<'a> View<'a> {
    /// The whole of a `[rows, cols]` buffer.
    pub fn full(data: &'a [f32], rows: usize, cols: usize) -> View<'a> {
        View {
            data,
            rows,
            stride: cols,
            col: 0,
            cols,
        }
    }

    pub fn row(&self, t: usize) -> &'a [f32] {
        let start = t * self.stride + self.col;
        &self.data[start..start + self.cols]
    }

    /// Columns `col..col + cols` of this view.
    pub fn columns(&self, col: usize, cols: usize) -> View<'a> {
        View {
            col: self.col + col,
            cols,
            ..*self
        }
    }

    /// True when every row this view names lies inside `data`.
    pub fn is_valid(&self) -> bool {
        self.rows == 0 || (self.rows - 1) * self.stride + self.col + self.cols <= self.data.len()
    }
}

/// A candidate: reference row `t + shift` is compared with captured row `t`.
#[derive(Clone, Copy, Debug)]
pub struct Pairing<'a> {
    pub reference: View<'a>,
    pub shift: isize,
}

/// How one captured slot compares with one candidate.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Score {
    pub cosine: f64,
    /// `||x - c|| / ||c||`
    pub rel_err: f64,
    /// `||x|| / ||c||`: cosine alone misses scale bugs (a 50x embedding scale read cosine 1.000003).
    pub norm_ratio: f64,
    /// Rows both sides covered.
    pub rows: usize,
}

/// Scores `x` against every candidate. Non-finite captured values are skipped (the caller counts
/// them with [`non_finite`]).
pub fn score_all(x: View, candidates: &[Pairing]) -> Vec<Score> {
    let n = candidates.len();
    let mut xx = vec![0f64; n];
    let mut xc = vec![0f64; n];
    let mut cc = vec![0f64; n];
    let mut rows = vec![0usize; n];
    for t in 0..x.rows {
        let xr = x.row(t);
        for (j, cand) in candidates.iter().enumerate() {
            let rt = t as isize + cand.shift;
            if rt < 0 || rt as usize >= cand.reference.rows {
                continue;
            }
            let cr = cand.reference.row(rt as usize);
            let (mut a, mut b, mut c) = (0f64, 0f64, 0f64);
            for (&xv, &cv) in xr.iter().zip(cr) {
                if !xv.is_finite() {
                    continue;
                }
                let (xv, cv) = (xv as f64, cv as f64);
                a += xv * xv;
                b += xv * cv;
                c += cv * cv;
            }
            xx[j] += a;
            xc[j] += b;
            cc[j] += c;
            rows[j] += 1;
        }
    }
    (0..n)
        .map(|j| Score::from_sums(xx[j], xc[j], cc[j], rows[j]))
        .collect()
}

/// The three sums of one (slot, candidate) pair over the rows both cover.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PairSums {
    pub xx: f64,
    pub xc: f64,
    pub cc: f64,
    pub rows: usize,
}

impl PairSums {
    pub fn score(&self) -> Score {
        Score::from_sums(self.xx, self.xc, self.cc, self.rows)
    }
}

/// Rows of a reference state per task of the parallel pass: enough work per task to amortise
/// its partial sums, few enough tasks' partials to keep the reduction small.
const ROWS_PER_TASK: usize = 32;

/// The sums of every slot of `xs` (each `cols` wide, the same `cols` for all) against every
/// candidate `(state, shift)`: captured row t pairs with row `t + shift` of `states[state]`,
/// over the first `cols` columns, for the t with `0 <= t + shift < ref_rows`; non-finite captured
/// values are skipped (with the reference values they pair with). All states have `ref_rows`
/// rows. Returns the pairs slot-major (`[slots, candidates]`).
///
/// Each slot is copied once into a zero-padded buffer, so that the captured row of every shift
/// lines up with reference row r without a bounds test (a missing row is zeros and adds
/// nothing), then one pass over the reference rows, split across threads in fixed chunks and
/// reduced in chunk order: the result does not depend on the thread count.
pub fn pair_sums(xs: &[View], states: &[View], candidates: &[(usize, isize)]) -> Vec<PairSums> {
    let n = candidates.len();
    let mut out = vec![PairSums::default(); xs.len() * n];
    let (Some(first), Some(state0)) = (xs.first(), states.first()) else {
        return out;
    };
    let cols = first.cols;
    let ref_rows = state0.rows;
    debug_assert!(xs.iter().all(|x| x.cols == cols));
    debug_assert!(states.iter().all(|v| v.rows == ref_rows && v.cols >= cols));
    // A shift of `reach` rows or more pairs no captured row with any reference row.
    let reach = ref_rows + xs.iter().map(|x| x.rows).max().unwrap_or(0);
    let pad = candidates
        .iter()
        .map(|&(_, d)| d.unsigned_abs())
        .filter(|&d| d < reach)
        .max()
        .unwrap_or(0);
    let padded_rows = ref_rows + 2 * pad;

    // The slots, zero-padded and with non-finite values zeroed (remembered for `c.c`).
    let mut bad: Vec<Vec<(usize, usize)>> = vec![Vec::new(); xs.len()];
    let mut x_norms: Vec<Vec<f64>> = Vec::with_capacity(xs.len());
    let padded: Vec<Vec<f32>> = xs
        .iter()
        .enumerate()
        .map(|(i, x)| {
            let mut buf = vec![0f32; padded_rows * cols];
            // captured rows past ref_rows + pad pair with no reference row at any shift
            let rows = x.rows.min(ref_rows + pad);
            let mut norms = vec![0f64; rows];
            for (t, norm) in norms.iter_mut().enumerate() {
                let dst = &mut buf[(t + pad) * cols..][..cols];
                for (c, (d, &v)) in dst.iter_mut().zip(x.row(t)).enumerate() {
                    if v.is_finite() {
                        *d = v;
                    } else {
                        bad[i].push((t, c));
                    }
                }
                *norm = dot(dst, dst);
            }
            x_norms.push(norms);
            buf
        })
        .collect();

    // Which shifts each state is paired with, and where each (slot, state, shift) accumulates.
    let mut shifts_of: Vec<Vec<isize>> = vec![Vec::new(); states.len()];
    for &(q, d) in candidates {
        if q < states.len() && !shifts_of[q].contains(&d) && d.unsigned_abs() <= pad {
            shifts_of[q].push(d);
        }
    }
    let mut slot_of = vec![vec![usize::MAX; 0]; states.len()];
    let mut width = 0;
    for (q, shifts) in shifts_of.iter().enumerate() {
        slot_of[q] = (0..shifts.len()).map(|k| width + k).collect();
        width += shifts.len();
    }
    let used: Vec<usize> = (0..states.len())
        .filter(|&q| !shifts_of[q].is_empty())
        .collect();

    // The pass: per task, the dot products of its rows [slots, width] and the row norms of
    // every used state.
    let tasks: Vec<(usize, usize)> = (0..ref_rows)
        .step_by(ROWS_PER_TASK)
        .map(|r0| (r0, (r0 + ROWS_PER_TASK).min(ref_rows)))
        .collect();
    let partials: Vec<TaskSums> = {
        use rayon::prelude::*;
        tasks
            .par_iter()
            .map(|&(r0, r1)| {
                let mut acc = vec![0f64; xs.len() * width];
                let mut norms = Vec::with_capacity((r1 - r0) * used.len());
                for r in r0..r1 {
                    for &q in &used {
                        let c = &states[q].row(r)[..cols];
                        norms.push((q, r, dot(c, c)));
                        for (k, &d) in shifts_of[q].iter().enumerate() {
                            // captured row t = r - shift, stored at row t + pad
                            let at = (r as isize - d + pad as isize) as usize * cols;
                            for (i, buf) in padded.iter().enumerate() {
                                acc[i * width + slot_of[q][k]] += dot(&buf[at..at + cols], c);
                            }
                        }
                    }
                }
                (acc, norms)
            })
            .collect()
    };
    let mut xc = vec![0f64; xs.len() * width];
    let mut c_norms = vec![vec![0f64; ref_rows]; states.len()];
    for (acc, norms) in partials {
        for (a, b) in xc.iter_mut().zip(acc) {
            *a += b;
        }
        for (q, r, v) in norms {
            c_norms[q][r] = v;
        }
    }

    for (i, x) in xs.iter().enumerate() {
        let rows = x.rows.min(ref_rows + pad);
        for (j, &(q, d)) in candidates.iter().enumerate() {
            let pair = &mut out[i * n + j];
            let t0 = (-d).max(0) as usize;
            let t1 = (ref_rows as isize - d).clamp(0, rows as isize) as usize;
            if q >= states.len() || t0 >= t1 || d.unsigned_abs() > pad {
                continue;
            }
            pair.rows = t1 - t0;
            pair.xx = x_norms[i][t0..t1].iter().sum();
            let r = |t: usize| (t as isize + d) as usize;
            pair.cc = (t0..t1).map(|t| c_norms[q][r(t)]).sum();
            // c.c skips the reference values beside non-finite captured ones.
            for &(t, c) in &bad[i] {
                if (t0..t1).contains(&t) {
                    let v = f64::from(states[q].row(r(t))[c]);
                    pair.cc -= v * v;
                }
            }
            if let Some(k) = shifts_of[q].iter().position(|&s| s == d) {
                pair.xc = xc[i * width + slot_of[q][k]];
            }
        }
    }
    out
}

/// One task's share of the pass: its dot products `[slot, pairing]` and the norms of the
/// reference rows it read, as (state, row, norm).
type TaskSums = (Vec<f64>, Vec<(usize, usize, f64)>);

/// `a . b` with f32 products summed in eight lanes, returned as f64 (AVX2 + FMA when the CPU
/// has them).
fn dot(a: &[f32], b: &[f32]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports the features the function is compiled for.
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_lanes::<false>(a, b)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f64 {
    dot_lanes::<true>(a, b)
}

/// `FMA`: fused multiply-adds (only where the CPU has them: without, `mul_add` is a libm call).
#[inline(always)]
fn dot_lanes<const FMA: bool>(a: &[f32], b: &[f32]) -> f64 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut lanes = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for k in 0..8 {
            lanes[k] = if FMA {
                x[k].mul_add(y[k], lanes[k])
            } else {
                lanes[k] + x[k] * y[k]
            };
        }
    }
    let mut sum: f64 = lanes.iter().map(|&v| f64::from(v)).sum();
    for (&x, &y) in ca.remainder().iter().zip(cb.remainder()) {
        sum += f64::from(x) * f64::from(y);
    }
    sum
}

impl Score {
    /// The scores that follow from `x.x`, `x.c` and `c.c` summed over `rows` rows (shared with
    /// the GPU scoring in `kernels::score`, which returns the three sums).
    pub fn from_sums(xx: f64, xc: f64, cc: f64, rows: usize) -> Score {
        let denom = (xx * cc).sqrt();
        Score {
            cosine: if denom > 0.0 { xc / denom } else { 0.0 },
            rel_err: if cc > 0.0 {
                ((xx - 2.0 * xc + cc).max(0.0) / cc).sqrt()
            } else {
                f64::INFINITY
            },
            norm_ratio: if cc > 0.0 {
                (xx / cc).sqrt()
            } else {
                f64::INFINITY
            },
            rows,
        }
    }
}

/// NaN and Inf values in the view.
pub fn non_finite(x: View) -> usize {
    (0..x.rows)
        .map(|t| x.row(t).iter().filter(|v| !v.is_finite()).count())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_follow_their_definitions() {
        let c: Vec<f32> = (0..12).map(|i| (i as f32 * 0.7).sin() + 0.1).collect();
        let scaled: Vec<f32> = c.iter().map(|v| v * 50.0).collect();
        let cv = View::full(&c, 4, 3);
        let s = score_all(
            View::full(&scaled, 4, 3),
            &[Pairing {
                reference: cv,
                shift: 0,
            }],
        )[0];
        assert!((s.cosine - 1.0).abs() < 1e-9, "scale leaves cosine at 1");
        assert!((s.norm_ratio - 50.0).abs() < 1e-6);
        assert!((s.rel_err - 49.0).abs() < 1e-6);
        let same = score_all(
            cv,
            &[Pairing {
                reference: cv,
                shift: 0,
            }],
        )[0];
        assert!(same.rel_err < 1e-12 && (same.norm_ratio - 1.0).abs() < 1e-12);
        // A one-row shift compares rows 0..3 with 1..4.
        let shifted = score_all(
            View::full(&c[3..], 3, 3),
            &[Pairing {
                reference: cv,
                shift: 1,
            }],
        )[0];
        assert_eq!(shifted.rows, 3);
        assert!(shifted.rel_err < 1e-12);
    }
}
