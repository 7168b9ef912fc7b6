//! The layouts the probe tries: what each engine feeds, the spec's, and the mistakes that are
//! made in the wild (one boundary off, an embedding slice, reversed order, the engine default,
//! the wrong side of the final norm).

use crate::boundary::{Boundary, FinalNorm, default_boundaries};
use crate::engine::FedSlot;
use std::fmt;

/// One `fc` slot's source: boundary `b`, and at `b = L` the side of the final norm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tap {
    pub b: usize,
    /// Only at `b = L`; `None` elsewhere.
    pub norm: Option<Side>,
}

/// [`FinalNorm`] with an order, for sorting and hashing layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Side {
    Pre,
    Post,
}

impl From<FinalNorm> for Side {
    fn from(n: FinalNorm) -> Side {
        match n {
            FinalNorm::Pre => Side::Pre,
            FinalNorm::Post => Side::Post,
        }
    }
}

impl From<Side> for FinalNorm {
    fn from(s: Side) -> FinalNorm {
        match s {
            Side::Pre => FinalNorm::Pre,
            Side::Post => FinalNorm::Post,
        }
    }
}

impl Tap {
    /// `b` in a model of `l` layers; at `b = L` on the side `side` (HF's post-norm when unsaid).
    pub fn new(b: usize, l: usize, side: Option<Side>) -> Tap {
        Tap {
            b,
            norm: (b == l).then(|| side.unwrap_or(Side::Post)),
        }
    }

    /// Every tap of a model of `l` layers: b = 0..L-1, then b = L before and after the norm.
    pub fn all(l: usize) -> Vec<Tap> {
        let mut taps: Vec<Tap> = (0..l).map(|b| Tap { b, norm: None }).collect();
        taps.push(Tap::new(l, l, Some(Side::Pre)));
        taps.push(Tap::new(l, l, Some(Side::Post)));
        taps
    }
}

impl fmt::Display for Tap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.norm {
            None => write!(f, "{}", self.b),
            Some(Side::Pre) => write!(f, "{} pre-norm", self.b),
            Some(Side::Post) => write!(f, "{} post-norm", self.b),
        }
    }
}

/// What `fc` is fed, slot by slot.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Layout(pub Vec<Tap>);

impl Layout {
    pub fn from_boundaries(bs: &[Boundary], l: usize, side: Option<FinalNorm>) -> Layout {
        Layout(
            bs.iter()
                .map(|b| Tap::new(b.0, l, side.map(Side::from)))
                .collect(),
        )
    }

    pub fn from_fed(slots: &[FedSlot], l: usize) -> Layout {
        Layout(
            slots
                .iter()
                .map(|s| Tap::new(s.boundary.0, l, s.norm.map(Side::from)))
                .collect(),
        )
    }

    pub fn boundaries(&self) -> Vec<usize> {
        self.0.iter().map(|t| t.b).collect()
    }

    /// The side of the final norm the layout takes at b = L, if it takes b = L.
    pub fn final_norm(&self) -> Option<FinalNorm> {
        self.0.iter().find_map(|t| t.norm).map(FinalNorm::from)
    }

    /// No tap twice: engines and trainers capture each boundary once.
    pub fn distinct(&self) -> bool {
        let mut seen = self.0.clone();
        seen.sort();
        seen.dedup();
        seen.len() == self.0.len()
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(|t| t.to_string()).collect();
        write!(f, "[{}]", parts.join(", "))
    }
}

/// A layout to try and why it is tried (one layout can be several things at once).
#[derive(Debug, Clone)]
pub struct Candidate {
    pub layout: Layout,
    pub labels: Vec<String>,
}

/// An ordered set of candidates; adding a layout already there adds its label.
#[derive(Debug, Default)]
pub struct Candidates(pub Vec<Candidate>);

impl Candidates {
    pub fn add(&mut self, layout: Layout, label: impl Into<String>) {
        let label = label.into();
        match self.0.iter_mut().find(|c| c.layout == layout) {
            Some(c) if !c.labels.contains(&label) => c.labels.push(label),
            Some(_) => {}
            None => self.0.push(Candidate {
                layout,
                labels: vec![label],
            }),
        }
    }

    pub fn position(&self, layout: &Layout) -> Option<usize> {
        self.0.iter().position(|c| &c.layout == layout)
    }
}

