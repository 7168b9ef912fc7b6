//! Judging a feed: what an engine assembles for `fc` against what the spec says training held,
//! as slot rows, findings and fixes. Every command that knows an engine (gate, run, diff's
//! three-way table, the probe) judges its feed here.

use super::layout::{classify, differing_slots};
use crate::boundary::{Boundary, FinalNorm, format_list};
use crate::engine::rules::Capture;
use crate::engine::{Feed, How, IdProblem, Want, ids_for, serving_alternatives};
use crate::report::{Finding, FindingName, SlotRow};
use crate::spec::Spec;

/// The verdict on one feed.
#[derive(Debug, Default)]
pub struct FeedCheck {
    pub rows: Vec<SlotRow>,
    pub findings: Vec<Finding>,
    /// What had to be assumed to pick the engine's rule (version band, architecture).
    pub notes: Vec<String>,
}

/// The spec's slots as a fix must produce them: at b = L with the spec's side of the norm.
pub fn wanted(spec: &Spec, num_layers: usize) -> Vec<Want> {
    spec.boundaries
        .iter()
        .map(|&b| (b, (b.0 == num_layers).then_some(spec.final_norm).flatten()))
        .collect()
}

/// What to change so that the engine feeds the spec's layout.
pub fn fix_for(feed: &Feed, spec: &Spec, arch: Option<&str>, num_layers: usize) -> String {
    let engine = feed.engine_label();
    match ids_for(&feed.engine, arch, &wanted(spec, num_layers), num_layers) {
        Some((ids, setting)) => format!("set {setting} to {ids:?} for {engine}"),
        None if feed.how == How::HardCoded => format!(
            "{engine} hard-codes b = {}; no config change can feed the spec's layout",
            format_list(&feed.boundaries())
        ),
        None => format!(
            "no layer-id list makes {engine} feed {} in this order",
            format_list(&spec.boundaries)
        ),
    }
}

fn arch_words(arch: Option<&str>) -> String {
    arch.map_or("these".to_string(), |a| format!("`{a}`"))
}

/// The file a rule was read from, for messages.
fn short_file(feed: &Feed) -> &'static str {
    let source = feed.rule.source;
    source.split_whitespace().next().unwrap_or(source)
}

/// Where else a target this engine cannot serve (or serves without its residual) is served.
fn serve_elsewhere(feed: &Feed, arch: Option<&str>) -> String {
    let others = serving_alternatives(&feed.engine, arch);
    if others.is_empty() {
        format!(
            "no audited engine version serves EAGLE-3 with the residual stream on {} targets",
            arch_words(arch)
        )
    } else {
        format!("serve it with {}", others.join(" or "))
    }
}

/// The finding for an engine whose capture point holds something other than the residual
/// stream, when it feeds a slot past the embedding.
fn capture_finding(feed: &Feed, arch: Option<&str>) -> Option<Finding> {
    let Capture::Branch(why) = feed.rule.captures else {
        return None;
    };
    let slot = feed.slots.iter().position(|s| s.boundary.0 > 0)?;
    let engine = feed.engine_label();
    Some(
        Finding::error(
            FindingName::MissingResidual,
            format!(
                "{engine} feeds fc no residual stream on {} targets ({}): {why}",
                arch_words(arch),
                short_file(feed)
            ),
        )
        .with_fix(serve_elsewhere(feed, arch))
        .with_engine(&engine)
        .with_slot(slot),
    )
}

