//! Judging the acceptance probe: is there a signal at all, and does the fed layout (or the
//! spec's) lose acceptance against the best layout by more than the noise of the measurement?
//!
//! The two statistics play different parts. Cross-entropy of the first draft step against the
//! target's next-token distribution uses the whole distribution at every position, so paired
//! differences between layouts are far less noisy than acceptance, which is one bit per
//! position: it ranks. Acceptance is what users pay for: it is reported, and a mismatch needs
//! it too. Every difference is paired over the same positions, with a 95% block-bootstrap
//! interval (`probe::stats`).

use crate::report::{Finding, FindingName};
use crate::stats::Estimate;

/// The best layout against the control (the same draft on features of other positions).
pub struct SignalEvidence {
    /// Best minus control, first-token acceptance.
    pub acceptance_gain: Estimate,
    /// Control minus best, cross-entropy (positive: the best layout predicts better).
    pub cross_entropy_gain: Estimate,
}

/// A drafter has a signal when its best layout beats features of the wrong positions on both
/// statistics, beyond their intervals. Without one, no layout can be told from another.
pub fn has_signal(e: &SignalEvidence) -> bool {
    e.acceptance_gain.above_zero() && e.cross_entropy_gain.above_zero()
}

/// The `no-signal` warning, in words that say what was compared.
pub fn no_signal(e: &SignalEvidence, best: &str) -> Finding {
    Finding::warning(
        FindingName::NoSignal,
        format!(
            "the drafter predicts no better from its best layout {best} than from features of \
             other positions (acceptance gain {}, cross-entropy gain {} nats): random or \
             untrained weights, or not a drafter of this target; no layout can be inferred",
            e.acceptance_gain.words(3),
            e.cross_entropy_gain.words(3)
        ),
    )
}

/// One layout (fed by an engine, or the spec's) against the best.
pub struct Comparison<'a> {
    /// Who uses the layout: `sglang@0.5.23 feeds` or `the spec names`.
    pub who: &'a str,
    pub engine: Option<&'a str>,
    pub layout: &'a str,
    pub best: &'a str,
    /// Best minus this, first-token acceptance.
    pub acceptance_lost: Estimate,
    /// This minus best, cross-entropy.
    pub cross_entropy_excess: Estimate,
    /// What makes the engine feed the best layout, when the rule can be inverted.
    pub fix: Option<String>,
    /// Whether the layout is what is fed (an error when it loses) or only what the spec says
    /// (a warning: the spec may not be what training held).
    pub fed: bool,
}

/// The finding for one comparison, if the layout measurably loses: the cross-entropy excess
/// and the acceptance lost both above zero beyond their intervals. A cross-entropy excess with
/// acceptance inside its noise is a warning; anything else is no finding.
pub fn compare(c: &Comparison) -> Option<Finding> {
    if !c.cross_entropy_excess.above_zero() {
        return None;
    }
    let message = format!(
        "{} {}, but the drafter predicts the target better from {}: first-token acceptance \
         {} lower, cross-entropy {} nats higher",
        c.who,
        c.layout,
        c.best,
        c.acceptance_lost.words(3),
        c.cross_entropy_excess.words(3)
    );
    let mut f = if c.acceptance_lost.above_zero() && c.fed {
        Finding::error(FindingName::Acceptance, message)
    } else if c.acceptance_lost.above_zero() {
        Finding::warning(
            FindingName::Acceptance,
            format!("{message}: the spec may not be the layout training held"),
        )
    } else {
        Finding::warning(
            FindingName::Acceptance,
            format!("{message} (the acceptance difference is within its interval)"),
        )
    };
    if let Some(fix) = &c.fix {
        f = f.with_fix(fix.clone());
    }
    if let Some(e) = c.engine {
        f = f.with_engine(e);
    }
    Some(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(value: f64, lo: f64, hi: f64) -> Estimate {
        Estimate { value, lo, hi }
    }

    fn comparison(acc: Estimate, ce: Estimate, fed: bool) -> Comparison<'static> {
        Comparison {
            who: "vllm feeds",
            engine: Some("vllm"),
            layout: "[0, 3, 6]",
            best: "[1, 4, 7]",
            acceptance_lost: acc,
            cross_entropy_excess: ce,
            fix: Some("set ids to [1, 4, 7] for vllm".into()),
            fed,
        }
    }

    #[test]
    fn a_fed_layout_loses_only_beyond_both_intervals() {
        let lost = comparison(e(0.17, 0.12, 0.22), e(0.9, 0.7, 1.1), true);
        let f = compare(&lost).unwrap();
        assert_eq!(f.name, FindingName::Acceptance);
        assert_eq!(f.severity, crate::report::Severity::Error);
        assert!(
            f.message.contains("0.170 [0.120, 0.220] lower"),
            "{}",
            f.message
        );
        assert_eq!(f.fix.as_deref(), Some("set ids to [1, 4, 7] for vllm"));
        // Acceptance within its noise: a warning, not a mismatch.
        let near = comparison(e(0.01, -0.02, 0.04), e(0.05, 0.01, 0.09), true);
        assert_eq!(
            compare(&near).unwrap().severity,
            crate::report::Severity::Warning
        );
        // Cross-entropy within its noise: nothing, whatever acceptance says.
        assert!(compare(&comparison(e(0.2, 0.1, 0.3), e(0.05, -0.01, 0.1), true)).is_none());
        // The spec's layout losing is a warning about the spec.
        let spec = compare(&comparison(e(0.17, 0.12, 0.22), e(0.9, 0.7, 1.1), false)).unwrap();
        assert_eq!(spec.severity, crate::report::Severity::Warning);
    }

    #[test]
    fn a_signal_needs_both_gains_beyond_their_intervals() {
        let gain = |a: Estimate, c: Estimate| SignalEvidence {
            acceptance_gain: a,
            cross_entropy_gain: c,
        };
        assert!(has_signal(&gain(e(0.5, 0.4, 0.6), e(2.0, 1.5, 2.5))));
        assert!(!has_signal(&gain(e(0.01, -0.01, 0.03), e(2.0, 1.5, 2.5))));
        assert!(!has_signal(&gain(e(0.5, 0.4, 0.6), e(0.0, -0.1, 0.1))));
    }
}
