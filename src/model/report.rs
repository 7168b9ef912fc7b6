//! What a loaded target says in a report: its weights, how they streamed, the peak memory
//! against the budget (the `run`, `probe` and `diff --target` reports share it).

use crate::memory::report_peak;
use crate::model::LoadedTarget;
use crate::report::Report;

/// The memory facts of a run on `target`, once its forwards are done: how its weights were
/// held, what streaming cost, and the peak against the budget ([`report_peak`]).
pub fn report_target(report: &mut Report, target: &LoadedTarget) {
    report.fact("weights", target.memory.describe());
    if let Some(stats) = target.model.stream_stats() {
        report.fact("streaming", stats.describe());
    }
    report_peak(report, target.model.device(), target.memory.budget);
}
