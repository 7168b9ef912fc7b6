//! Confidence intervals for per-position figures (the acceptance probe): a block bootstrap over the
//! positions of every token set, the same resampled blocks for every candidate, so that a
//! difference between two layouts is judged on the same positions (paired).
//!
//! Why blocks: whether the draft predicts position t correctly is not independent of position
//! t + 1 (the same phrase, the same feature drift), so resampling single positions would make
//! the intervals too narrow. Blocks of [`BLOCK`] consecutive positions, never crossing a token
//! set, keep that local dependence inside a draw.

use serde::Serialize;

/// Positions per bootstrap block: longer than the few-token dependence of next-token
/// correctness in text, short enough that a few hundred positions still give tens of blocks.
pub const BLOCK: usize = 16;

/// The fewest blocks an interval is drawn from: a percentile bootstrap over a handful of blocks
/// understates the spread (with one block every draw is the same), so fewer positions than
/// `MIN_BLOCKS * BLOCK` are refused rather than given intervals that look certain.
pub const MIN_BLOCKS: usize = 8;

/// Bootstrap resamples: the 2.5% and 97.5% percentiles of 2,000 draws move by well under a
/// tenth of the interval's width between seeds.
pub const RESAMPLES: usize = 2000;

/// A figure with its 95% bootstrap interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Estimate {
    pub value: f64,
    pub lo: f64,
    pub hi: f64,
}

impl Estimate {
    /// Whether the whole interval lies above zero.
    pub fn above_zero(&self) -> bool {
        self.lo > 0.0
    }

    /// `0.656 [0.598, 0.712]` with `digits` decimals.
    pub fn words(&self, digits: usize) -> String {
        format!(
            "{:.d$} [{:.d$}, {:.d$}]",
            self.value,
            self.lo,
            self.hi,
            d = digits
        )
    }
}

/// The positions of every token set, cut into blocks, and one fixed set of resampled block
/// draws shared by every statistic.
pub struct Resampler {
    /// Flat position ranges, one per block.
    blocks: Vec<std::ops::Range<usize>>,
    /// `RESAMPLES` draws of `blocks.len()` block indices each.
    draws: Vec<Vec<u32>>,
    positions: usize,
}

impl Resampler {
    /// `sets`: the number of positions of each token set, in the order the series list them.
    pub fn new(sets: &[usize], seed: u64) -> Resampler {
        let mut blocks = Vec::new();
        let mut at = 0;
        for &n in sets {
            let mut start = 0;
            while start < n {
                let end = (start + BLOCK).min(n);
                blocks.push(at + start..at + end);
                start = end;
            }
            at += n;
        }
        let mut rng = SplitMix64(seed);
        let nb = blocks.len() as u64;
        let draws = (0..RESAMPLES)
            .map(|_| {
                (0..blocks.len())
                    .map(|_| (rng.next() % nb.max(1)) as u32)
                    .collect()
            })
            .collect();
        Resampler {
            blocks,
            draws,
            positions: at,
        }
    }

    pub fn positions(&self) -> usize {
        self.positions
    }

    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The mean of `xs` (one value per position; NaN where a position has none, e.g. a chain
    /// that runs past the sequence) and its 95% interval. NaN when no position has a value.
    pub fn mean(&self, xs: &[f64]) -> Estimate {
        assert_eq!(xs.len(), self.positions, "one value per position");
        let sums: Vec<(f64, f64)> = self
            .blocks
            .iter()
            .map(|r| {
                xs[r.clone()]
                    .iter()
                    .filter(|x| !x.is_nan())
                    .fold((0.0, 0.0), |(s, n), &x| (s + x, n + 1.0))
            })
            .collect();
        let ratio = |(s, n): (f64, f64)| if n > 0.0 { s / n } else { f64::NAN };
        let value = ratio(sums.iter().fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1)));
        let mut means: Vec<f64> = self
            .draws
            .iter()
            .map(|draw| {
                ratio(draw.iter().fold((0.0, 0.0), |a, &b| {
                    let (s, n) = sums[b as usize];
                    (a.0 + s, a.1 + n)
                }))
            })
            .filter(|m| !m.is_nan())
            .collect();
        if means.is_empty() {
            return Estimate {
                value,
                lo: f64::NAN,
                hi: f64::NAN,
            };
        }
        means.sort_by(f64::total_cmp);
        let at = |q: f64| means[((means.len() - 1) as f64 * q).round() as usize];
        Estimate {
            value,
            lo: at(0.025),
            hi: at(0.975),
        }
    }

    /// The mean of `a - b`, position by position (paired), with its interval.
    pub fn diff(&self, a: &[f64], b: &[f64]) -> Estimate {
        let d: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
        self.mean(&d)
    }
}

/// A small, fixed pseudo-random generator (SplitMix64), so that intervals are reproducible
/// run to run.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_never_cross_a_token_set() {
        let r = Resampler::new(&[20, 5, 33], 1);
        assert_eq!(r.positions(), 58);
        assert_eq!(
            r.blocks,
            vec![0..16, 16..20, 20..25, 25..41, 41..57, 57..58]
        );
    }

    #[test]
    fn the_interval_brackets_the_mean_and_narrows_with_more_positions() {
        // Bernoulli(0.3) positions from a fixed generator.
        let mut g = SplitMix64(7);
        let xs: Vec<f64> = (0..4000)
            .map(|_| f64::from(u8::from(g.next() % 10 < 3)))
            .collect();
        let small = Resampler::new(&[400], 3).mean(&xs[..400]);
        let large = Resampler::new(&[4000], 3).mean(&xs);
        for e in [small, large] {
            assert!(e.lo < e.value && e.value < e.hi, "{e:?}");
            assert!((e.value - 0.3).abs() < 0.06, "{e:?}");
        }
        let width = |e: Estimate| e.hi - e.lo;
        // sqrt(10) narrower in expectation; allow slack for the draw.
        assert!(width(large) < 0.5 * width(small), "{small:?} {large:?}");
        // Binomial standard error of 0.3 at n = 4000 is 0.0072: a 95% interval ~0.028 wide.
        assert!((0.015..0.05).contains(&width(large)), "{large:?}");
    }

    #[test]
    fn missing_positions_are_left_out_and_paired_differences_cancel_shared_noise() {
        let r = Resampler::new(&[64], 5);
        let mut xs = vec![1.0; 64];
        xs[10] = f64::NAN;
        xs[40] = 0.0;
        let e = r.mean(&xs);
        assert!((e.value - 62.0 / 63.0).abs() < 1e-12, "{e:?}");
        // b = a + 0.1 everywhere: the paired difference is exactly -0.1 in every draw.
        let a: Vec<f64> = (0..64).map(|i| ((i * 37) % 11) as f64).collect();
        let b: Vec<f64> = a.iter().map(|x| x + 0.1).collect();
        let d = r.diff(&a, &b);
        assert!(
            (d.value + 0.1).abs() < 1e-12 && (d.hi - d.lo).abs() < 1e-12,
            "{d:?}"
        );
        assert!(r.mean(&[f64::NAN; 64]).value.is_nan());
    }
}
