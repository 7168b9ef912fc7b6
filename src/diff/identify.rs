//! Identification: which reference state each slot of a captured tensor really is, and in what
//! state (with or without residual, pre or post final norm, shifted by a token, sharded,
//! rescaled). Decisions use the best cosine and its margin over the runner-up; relative error
//! and norm ratio say how exact the match is and catch scale bugs cosine cannot see.

use crate::diff::reference::RefStates;
use crate::score::{PairSums, Pairing, Score, View, non_finite, pair_sums, score_all};
use crate::tolerance::{CaptureTolerance, identification_angle};
use candle_core::{Device, Tensor};
use serde::Serialize;

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
    /// `None` when the best candidate lies outside its identification angle
    /// ([`identification_angle`]: half its angle to the nearest other candidate).
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
    /// The largest angle (radians) at which this slot would be identified as `best`, derived
    /// from the reference states of this sample.
    pub identify_angle: f64,
    /// `best` and its nearest other candidate are closer than the capture dtype's rounding can
    /// tell apart: the identification stands on noise.
    pub ambiguous: bool,
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

/// Identifies one slot `x` (a view of `rows` x `width`) against every candidate of `refs`, on
/// the CPU.
pub fn identify_slot<'a>(
    slot: usize,
    x: View<'a>,
    refs: &'a RefStates,
    deltas: &'a [Option<Vec<f32>>],
    tol: &CaptureTolerance,
) -> SlotId {
    let mut id = identify_slots(&[x], refs, deltas, tol, &Device::Cpu)
        .pop()
        .expect("one slot in, one identification out");
    id.slot = slot;
    id
}

/// Every candidate reference state of a sample: the states (each `[rows, H]`) and the
/// candidates that pair a captured row with a row of one of them.
struct Candidates<'a> {
    states: Vec<&'a [f32]>,
    /// (what it is, which state, shift: captured row t pairs with state row t + shift)
    list: Vec<(Candidate, usize, isize)>,
}

