//! Scoring a captured slot against every candidate reference state in one pass over the data.
//!
//! For each candidate the pass accumulates `x.x`, `x.c` and `c.c` (f64) over the rows both
//! cover; cosine, relative error and norm ratio follow from those three sums. The loop reads each
//! captured row once and the candidates' matching rows beside it, so it maps onto one GPU kernel
//! (a block per row, a reduction per candidate) without changing the results.

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
