//! Identification: which reference state each slot of a captured tensor really is, and in what
//! state (with or without residual, pre or post final norm, shifted by a token, sharded,
//! rescaled). Decisions use the best cosine and its margin over the runner-up; relative error
//! and norm ratio say how exact the match is and catch scale bugs cosine cannot see.

use crate::diff::reference::RefStates;
use crate::diff::score::{Pairing, Score, View, non_finite, score_all};
use crate::readers::DType as CaptureDType;
use serde::Serialize;

/// Tolerances are data: chosen per capture dtype, with the reason beside each.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Tolerance {
    /// A match this close (`||x - r|| / ||r||`) is called exact.
    pub rel_err: f64,
    /// Below this best cosine a slot is `unidentified`.
    pub identify_cos: f64,
    /// A norm ratio further than this from 1 at a cosine match is a `scale` fault.
    pub scale: f64,
}

impl Tolerance {
    pub fn for_dtype(dtype: CaptureDType) -> Tolerance {
        match dtype {
            // f32 captures: eagle-check's runner matches transformers at <= 1e-6 on the fixtures;
            // 1e-3 leaves room for other f32 kernels (TF32 off) and long sequences.
            CaptureDType::F32 | CaptureDType::F64 => Tolerance {
                rel_err: 1e-3,
                identify_cos: 0.98,
                scale: 1e-2,
            },
            // bf16/f16 captures: storing in bf16 alone costs ~2e-3 relative (8-bit mantissa);
            // a bf16 reproduction on other hardware differs by ~1e-2 (docs/eagle3-capture.md
            // section 6). 4e-2 keeps clean bf16 captures exact with margin.
            _ => Tolerance {
                rel_err: 4e-2,
                identify_cos: 0.98,
                scale: 5e-2,
            },
        }
    }
}

/// What a slot was found to hold, beyond its boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum State {
    /// The residual stream at the boundary (b < L).
    Residual,
    /// b = L before the final norm.
    PreNorm,
    /// b = L after the final norm.
    PostNorm,
    /// The layer's output without the residual added (fused-residual bug).
    NoResidual,
    /// The boundary one token later (+1) or earlier (-1) than the ids say.
    Shifted(i8),
}

