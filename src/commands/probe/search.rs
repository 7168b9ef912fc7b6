//! `probe --search`: the k-slot layout the drafter predicts the target best from, without a
//! spec. Every slot ranges over b = 0..L-1 and b = L on either side of the final norm; the
//! objective is the first draft step's mean cross-entropy against the target's next-token
//! distribution (the statistic the probe ranks by).
//!
//! `fc` is linear, so `fc(cat(s_0, .., s_k)) = sum_i s_i W_i^T (+ bias)`: each boundary is
//! projected through each slot's columns once, and a layout's fc output is a sum of cached
//! parts. Only the draft layer runs per layout. The search is exhaustive when the number of
//! layouts is small, else a coordinate ascent (each slot in turn over every tap, the others
//! held) from every fed layout, the reference layout and the EAGLE default, until a sweep
//! changes nothing.

use super::Probe;
use super::layout::{Layout, Tap};
use crate::boundary::default_boundaries;
use crate::error::{CandleContext, Result};
use crate::model::Progress;
use candle_core::Tensor;
use std::collections::HashMap;
use std::time::Instant;

/// Above this many layouts the search climbs instead of enumerating.
pub const EXHAUSTIVE_MAX: usize = 4096;

/// What the search found.
pub struct Found {
    /// The best layout, then the runner-up (the best other layout scored).
    pub top: Vec<Layout>,
    /// Layouts scored.
    pub evaluated: usize,
    /// Draft passes the search ran.
    pub passes: usize,
    pub seconds: f64,
    /// `exhaustive` or `coordinate ascent from N starts`.
    pub method: String,
}

/// The cached `fc` parts and the scores of every layout seen.
struct Scorer<'a> {
    probe: &'a mut Probe,
    /// (slot, tap) -> per set [rows, H]
    parts: HashMap<(usize, Tap), Vec<Tensor>>,
    scores: HashMap<Layout, f64>,
}

impl Scorer<'_> {
    fn part(&mut self, slot: usize, tap: Tap) -> Result<Vec<Tensor>> {
        if let Some(p) = self.parts.get(&(slot, tap)) {
            return Ok(p.clone());
        }
        let w = self.probe.draft.fc_slot_weight(slot, self.probe.k)?;
        let p = self
            .probe
            .sets
            .iter()
            .map(|set| {
                let x = set.tap(tap)?.to_dtype(w.dtype()).ctx(|| "fc part".into())?;
                w.t()
                    .and_then(|wt| x.matmul(&wt))
                    .ctx(|| format!("fc part of slot {slot}, b = {tap}"))
            })
            .collect::<Result<Vec<_>>>()?;
        self.parts.insert((slot, tap), p.clone());
        Ok(p)
    }

    /// Mean first-step cross-entropy of `layout` over every probed position.
    fn score(&mut self, layout: &Layout) -> Result<f64> {
        if let Some(&s) = self.scores.get(layout) {
            return Ok(s);
        }
        let mut sums: Option<Vec<Tensor>> = None;
        for (slot, &tap) in layout.0.iter().enumerate() {
            let part = self.part(slot, tap)?;
            sums = Some(match sums {
                None => part,
                Some(acc) => acc
                    .iter()
                    .zip(&part)
                    .map(|(a, b)| (a + b).ctx(|| "fc parts".into()))
                    .collect::<Result<Vec<_>>>()?,
            });
        }
        let mut fc = sums.unwrap_or_default();
        if let Some(bias) = self.probe.draft.fc_bias() {
            fc = fc
                .iter()
                .map(|x| x.broadcast_add(bias).ctx(|| "fc bias".into()))
                .collect::<Result<Vec<_>>>()?;
        }
        let series = self.probe.score_fc(&fc, 1)?;
        let (sum, n) = series
            .cross_entropy
            .iter()
            .filter(|x| !x.is_nan())
            .fold((0.0, 0usize), |(s, n), &x| (s + x, n + 1));
        let mean = if n > 0 { sum / n as f64 } else { f64::INFINITY };
        self.scores.insert(layout.clone(), mean);
        Ok(mean)
    }
}

