//! The judge: every verdict eagle-check gives is decided here, whichever command gathered the
//! evidence. Layout classification ([`layout`]), feed checks and fixes ([`feed`]), and the
//! header-only static checks ([`statics`]). `gate`, `run`, `diff` and the probe call these;
//! no command imports another.

pub mod acceptance;
pub mod feed;
pub mod layout;
pub mod statics;

use crate::boundary::format_list;
use crate::config::DraftConfig;
use crate::engine::{DraftIds, EngineSel, Feed, resolve};
use crate::error::Result;
use crate::report::{Finding, FindingName, Report, Severity};
pub use feed::{FeedCheck, check_feed, fix_for};
pub use layout::classify;
pub use statics::{Dims, StaticInput};

/// Findings that make a forward pointless: the checkpoint or the engine cannot run as
/// configured. Layout faults do not: running shows what they cost.
pub fn blocks_forward(f: &Finding) -> bool {
    f.severity == Severity::Error
        && matches!(
            f.name,
            FindingName::Shape | FindingName::Refused | FindingName::UnsupportedArchitecture
        )
}

/// The ids a draft config holds, in words for the report.
pub fn ids_fact(ids: &DraftIds) -> String {
    match (&ids.top, &ids.nested) {
        (None, None) => "none (engines use their defaults)".into(),
        (Some(t), None) => format!("{t:?} (top level)"),
        (None, Some(n)) => format!("{n:?} (eagle_config)"),
        (Some(t), Some(n)) if t == n => format!("{n:?} (top level and eagle_config)"),
        (Some(t), Some(n)) => format!("{t:?} (top level), {n:?} (eagle_config): they differ"),
    }
}

/// What each engine in `engines` feeds this draft (or, with no draft, a config without ids).
pub fn feeds(draft: Option<&DraftConfig>, dims: &Dims, engines: &[EngineSel]) -> Vec<Feed> {
    let none = DraftIds::default();
    let ids = draft.map_or(&none, |d| &d.ids);
    engines
        .iter()
        .map(|sel| resolve(sel, dims.arch.as_deref(), ids, dims.num_layers))
        .collect()
}

/// The static report `gate` prints and `run` starts from: facts, the engine-independent checks,
/// then each engine's feed against the spec.
pub fn static_report(
    command: &str,
    input: &StaticInput,
    engines: &[EngineSel],
) -> Result<(Report, Dims, Vec<Feed>)> {
    let spec = input.spec;
    let dims = Dims::resolve(spec, input.draft, input.target)?;
    let mut report = Report::new(command);
    report.sources.spec = Some(spec.path.clone());
    report.sources.draft_config = input.draft.map(|d| d.path.clone());
    report.fact("spec", format!("{} ({})", spec.name, spec.path.display()));
    if let Some(d) = input.draft {
        report.fact(
            "draft",
            format!("{} ({})", d.architecture, d.path.display()),
        );
    }
    if let Some(t) = input.target {
        report.fact("target", format!("{} ({})", t.model_type, t.path.display()));
    }
    report.fact(
        "target_dims",
        format!(
            "L = {} layers, Ht = {}{}",
            dims.num_layers,
            dims.target_hidden,
            dims.arch
                .as_deref()
                .map_or(String::new(), |a| format!(", {a}"))
        ),
    );
    if let Some(d) = input.draft {
        report.fact("draft_ids", ids_fact(&d.ids));
    }
    report.fact("spec_b", format_list(&spec.boundaries));
    if let Some(w) = input.target_weights {
        report.fact("target_tensors", w.tensors.len().to_string());
    }
    report.findings.extend(statics::check(input, &dims)?);
    let feeds = feeds(input.draft, &dims, engines);
    for feed in &feeds {
        report.fact(&format!("rule {}", feed.engine_label()), feed.describe());
        if let Some((why, fix)) = input
            .draft
            .and_then(|d| crate::engine::drafts::draft_unsupported(&feed.engine, d))
        {
            report.findings.push(
                Finding::error(FindingName::UnsupportedDraft, why)
                    .with_fix(fix)
                    .with_engine(&feed.engine_label()),
            );
        }
        let checked = check_feed(feed, spec, dims.arch.as_deref(), dims.num_layers);
        for note in checked.notes {
            report.fact(&format!("note {}", feed.engine_label()), note);
        }
        report.slots.extend(checked.rows);
        report.findings.extend(checked.findings);
    }
    Ok((report, dims, feeds))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_fact_says_where_the_ids_are_and_whether_they_agree() {
        let ids =
            |top: Option<Vec<i64>>, nested: Option<Vec<i64>>| ids_fact(&DraftIds { top, nested });
        assert_eq!(ids(None, None), "none (engines use their defaults)");
        assert_eq!(ids(Some(vec![1, 2]), None), "[1, 2] (top level)");
        assert_eq!(ids(None, Some(vec![1, 2])), "[1, 2] (eagle_config)");
        assert_eq!(
            ids(Some(vec![1, 2]), Some(vec![1, 2])),
            "[1, 2] (top level and eagle_config)"
        );
        assert_eq!(
            ids(Some(vec![1, 2]), Some(vec![2, 3])),
            "[1, 2] (top level), [2, 3] (eagle_config): they differ"
        );
    }
}