impl State {
    pub fn describe(self) -> String {
        match self {
            State::Residual => "residual".into(),
            State::PreNorm => "pre-norm".into(),
            State::PostNorm => "post-norm".into(),
            State::NoResidual => "no-residual".into(),
            State::Shifted(d) => format!("shifted {d:+} token"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Candidate {
    pub boundary: usize,
    pub state: State,
}

/// The identification of one slot of one sample.
#[derive(Debug, Clone, Serialize)]
pub struct SlotId {
    pub slot: usize,
    /// `None` when no candidate reaches the identification cosine.
    pub found: Option<Candidate>,
    pub best: Candidate,
    pub score: Score,
    pub runner_up: Option<Candidate>,
    /// Best cosine minus the runner-up's.
    pub margin: f64,
    /// Cosine of the best candidate minus the best of its boundary neighbours (b - 1, b + 1,
    /// same state): how clearly adjacent boundaries were told apart.
    pub neighbour_margin: Option<f64>,
    pub non_finite: usize,
    /// Width / H < 1: the slot holds the leading `1/tp` of the hidden axis.
    pub shard_tp: Option<usize>,
    pub scaled: bool,
    pub exact: bool,
}

/// Builds the delta `h[b] - h[b-1]` (the whole layer's contribution), used as the no-residual
/// candidate when the reference has no separate MLP output.
fn delta(upper: &[f32], lower: &[f32]) -> Vec<f32> {
    upper.iter().zip(lower).map(|(a, b)| a - b).collect()
}

/// The no-residual candidates the reference lacks, as `h[b] - h[b-1]` per b (computed once per
/// sample and shared by its slots).
pub fn no_residual_deltas(refs: &RefStates) -> Vec<Option<Vec<f32>>> {
    let l = refs.num_layers;
    (0..=l)
        .map(|b| {
            if b == 0 || refs.no_residual.get(b).is_some_and(Option::is_some) {
                return None;
            }
            let upper = if b == l {
                refs.final_pre_norm.as_ref().or(refs.boundaries[b].as_ref())
            } else {
                refs.boundaries[b].as_ref()
            };
            Some(delta(upper?, refs.boundaries[b - 1].as_ref()?))
        })
        .collect()
}

/// Identifies one slot `x` (a view of `rows` x `width`) against every candidate of `refs`.
pub fn identify_slot<'a>(
    slot: usize,
    x: View<'a>,
    refs: &'a RefStates,
    deltas: &'a [Option<Vec<f32>>],
    tol: &Tolerance,
) -> SlotId {
    let (h, l) = (refs.hidden_size, refs.num_layers);
    let rows = refs.rows();
    let width = x.cols;
    let shard_tp = (width < h && width > 0 && h % width == 0).then(|| h / width);
    let cols = width.min(h);
    let view = |data: &'a [f32]| -> View<'a> {
        View {
            data,
            rows,
            stride: h,
            col: 0,
            cols,
        }
    };

    let mut cands: Vec<(Candidate, Pairing)> = Vec::new();
    let mut add = |boundary: usize, state: State, data: &'a [f32], shift: isize| {
        cands.push((
            Candidate { boundary, state },
            Pairing {
                reference: view(data),
                shift,
            },
        ));
    };
    for (b, data) in refs.boundaries.iter().enumerate() {
        let Some(data) = data else { continue };
        add(
            b,
            if b == l {
                State::PostNorm
            } else {
                State::Residual
            },
            data,
            0,
        );
        add(b, State::Shifted(1), data, 1);
        add(b, State::Shifted(-1), data, -1);
    }
    if let Some(data) = &refs.final_pre_norm {
        add(l, State::PreNorm, data, 0);
        add(l, State::Shifted(1), data, 1);
        add(l, State::Shifted(-1), data, -1);
    }
    for b in 1..=l {
        match (refs.no_residual.get(b), deltas.get(b)) {
            (Some(Some(data)), _) => add(b, State::NoResidual, data, 0),
            (_, Some(Some(data))) => add(b, State::NoResidual, data, 0),
            _ => {}
        }
    }
    let x = View {
        rows: x.rows.min(rows),
        ..x
    }
    .columns(0, cols);
    let pairings: Vec<Pairing> = cands.iter().map(|(_, p)| *p).collect();
    let scores = score_all(x, &pairings);

    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].cosine.total_cmp(&scores[a].cosine));
    let best_i = order.first().copied().unwrap_or(0);
    let best = cands.get(best_i).map(|c| c.0).unwrap_or(Candidate {
        boundary: 0,
        state: State::Residual,
    });
    let score = scores.get(best_i).copied().unwrap_or_default();
    let runner = order.iter().copied().find(|&i| cands[i].0 != best);
    let margin = runner.map_or(1.0, |i| score.cosine - scores[i].cosine);
    let neighbour_margin = cands
        .iter()
        .enumerate()
        .filter(|(_, (c, _))| {
            c.state == best.state
                && (c.boundary + 1 == best.boundary || best.boundary + 1 == c.boundary)
        })
        .map(|(i, _)| scores[i].cosine)
        .reduce(f64::max)
        .map(|n| score.cosine - n);
    let identified = score.cosine >= tol.identify_cos;
    SlotId {
        slot,
        found: identified.then_some(best),
        best,
        score,
        runner_up: runner.map(|i| cands[i].0),
        margin,
        neighbour_margin,
        non_finite: non_finite(x),
        shard_tp,
        scaled: identified && (score.norm_ratio - 1.0).abs() > tol.scale,
        exact: score.rel_err <= tol.rel_err,
    }
}