/// Every layout of `k` taps from `taps` that takes no boundary twice.
fn all_layouts(taps: &[Tap], k: usize, limit: usize) -> Option<Vec<Layout>> {
    fn go(taps: &[Tap], k: usize, cur: &mut Vec<Tap>, out: &mut Vec<Layout>, limit: usize) -> bool {
        if cur.len() == k {
            out.push(Layout(cur.clone()));
            return out.len() <= limit;
        }
        for &t in taps {
            if cur.iter().any(|c| c.b == t.b) {
                continue;
            }
            cur.push(t);
            let ok = go(taps, k, cur, out, limit);
            cur.pop();
            if !ok {
                return false;
            }
        }
        true
    }
    let mut out = Vec::new();
    go(taps, k, &mut Vec::new(), &mut out, limit).then_some(out)
}

/// Searches the k-slot layouts of a model of `l` layers for the lowest cross-entropy.
pub(crate) fn search(
    probe: &mut Probe,
    fed: &[Layout],
    reference: &Layout,
    l: usize,
) -> Result<Found> {
    let started = Instant::now();
    let passes_before = probe.passes;
    let k = probe.k;
    let taps = Tap::all(l);
    let mut scorer = Scorer {
        probe,
        parts: HashMap::new(),
        scores: HashMap::new(),
    };
    let method = match all_layouts(&taps, k, EXHAUSTIVE_MAX) {
        Some(layouts) => {
            let mut progress = Progress::new("layout search");
            for (i, x) in layouts.iter().enumerate() {
                scorer.score(x)?;
                progress.tick(i + 1, layouts.len());
            }
            progress.finish();
            "exhaustive".to_string()
        }
        None => {
            let mut starts: Vec<Layout> = fed.to_vec();
            starts.push(reference.clone());
            if k == 3 {
                starts.push(Layout(
                    default_boundaries(l)
                        .iter()
                        .map(|b| Tap::new(b.0, l, None))
                        .collect(),
                ));
            }
            starts.retain(|x| x.0.len() == k && x.distinct());
            starts.dedup();
            let mut progress = Progress::new("layout search");
            for (i, start) in starts.iter().enumerate() {
                climb(&mut scorer, start.clone(), &taps)?;
                progress.tick(i + 1, starts.len());
            }
            progress.finish();
            format!("coordinate ascent from {} starts", starts.len())
        }
    };
    let mut ranked: Vec<(&Layout, f64)> = scorer.scores.iter().map(|(x, &s)| (x, s)).collect();
    ranked.sort_by(|a, b| a.1.total_cmp(&b.1).then_with(|| a.0.cmp(b.0)));
    let top = ranked.iter().take(2).map(|(x, _)| (*x).clone()).collect();
    let evaluated = scorer.scores.len();
    Ok(Found {
        top,
        evaluated,
        passes: scorer.probe.passes - passes_before,
        seconds: started.elapsed().as_secs_f64(),
        method,
    })
}

/// Coordinate ascent from `start`: each slot in turn moves to its best tap, until a whole sweep
/// changes nothing.
fn climb(scorer: &mut Scorer, start: Layout, taps: &[Tap]) -> Result<Layout> {
    let mut cur = start;
    let mut best = scorer.score(&cur)?;
    loop {
        let mut moved = false;
        for slot in 0..cur.0.len() {
            for &tap in taps {
                if cur
                    .0
                    .iter()
                    .enumerate()
                    .any(|(i, t)| i != slot && t.b == tap.b)
                {
                    continue;
                }
                let mut x = cur.clone();
                x.0[slot] = tap;
                let s = scorer.score(&x)?;
                if s < best {
                    best = s;
                    cur = x;
                    moved = true;
                }
            }
        }
        if !moved {
            return Ok(cur);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_layout_takes_each_boundary_once() {
        let taps = Tap::all(4); // b = 0..3, 4 pre, 4 post
        let all = all_layouts(&taps, 2, 1000).unwrap();
        // 6 x 5 ordered pairs, minus the two that take b = 4 twice (pre, post and post, pre).
        assert_eq!(all.len(), 28);
        assert!(all.iter().all(Layout::distinct));
        assert!(all_layouts(&taps, 3, 10).is_none());
    }
}