/// Compares one engine's feed with the spec.
pub fn check_feed(feed: &Feed, spec: &Spec, arch: Option<&str>, num_layers: usize) -> FeedCheck {
    let engine = feed.engine_label();
    let fed = feed.boundaries();
    let want = &spec.boundaries;
    let rows = (0..fed.len().max(want.len()))
        .map(|slot| {
            let f = fed.get(slot).copied();
            let w = want.get(slot).copied();
            SlotRow {
                engine: engine.clone(),
                slot,
                id: feed.slots.get(slot).and_then(|s| s.id),
                fed: f.map(|b| b.0),
                expected: w.map(|b| b.0),
                ok: f.is_some() && f == w,
            }
        })
        .collect();
    let layout = if feed.refused() {
        None
    } else {
        classify(&fed, want, ("fed", "trained on"))
    };

    let mut out = Vec::new();
    for problem in &feed.problems {
        let finding = match problem {
            IdProblem::OutOfRange { id, reason } => Finding::error(
                FindingName::OutOfRange,
                format!(
                    "layer id {id} means nothing to {engine} on a {num_layers}-layer target ({reason}); it is dropped"
                ),
            ),
            IdProblem::Duplicate { id, collapsed } => Finding::error(
                FindingName::Duplicate,
                if *collapsed {
                    format!(
                        "layer id {id} repeats a position; {engine} captures it once, so fc gets one slot fewer"
                    )
                } else {
                    format!(
                        "layer id {id} repeats a position; {engine} feeds the same state into two slots"
                    )
                },
            ),
            IdProblem::Unsorted { ids } => Finding::warning(
                FindingName::Order,
                format!(
                    "layer ids {ids:?} are not ascending; {engine} concatenates in {} order, whatever the list says",
                    match feed.rule.order {
                        crate::engine::rules::Order::Ascending => "layer",
                        _ => "sorted-id",
                    }
                ),
            ),
            IdProblem::Refused { reason } => Finding::error(
                FindingName::Refused,
                format!("{engine} ({}) will not run: {reason}", feed.describe()),
            )
            .with_fix(fix_for(feed, spec, arch, num_layers)),
            IdProblem::Unsupported { reason } => Finding::error(
                FindingName::UnsupportedArchitecture,
                format!(
                    "{engine} cannot serve EAGLE-3 on {} targets ({}): {reason}",
                    arch_words(arch),
                    short_file(feed)
                ),
            )
            .with_fix(serve_elsewhere(feed, arch)),
            IdProblem::NotRead {
                written,
                read,
                assumed,
            } => {
                // It matters when the default the engine feeds instead differs from training.
                let msg = format!(
                    "the draft config writes its layer ids as {written}, but {engine} reads {read}"
                );
                let finding = if layout.is_some() && !assumed {
                    Finding::error(FindingName::IdsNotRead, msg)
                } else {
                    Finding::warning(FindingName::IdsNotRead, msg)
                };
                finding.with_fix(fix_for(feed, spec, arch, num_layers))
            }
        };
        out.push(finding.with_engine(&engine));
    }

    if let Some((name, message)) = layout {
        let first_bad = differing_slots(&fed, want).first().copied().unwrap_or(0);
        let (name, message) = if feed.how == How::DefaultFallback {
            (
                FindingName::DefaultFallback,
                format!("no layer ids reach {engine}, so it falls back to its default: {message}"),
            )
        } else {
            (name, format!("{engine} ({}): {message}", feed.describe()))
        };
        out.push(
            Finding::error(name, message)
                .with_fix(fix_for(feed, spec, arch, num_layers))
                .with_engine(&engine)
                .with_slot(first_bad),
        );
    } else if feed.how == How::DefaultFallback {
        out.push(
            Finding::warning(
                FindingName::DefaultFallback,
                format!(
                    "no layer ids reach {engine}; its default happens to match the spec, \
                     but any engine or default change moves it silently (vLLM PR 50170)"
                ),
            )
            .with_fix(fix_for(feed, spec, arch, num_layers))
            .with_engine(&engine),
        );
    }

    // Stock engines crash at b = 0; the founding incident's engine was patched to capture the
    // embedding there. Say what such a patch feeds.
    if let Some(patched) = &feed.if_patched {
        let got: Vec<Boundary> = patched.iter().map(|s| s.boundary).collect();
        if let Some((name, message)) = classify(&got, want, ("fed", "trained on")) {
            out.push(
                Finding::error(
                    name,
                    format!(
                        "stock {engine} crashes on this config; an engine patched to capture the embedding \
                         before layer 0 (the founding incident's local patch) runs and is wrong: {message}"
                    ),
                )
                .with_fix(fix_for(feed, spec, arch, num_layers))
                .with_engine(&engine)
                .with_slot(differing_slots(&got, want).first().copied().unwrap_or(0)),
            );
        }
    }
    out.extend(capture_finding(feed, arch));
    out.extend(check_final_norm(feed, spec, num_layers, &engine));
    FeedCheck {
        rows,
        findings: out,
        notes: feed.notes.clone(),
    }
}

/// b = L is two states; the spec must say which, and the engine must capture that one.
fn check_final_norm(feed: &Feed, spec: &Spec, num_layers: usize, engine: &str) -> Vec<Finding> {
    let last = Boundary(num_layers);
    let fed_last: Vec<Option<FinalNorm>> = feed
        .slots
        .iter()
        .filter(|s| s.boundary == last)
        .map(|s| s.norm)
        .collect();
    if fed_last.is_empty() && !spec.boundaries.contains(&last) {
        return Vec::new();
    }
    let mut out = Vec::new();
    match spec.final_norm {
        Some(want) => {
            for side in fed_last.into_iter().flatten().filter(|&s| s != want) {
                out.push(
                    Finding::error(
                        FindingName::FinalNorm,
                        format!(
                            "b = {num_layers} is trained {want}, but {engine} captures it {side}"
                        ),
                    )
                    .with_engine(engine),
                );
            }
        }
        None => {
            let sides: Vec<String> = fed_last.iter().flatten().map(|s| s.to_string()).collect();
            let captured = if sides.is_empty() {
                format!("{engine} does not capture it")
            } else {
                format!("{engine} captures it {}", sides.join(" and "))
            };
            out.push(
                Finding::warning(
                    FindingName::FinalNorm,
                    format!(
                        "b = {num_layers} (after the last layer) is ambiguous: {captured}, HF returns it {}; \
                         state `final_norm: pre|post` in the spec",
                        FinalNorm::Post
                    ),
                )
                .with_engine(engine),
            );
        }
    }
    out
}