/// The candidates around `reference` (the spec's layout, else the first fed one) in a model of
/// `l` layers: every slot one boundary deeper and shallower, each slot alone one off, the
/// embedding slice in front (the founding incident's shape: k slots kept, the last dropped),
/// the reverse order, the EAGLE default, and the other side of the final norm of every layout
/// that takes b = L. Layouts that would take a tap twice or leave 0..=L are skipped.
pub fn neighbours(reference: &Layout, l: usize, out: &mut Candidates) {
    let k = reference.0.len();
    let shift = |taps: &[Tap], which: Option<usize>, delta: i64| -> Option<Layout> {
        let moved: Option<Vec<Tap>> = taps
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if which.is_some_and(|w| w != i) {
                    return Some(*t);
                }
                let b = usize::try_from(t.b as i64 + delta)
                    .ok()
                    .filter(|&b| b <= l)?;
                // Moving onto b = L lands where engines capture it: before the norm.
                Some(Tap::new(b, l, t.norm.or(Some(Side::Pre))))
            })
            .collect();
        moved.map(Layout).filter(Layout::distinct)
    };
    for (delta, words) in [(1, "deeper"), (-1, "shallower")] {
        if let Some(x) = shift(&reference.0, None, delta) {
            out.add(x, format!("every slot one {words}"));
        }
    }
    if k > 1 {
        for i in 0..k {
            for (delta, sign) in [(1, "+1"), (-1, "-1")] {
                if let Some(x) = shift(&reference.0, Some(i), delta) {
                    out.add(x, format!("slot {i} {sign}"));
                }
            }
        }
    }
    if reference.0.first().is_some_and(|t| t.b != 0) {
        let mut taps = vec![Tap::new(0, l, None)];
        taps.extend(reference.0.iter().take(k.saturating_sub(1)));
        let x = Layout(taps);
        if x.distinct() {
            out.add(x, "embedding slice in front");
        }
    }
    if k > 1 {
        let mut rev = reference.0.clone();
        rev.reverse();
        if rev != reference.0 {
            out.add(Layout(rev), "reversed");
        }
    }
    if k == 3 {
        let x = Layout::from_boundaries(&default_boundaries(l), l, Some(FinalNorm::Pre));
        if x.distinct() {
            out.add(x, "EAGLE default [2, L/2, L-3]");
        }
    }
    let sides: Vec<Layout> = out
        .0
        .iter()
        .map(|c| &c.layout)
        .filter(|x| x.final_norm().is_some())
        .map(|x| {
            Layout(
                x.0.iter()
                    .map(|t| Tap {
                        b: t.b,
                        norm: t.norm.map(|s| match s {
                            Side::Pre => Side::Post,
                            Side::Post => Side::Pre,
                        }),
                    })
                    .collect(),
            )
        })
        .collect();
    for x in sides {
        out.add(x, "other side of the final norm");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(bs: &[usize], l: usize) -> Layout {
        Layout(
            bs.iter()
                .map(|&b| Tap::new(b, l, Some(Side::Pre)))
                .collect(),
        )
    }

    #[test]
    fn neighbours_of_a_trained_layout() {
        let mut c = Candidates::default();
        let r = layout(&[1, 4, 7], 8);
        c.add(r.clone(), "spec");
        neighbours(&r, 8, &mut c);
        let find = |bs: &[usize]| {
            c.0.iter()
                .find(|x| x.layout.boundaries() == bs)
                .map(|x| x.labels.clone())
        };
        assert_eq!(find(&[1, 4, 7]).unwrap(), ["spec"]);
        assert_eq!(find(&[2, 5, 8]).unwrap(), ["every slot one deeper"]);
        assert_eq!(find(&[0, 3, 6]).unwrap(), ["every slot one shallower"]);
        assert_eq!(find(&[1, 4, 6]).unwrap(), ["slot 2 -1"]);
        assert_eq!(find(&[0, 1, 4]).unwrap(), ["embedding slice in front"]);
        assert_eq!(find(&[7, 4, 1]).unwrap(), ["reversed"]);
        assert_eq!(find(&[2, 4, 5]).unwrap(), ["EAGLE default [2, L/2, L-3]"]);
        // [2, 5, 8] takes b = L before the norm, as engines do; its other side is there too.
        let sides: Vec<_> =
            c.0.iter()
                .filter(|x| x.layout.boundaries() == [2, 5, 8])
                .map(|x| x.layout.final_norm())
                .collect();
        assert_eq!(sides, [Some(FinalNorm::Pre), Some(FinalNorm::Post)]);
        assert!(c.0.iter().all(|x| x.layout.distinct()));
    }

    #[test]
    fn layouts_read_as_boundaries_and_sides() {
        assert_eq!(layout(&[2, 30, 61], 61).to_string(), "[2, 30, 61 pre-norm]");
        assert_eq!(Tap::all(4).len(), 6);
        assert!(!layout(&[3, 3, 5], 8).distinct());
    }
}