impl<'a> Candidates<'a> {
    fn of(refs: &'a RefStates, deltas: &'a [Option<Vec<f32>>]) -> Candidates<'a> {
        let l = refs.num_layers;
        let mut c = Candidates {
            states: Vec::new(),
            list: Vec::new(),
        };
        let mut add = |data: &'a [f32], found: &[(usize, State, isize)]| {
            c.states.push(data);
            let q = c.states.len() - 1;
            for &(boundary, state, shift) in found {
                c.list.push((Candidate { boundary, state }, q, shift));
            }
        };
        for (b, data) in refs.boundaries.iter().enumerate() {
            let Some(data) = data else { continue };
            let state = if b == l {
                State::PostNorm
            } else {
                State::Residual
            };
            add(
                data,
                &[
                    (b, state, 0),
                    (b, State::Shifted(1), 1),
                    (b, State::Shifted(-1), -1),
                ],
            );
        }
        if let Some(data) = &refs.final_pre_norm {
            add(
                data,
                &[
                    (l, State::PreNorm, 0),
                    (l, State::Shifted(1), 1),
                    (l, State::Shifted(-1), -1),
                ],
            );
        }
        for b in 1..=l {
            match (refs.no_residual.get(b), deltas.get(b)) {
                (Some(Some(data)), _) | (_, Some(Some(data))) => {
                    add(data, &[(b, State::NoResidual, 0)])
                }
                _ => {}
            }
        }
        c
    }

    /// State `q` as a view of its first `cols` columns.
    fn view(&self, q: usize, rows: usize, h: usize, cols: usize) -> View<'a> {
        View {
            data: self.states[q],
            rows,
            stride: h,
            col: 0,
            cols,
        }
    }

    /// The sums of every slot of `xs` against `pairs` (state, shift): [`pair_sums`] on the CPU,
    /// kernels/score.cu on a CUDA device (the data uploaded per sample).
    fn sums(
        &self,
        xs: &[View],
        pairs: &[(usize, isize)],
        (rows, h, cols): (usize, usize, usize),
        device: &Device,
    ) -> Vec<PairSums> {
        if !device.is_cpu() {
            match self.sums_on(xs, pairs, (rows, h, cols), device) {
                Ok(sums) => return sums,
                Err(e) => eprintln!("warning: scoring on the GPU failed ({e}); scoring on the CPU"),
            }
        }
        let states: Vec<View> = (0..self.states.len())
            .map(|q| self.view(q, rows, h, cols))
            .collect();
        pair_sums(xs, &states, pairs)
    }

    fn sums_on(
        &self,
        xs: &[View],
        pairs: &[(usize, isize)],
        (rows, h, cols): (usize, usize, usize),
        device: &Device,
    ) -> candle_core::Result<Vec<PairSums>> {
        let x_rows = xs.iter().map(|x| x.rows).min().unwrap_or(0);
        let mut host = Vec::with_capacity(x_rows * xs.len() * cols);
        for t in 0..x_rows {
            for x in xs {
                host.extend_from_slice(x.row(t));
            }
        }
        let x = Tensor::from_vec(host, (x_rows, xs.len() * cols), device)?;
        let states = self
            .states
            .iter()
            .map(|s| Tensor::from_slice(&s[..rows * h], (rows, h), device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let refs = Tensor::stack(&states, 0)?;
        crate::kernels::score::score_slots(&x, xs.len(), cols, &refs, pairs)
    }
}

/// Identifies every slot of one sample (views of equal width) against every candidate of
/// `refs`. The candidates are ranked by sums from one matrix-product pass over all of them
/// (`device`: where that pass runs); the best one is then rescored in f64 throughout, so its
/// relative error keeps full precision.
pub fn identify_slots<'a>(
    xs: &[View<'a>],
    refs: &'a RefStates,
    deltas: &'a [Option<Vec<f32>>],
    tol: &CaptureTolerance,
    device: &Device,
) -> Vec<SlotId> {
    let (h, rows) = (refs.hidden_size, refs.rows());
    let Some(width) = xs.first().map(|x| x.cols) else {
        return Vec::new();
    };
    if xs.iter().any(|x| x.cols != width) {
        // Slots of different widths score apart.
        return xs
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let mut id = identify_slots(&[*x], refs, deltas, tol, device)
                    .pop()
                    .expect("one slot in, one identification out");
                id.slot = i;
                id
            })
            .collect();
    }
    let shard_tp = (width < h && width > 0 && h % width == 0).then(|| h / width);
    let cols = width.min(h);
    let cands = Candidates::of(refs, deltas);
    let pairs: Vec<(usize, isize)> = cands.list.iter().map(|&(_, q, d)| (q, d)).collect();
    let xs: Vec<View> = xs
        .iter()
        .map(|x| {
            View {
                rows: x.rows.min(rows),
                ..*x
            }
            .columns(0, cols)
        })
        .collect();
    let shape = (rows, h, cols);
    let sums = cands.sums(&xs, &pairs, shape, device);
    let n = pairs.len();
    let pairing = |j: usize| {
        let (_, q, shift) = cands.list[j];
        Pairing {
            reference: cands.view(q, rows, h, cols),
            shift,
        }
    };

    // How far candidate j lies from every other candidate, in the captured rows' alignment:
    // its reference rows scored against the others, shifts taken relative (once per distinct
    // best candidate of the sample).
    let mut nearest_of: Vec<Option<f64>> = vec![None; n];
    let mut nearest = |j: usize| -> f64 {
        if let Some(v) = nearest_of[j] {
            return v;
        }
        let (best, q, shift) = cands.list[j];
        let others: Vec<(usize, isize)> = cands
            .list
            .iter()
            .enumerate()
            .filter(|&(i, (c, _, _))| i != j && *c != best)
            .map(|(_, &(_, p, d))| (p, d - shift))
            .collect();
        let v = cands
            .sums(&[cands.view(q, rows, h, cols)], &others, shape, device)
            .iter()
            .filter(|s| s.rows > 0)
            .map(|s| s.score().cosine)
            .fold(-1.0, f64::max);
        nearest_of[j] = Some(v);
        v
    };

    xs.iter()
        .enumerate()
        .map(|(i, &x)| {
            let scores: Vec<Score> = sums[i * n..(i + 1) * n].iter().map(|s| s.score()).collect();
            let mut order: Vec<usize> = (0..n).collect();
            order.sort_by(|&a, &b| scores[b].cosine.total_cmp(&scores[a].cosine));
            let best_i = order.first().copied();
            let best = best_i.map_or(
                Candidate {
                    boundary: 0,
                    state: State::Residual,
                },
                |j| cands.list[j].0,
            );
            // The best pair again, in f64 throughout.
            let score = best_i.map_or_else(Score::default, |j| score_all(x, &[pairing(j)])[0]);
            let runner = order.iter().copied().find(|&j| cands.list[j].0 != best);
            let margin = runner.map_or(1.0, |j| score.cosine - scores[j].cosine);
            let neighbour_margin = cands
                .list
                .iter()
                .enumerate()
                .filter(|(_, (c, _, _))| {
                    c.state == best.state
                        && (c.boundary + 1 == best.boundary || best.boundary + 1 == c.boundary)
                })
                .map(|(j, _)| scores[j].cosine)
                .reduce(f64::max)
                .map(|v| score.cosine - v);
            let nearest = best_i.map_or(1.0, &mut nearest);
            let identify_angle = identification_angle(nearest, tol.noise_angle);
            let identified = score.cosine.clamp(-1.0, 1.0).acos() <= identify_angle;
            SlotId {
                slot: i,
                found: identified.then_some(best),
                best,
                score,
                runner_up: runner.map(|j| cands.list[j].0),
                margin,
                neighbour_margin,
                non_finite: non_finite(x),
                shard_tp,
                scaled: identified && (score.norm_ratio - 1.0).abs() > tol.scale,
                exact: score.rel_err <= tol.rel_err,
                identify_angle,
                ambiguous: nearest.clamp(-1.0, 1.0).acos() / 2.0 < tol.noise_angle,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::readers::DType;

    /// One token, three dimensions: b = 0 along x, b = 1 at `sep_deg` from it in the x-y
    /// plane, b = 2 (post-norm) along z, pre-norm = b = 2.
    fn refs(sep_deg: f64) -> RefStates {
        let r = sep_deg.to_radians();
        let b1 = vec![r.cos() as f32, r.sin() as f32, 0.0];
        RefStates {
            tokens: vec![0],
            hidden_size: 3,
            num_layers: 2,
            boundaries: vec![
                Some(vec![1.0, 0.0, 0.0]),
                Some(b1),
                Some(vec![0.0, 0.0, 1.0]),
            ],
            final_pre_norm: Some(vec![0.0, 0.0, 1.0]),
            no_residual: vec![None, None, None],
        }
    }

    fn at(deg: f64) -> Vec<f32> {
        let r = deg.to_radians();
        vec![r.cos() as f32, r.sin() as f32, 0.0]
    }

    /// The same slot, 20 degrees from b = 0 (cosine 0.94, below the 0.98 a fixed threshold
    /// used): identified when the nearest other state is 60 degrees away, not when it is 30.
    #[test]
    fn identification_follows_the_separation_of_the_reference_states() {
        let tol = CaptureTolerance::for_dtype(DType::F32);
        let x = at(20.0);
        let view = View::full(&x, 1, 3);
        let wide = refs(60.0);
        let id = identify_slot(0, view, &wide, &no_residual_deltas(&wide), &tol);
        assert_eq!(id.found.map(|c| c.boundary), Some(0), "{id:?}");
        assert!((id.identify_angle - 30f64.to_radians()).abs() < 1e-6);
        // b = 1 at 30 degrees: the slot sits 10 degrees from it, within half of 30.
        let close = refs(30.0);
        let id = identify_slot(0, view, &close, &no_residual_deltas(&close), &tol);
        assert_eq!(id.found.map(|c| c.boundary), Some(1), "{id:?}");
        // 20 degrees from b = 0 out of the plane (35 from b = 1): beyond half of the 30 degrees
        // between the two, so nothing is identified.
        let r = 20f64.to_radians();
        let out = [r.cos() as f32, 0.0, r.sin() as f32];
        let id = identify_slot(
            0,
            View::full(&out, 1, 3),
            &close,
            &no_residual_deltas(&close),
            &tol,
        );
        assert_eq!(id.best.boundary, 0);
        assert_eq!(id.found, None, "{id:?}");
        assert!(!id.ambiguous);
    }
}
