//! Findings and the one `Report` value every command returns; rendered as a table or JSON here,
//! as JUnit XML or GitHub annotations in [`crate::ci`].

use comfy_table::{ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::PathBuf;

/// Stable finding names. Add new ones at the end; never rename (CI scripts match on them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FindingName {
    EmbeddingCapture,
    OffByOne,
    WrongLayer,
    Order,
    Count,
    MissingResidual,
    FinalNorm,
    TokenShift,
    Shard,
    Scale,
    NonFinite,
    DefaultFallback,
    Shape,
    OutOfRange,
    Unidentified,
    /// The same layer id twice in a config.
    Duplicate,
    /// An engine or trainer refuses the config outright.
    Refused,
    /// The draft config writes its ids where the engine does not read them.
    IdsNotRead,
    /// The probe: the drafter predicts measurably better from another layout than from the one
    /// fed (or the one the spec names).
    Acceptance,
    /// The probe: no layout does better than features of the wrong positions.
    NoSignal,
    /// The run's peak memory passed `--max-memory` (the captures are still valid).
    MemoryBudget,
    /// The engine version cannot serve EAGLE-3 on the target's architecture at all: it fails at
    /// start-up (no capture in the model file, no model file) or captures nothing.
    UnsupportedArchitecture,
    /// The engine version cannot load the draft's architecture or config format.
    UnsupportedDraft,
}

impl FindingName {
    pub fn as_str(self) -> &'static str {
        match self {
            FindingName::EmbeddingCapture => "embedding-capture",
            FindingName::OffByOne => "off-by-one",
            FindingName::WrongLayer => "wrong-layer",
            FindingName::Order => "order",
            FindingName::Count => "count",
            FindingName::MissingResidual => "missing-residual",
            FindingName::FinalNorm => "final-norm",
            FindingName::TokenShift => "token-shift",
            FindingName::Shard => "shard",
            FindingName::Scale => "scale",
            FindingName::NonFinite => "non-finite",
            FindingName::DefaultFallback => "default-fallback",
            FindingName::Shape => "shape",
            FindingName::OutOfRange => "out-of-range",
            FindingName::Unidentified => "unidentified",
            FindingName::Duplicate => "duplicate",
            FindingName::Refused => "refused",
            FindingName::IdsNotRead => "ids-not-read",
            FindingName::Acceptance => "acceptance",
            FindingName::NoSignal => "no-signal",
            FindingName::MemoryBudget => "memory-budget",
            FindingName::UnsupportedArchitecture => "unsupported-architecture",
            FindingName::UnsupportedDraft => "unsupported-draft",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The layout is wrong: the verdict becomes `mismatch`.
    Error,
    /// A hazard that does not change what is fed today.
    Warning,
}

#[derive(Debug, Clone, Serialize)]
pub struct Finding {
    pub name: FindingName,
    pub severity: Severity,
    pub message: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slot: Option<usize>,
    /// The engine as its rule was read, e.g. `sglang@0.5.23`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub file: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sample: Option<usize>,
    /// How many samples this finding stands for, when many collapsed into one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<usize>,
}

impl Finding {
    pub fn error(name: FindingName, message: impl Into<String>) -> Finding {
        Finding {
            name,
            severity: Severity::Error,
            message: message.into(),
            fix: None,
            slot: None,
            engine: None,
            file: None,
            sample: None,
            count: None,
        }
    }

    pub fn warning(name: FindingName, message: impl Into<String>) -> Finding {
        Finding {
            severity: Severity::Warning,
            ..Finding::error(name, message)
        }
    }

    pub fn with_fix(mut self, fix: impl Into<String>) -> Finding {
        self.fix = Some(fix.into());
        self
    }

    pub fn with_slot(mut self, slot: usize) -> Finding {
        self.slot = Some(slot);
        self
    }

    pub fn with_engine(mut self, engine: &str) -> Finding {
        self.engine = Some(engine.to_string());
        self
    }

    pub fn with_file(mut self, file: impl Into<String>) -> Finding {
        self.file = Some(file.into());
        self
    }

    pub fn with_sample(mut self, sample: usize) -> Finding {
        self.sample = Some(sample);
        self
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    Consistent,
    Mismatch,
}

/// One row of the inference-side table: what an engine feeds to `fc` slot `slot`.
#[derive(Debug, Clone, Serialize)]
pub struct SlotRow {
    pub engine: String,
    pub slot: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<i64>,
    /// The boundary the engine feeds (`None`: the engine feeds fewer slots than expected).
    pub fed: Option<usize>,
    /// The boundary the spec expects (`None`: the engine feeds more slots than the spec has).
    pub expected: Option<usize>,
    pub ok: bool,
}

/// Per-slot identification of one captured tensor (the diff engine).
#[derive(Debug, Clone, Serialize)]
pub struct CaptureSlot {
    pub slot: usize,
    pub expected_boundary: Option<usize>,
    pub found_boundary: Option<usize>,
    pub state: String,
    pub cosine: f64,
    pub rel_err: f64,
    pub norm_ratio: f64,
    pub margin: f64,
    pub status: String,
}

/// The diff engine's view of one capture file.
#[derive(Debug, Clone, Serialize)]
pub struct CaptureReport {
    pub file: String,
    pub format: String,
    pub samples: usize,
    pub slots: Vec<CaptureSlot>,
}

/// Spec vs training captures vs inference feed, per fc slot (diff with --draft and --engine).
#[derive(Debug, Clone, Serialize)]
pub struct ThreeWayRow {
    pub slot: usize,
    pub spec: Option<usize>,
    /// The boundary the training captures hold (the most common over samples).
    pub training: Option<usize>,
    /// The boundary the inference engine feeds.
    pub inference: Option<usize>,
    pub ok: bool,
}

/// One layout the acceptance probe tried, with its figures over every probed position.
#[derive(Debug, Clone, Serialize)]
pub struct ProbeRow {
    /// 1 = the lowest cross-entropy against the target's next-token distribution.
    pub rank: usize,
    /// `[1, 4, 8 pre-norm]`
    pub layout: String,
    pub boundaries: Vec<usize>,
    /// At b = L: the side of the final norm.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub final_norm: Option<crate::boundary::FinalNorm>,
    /// Why it was tried: `spec`, `fed by sglang@0.5.23`, `slot 0 +1`, ...
    pub labels: Vec<String>,
    /// First-token acceptance: the draft's greedy token through d2t equals the target's.
    pub acceptance: crate::stats::Estimate,
    /// Mean accepted length of a greedy chain of `steps` draft tokens (0..=steps).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accepted_length: Option<crate::stats::Estimate>,
    /// Mean cross-entropy (nats) of the first draft step against the target's distribution
    /// over the draft vocabulary: the ranking statistic.
    pub cross_entropy: crate::stats::Estimate,
    /// This layout's cross-entropy minus the best one's, paired over positions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub above_best: Option<crate::stats::Estimate>,
    /// The best layout's first-token acceptance minus this one's, paired over positions.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub below_best: Option<crate::stats::Estimate>,
}

/// The files a report judged, for renderings that point into them (GitHub annotations).
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// The capture spec (YAML).
    pub spec: Option<PathBuf>,
    /// The draft's `config.json` itself (not its directory).
    pub draft_config: Option<PathBuf>,
}

/// What every command returns: rendered as a table for people or as JSON for machines.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub command: String,
    pub verdict: Verdict,
    /// Key facts about what was checked (spec, draft, target, engine, rule).
    pub subject: Vec<(String, String)>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub slots: Vec<SlotRow>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub captures: Vec<CaptureReport>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub three_way: Vec<ThreeWayRow>,
    /// The acceptance probe's layouts, best first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub probe: Vec<ProbeRow>,
    pub findings: Vec<Finding>,
    #[serde(skip)]
    pub sources: Sources,
}

impl Report {
    pub fn new(command: &str) -> Report {
        Report {
            command: command.to_string(),
            verdict: Verdict::Consistent,
            subject: Vec::new(),
            slots: Vec::new(),
            captures: Vec::new(),
            three_way: Vec::new(),
            probe: Vec::new(),
            findings: Vec::new(),
            sources: Sources::default(),
        }
    }

    pub fn fact(&mut self, key: &str, value: impl Into<String>) {
        self.subject.push((key.to_string(), value.into()));
    }

    /// Sets the verdict from the findings: any error makes it a mismatch.
    pub fn finish(mut self) -> Report {
        self.findings.sort_by_key(|f| f.severity);
        self.verdict = if self.findings.iter().any(|f| f.severity == Severity::Error) {
            Verdict::Mismatch
        } else {
            Verdict::Consistent
        };
        self
    }

    pub fn exit_code(&self) -> i32 {
        match self.verdict {
            Verdict::Consistent => 0,
            Verdict::Mismatch => 1,
        }
    }

    pub fn to_json(&self) -> String {
        let mut value = serde_json::to_value(self).unwrap_or(serde_json::Value::Null);
        // Subject as an object reads better for machines than a list of pairs.
        if let Some(obj) = value.as_object_mut() {
            let subject: serde_json::Map<String, serde_json::Value> = self
                .subject
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                .collect();
            obj.insert("subject".into(), serde_json::Value::Object(subject));
            // One entry per finding (scripts filter on `engine`), each naming every engine whose
            // finding is the same but for the engine: the rows the table collapses into one.
            if let Some(findings) = obj.get_mut("findings").and_then(|f| f.as_array_mut()) {
                for group in self.finding_groups() {
                    let engines: Vec<serde_json::Value> = group
                        .iter()
                        .filter_map(|&i| self.findings[i].engine.clone())
                        .map(serde_json::Value::String)
                        .collect();
                    if engines.is_empty() {
                        continue;
                    }
                    for &i in &group {
                        if let Some(f) = findings.get_mut(i).and_then(|f| f.as_object_mut()) {
                            f.insert("engines".into(), serde_json::Value::Array(engines.clone()));
                        }
                    }
                }
            }
        }
        serde_json::to_string_pretty(&value).unwrap_or_default()
    }

    /// The verdict line the table ends with; all that `--quiet` prints.
    pub fn verdict_line(&self) -> String {
        let errors = self
            .findings
            .iter()
            .filter(|f| f.severity == Severity::Error)
            .count();
        let warnings = self.findings.len() - errors;
        let verdict = match self.verdict {
            Verdict::Consistent => "consistent",
            Verdict::Mismatch => "MISMATCH",
        };
        format!("verdict: {verdict} ({errors} errors, {warnings} warnings)")
    }

    /// Findings that are the same but for their engine, as groups of indices into `findings`,
    /// in report order (a finding without an engine is a group of its own). Two findings are
    /// the same when name, severity, place and message agree once each one's engine label is
    /// blanked out; their fixes may differ (each engine has its own setting).
    pub fn finding_groups(&self) -> Vec<Vec<usize>> {
        let mut groups: Vec<(Option<FindingKey>, Vec<usize>)> = Vec::new();
        for (i, f) in self.findings.iter().enumerate() {
            let key = f.engine.as_deref().map(|engine| FindingKey {
                name: f.name,
                severity: f.severity,
                slot: f.slot,
                file: f.file.clone(),
                sample: f.sample,
                count: f.count,
                message: blank_engine(&f.message, engine),
            });
            match groups
                .iter_mut()
                .find(|(k, _)| key.is_some() && k.as_ref() == key.as_ref())
            {
                Some((_, members)) => members.push(i),
                None => groups.push((key, vec![i])),
            }
        }
        groups.into_iter().map(|(_, members)| members).collect()
    }

    /// A group of [`Report::finding_groups`] as one finding: every engine in `engines` order,
    /// the message with the engine written "each engine", the distinct fixes each naming the
    /// engines it is for.
    pub fn collapsed(&self, group: &[usize]) -> CollapsedFinding {
        let first = &self.findings[group[0]];
        let engines: Vec<String> = group
            .iter()
            .filter_map(|&i| self.findings[i].engine.clone())
            .collect();
        if group.len() == 1 {
            return CollapsedFinding {
                finding: first.clone(),
                engines,
                fixes: first.fix.iter().cloned().collect(),
            };
        }
        let message = first.engine.as_deref().map_or(first.message.clone(), |e| {
            blank_engine(&first.message, e).replace(BLANK, "each engine")
        });
        // Fixes that read alike but for the engine become one, naming all of theirs.
        let mut fixes: Vec<(String, Vec<String>)> = Vec::new();
        for &i in group {
            let f = &self.findings[i];
            let (Some(fix), Some(engine)) = (&f.fix, &f.engine) else {
                continue;
            };
            let blank = blank_engine(fix, engine);
            match fixes.iter_mut().find(|(b, _)| *b == blank) {
                Some((_, names)) => names.push(engine.clone()),
                None => fixes.push((blank, vec![engine.clone()])),
            }
        }
        CollapsedFinding {
            finding: Finding {
                message,
                ..first.clone()
            },
            engines,
            fixes: fixes
                .into_iter()
                .map(|(blank, names)| blank.replace(BLANK, &names.join(", ")))
                .collect(),
        }
    }

    /// The table for a terminal: as wide as the terminal when stdout is one, else 140 columns.
    pub fn to_table(&self) -> String {
        let width = if std::io::stdout().is_terminal() {
            None
        } else {
            Some(FIXED_WIDTH)
        };
        self.to_table_width(width)
    }

    /// The table wrapped to `width` columns (`None`: the terminal's width, as comfy-table
    /// measures it).
    pub fn to_table_width(&self, width: Option<u16>) -> String {
        let new_table = |header: &[&str]| new_table(header, width);
        let mut out = String::new();
        for (key, value) in &self.subject {
            let _ = writeln!(out, "{:>12}: {value}", key.replace('_', " "));
        }
        if !self.slots.is_empty() {
            let _ = writeln!(out, "{}", self.slot_table(width));
        }
        if !self.three_way.is_empty() {
            let mut table = new_table(&["fc slot", "spec b", "training b", "inference b", ""]);
            for r in &self.three_way {
                table.add_row(vec![
                    r.slot.to_string(),
                    opt(r.spec),
                    opt(r.training),
                    opt(r.inference),
                    if r.ok { "ok".into() } else { "MISMATCH".into() },
                ]);
            }
            let _ = writeln!(out, "{table}");
        }
        if !self.probe.is_empty() {
            let _ = writeln!(out, "{}", self.probe_table(width));
        }
        const MAX_FILES: usize = 10;
        for capture in self.captures.iter().take(MAX_FILES) {
            let _ = writeln!(
                out,
                "{} ({}, {} samples)",
                capture.file, capture.format, capture.samples
            );
            let mut table = new_table(&[
                "slot",
                "expected b",
                "found b",
                "state",
                "cosine",
                "rel err",
                "norm ratio",
                "margin",
                "",
            ]);
            for s in &capture.slots {
                table.add_row(vec![
                    s.slot.to_string(),
                    opt(s.expected_boundary),
                    opt(s.found_boundary),
                    s.state.clone(),
                    format!("{:.5}", s.cosine),
                    format!("{:.2e}", s.rel_err),
                    format!("{:.3}", s.norm_ratio),
                    format!("{:.3}", s.margin),
                    s.status.clone(),
                ]);
            }
            let _ = writeln!(out, "{table}");
        }
        if self.captures.len() > MAX_FILES {
            let _ = writeln!(
                out,
                "... {} more capture files (all of them in --format json)",
                self.captures.len() - MAX_FILES
            );
        }
        if !self.findings.is_empty() {
            let mut table = new_table(&["finding", "severity", "where", "message", "fix"]);
            for group in self.finding_groups() {
                let CollapsedFinding {
                    finding: f,
                    engines,
                    fixes,
                } = self.collapsed(&group);
                let mut place = Vec::new();
                if !engines.is_empty() {
                    place.push(engines.join(", "));
                }
                if let Some(file) = &f.file {
                    place.push(file.clone());
                }
                if let Some(s) = f.sample {
                    place.push(format!("sample {s}"));
                }
                if let Some(s) = f.slot {
                    place.push(format!("slot {s}"));
                }
                if let Some(c) = f.count {
                    place.push(format!("x{c}"));
                }
                table.add_row(vec![
                    f.name.as_str().to_string(),
                    format!("{:?}", f.severity).to_lowercase(),
                    place.join(", "),
                    f.message.clone(),
                    match fixes.len() {
                        0 | 1 => fixes.join(""),
                        _ => fixes
                            .iter()
                            .map(|f| format!("- {f}"))
                            .collect::<Vec<_>>()
                            .join("\n"),
                    },
                ]);
            }
            let _ = writeln!(out, "{table}");
        }
        let _ = writeln!(out, "{}", self.verdict_line());
        out
    }
}

/// Findings that are the same but for their engine (see [`Report::finding_groups`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct FindingKey {
    name: FindingName,
    severity: Severity,
    slot: Option<usize>,
    file: Option<String>,
    sample: Option<usize>,
    count: Option<usize>,
    message: String,
}

/// One row of the findings table: a group of findings the same but for their engine.
#[derive(Debug, Clone)]
pub struct CollapsedFinding {
    /// The first finding of the group, its message written for every engine of the group.
    pub finding: Finding,
    /// Every engine of the group, in report order (empty: the finding names no engine).
    pub engines: Vec<String>,
    /// The distinct fixes, each naming the engines it is for.
    pub fixes: Vec<String>,
}

/// The width of a table written to a file or a pipe.
const FIXED_WIDTH: u16 = 140;

/// What stands for the engine in a blanked message (never in a real one).
const BLANK: &str = "\u{0}";

/// `text` with every whole-word occurrence of the engine label `engine` replaced by [`BLANK`]
/// (`eagle` inside `eagle_config` is not the engine).
fn blank_engine(text: &str, engine: &str) -> String {
    if engine.is_empty() {
        return text.to_string();
    }
    let word = |c: char| c.is_alphanumeric() || "_-@:".contains(c);
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(engine) {
        let before = rest[..at].chars().next_back();
        let after = &rest[at + engine.len()..];
        let mut next = after.chars();
        let follows = match next.next() {
            // A full stop ends the word unless the word goes on after it (`eagle.py`).
            Some('.') => next.next().is_some_and(word),
            Some(c) => word(c),
            None => false,
        };
        out.push_str(&rest[..at]);
        if before.is_some_and(|c| word(c) || c == '.') || follows {
            out.push_str(engine);
        } else {
            out.push_str(BLANK);
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

impl Report {
    /// One engine: a row per fc slot. Several: a row per engine with the whole layout.
    fn slot_table(&self, width: Option<u16>) -> Table {
        let new_table = |header: &[&str]| new_table(header, width);
        let mut engines: Vec<&str> = Vec::new();
        for row in &self.slots {
            if !engines.contains(&row.engine.as_str()) {
                engines.push(&row.engine);
            }
        }
        if engines.len() == 1 {
            let mut table = new_table(&["fc slot", "layer id", "fed b", "spec b", ""]);
            for row in &self.slots {
                table.add_row(vec![
                    row.slot.to_string(),
                    row.id.map_or("-".into(), |i| i.to_string()),
                    opt(row.fed),
                    opt(row.expected),
                    if row.ok {
                        "ok".into()
                    } else {
                        "MISMATCH".into()
                    },
                ]);
            }
            return table;
        }
        let mut table = new_table(&["engine", "fed b", "spec b", ""]);
        for engine in engines {
            let rows: Vec<&SlotRow> = self.slots.iter().filter(|r| r.engine == engine).collect();
            let list = |f: fn(&SlotRow) -> Option<usize>| {
                let items: Vec<String> = rows
                    .iter()
                    .filter_map(|r| f(r))
                    .map(|b| b.to_string())
                    .collect();
                format!("[{}]", items.join(", "))
            };
            let ok = rows.iter().all(|r| r.ok);
            table.add_row(vec![
                engine.to_string(),
                list(|r| r.fed),
                list(|r| r.expected),
                if ok { "ok".into() } else { "MISMATCH".into() },
            ]);
        }
        table
    }
}

impl Report {
    /// The probe's layouts, best first, each figure with its 95% interval.
    fn probe_table(&self, width: Option<u16>) -> Table {
        let mut table = new_table(
            &[
                "rank",
                "layout b",
                "tried as",
                "first-token acceptance",
                "accepted length",
                "cross-entropy",
                "cross-entropy above best",
                "acceptance below best",
            ],
            width,
        );
        for r in &self.probe {
            table.add_row(vec![
                r.rank.to_string(),
                r.layout.clone(),
                r.labels.join("; "),
                r.acceptance.words(3),
                r.accepted_length.map_or("-".into(), |e| e.words(2)),
                format!("{:.3}", r.cross_entropy.value),
                r.above_best.map_or("-".into(), |e| e.words(3)),
                r.below_best.map_or("-".into(), |e| e.words(3)),
            ]);
        }
        table
    }
}

fn opt(v: Option<usize>) -> String {
    v.map_or("-".into(), |x| x.to_string())
}

/// A table that wraps its cells to `width` columns (`None`: the terminal's width).
fn new_table(header: &[&str], width: Option<u16>) -> Table {
    let mut table = Table::new();
    table
        .load_style(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(header.to_vec());
    if let Some(w) = width {
        table.set_width(w);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engine_is_blanked_only_as_a_whole_word() {
        assert_eq!(
            blank_engine("set eagle_config ids for eagle.", "eagle"),
            format!("set eagle_config ids for {BLANK}.")
        );
        assert_eq!(
            blank_engine("eagle.py: eagle feeds", "eagle"),
            format!("eagle.py: {BLANK} feeds")
        );
        assert_eq!(
            blank_engine(
                "vllm:v1@0.33.0 reads; not vllm:v1@0.33.0x",
                "vllm:v1@0.33.0"
            ),
            format!("{BLANK} reads; not vllm:v1@0.33.0x")
        );
    }

    fn fallback(engine: &str, setting: &str) -> Finding {
        Finding::warning(
            FindingName::DefaultFallback,
            format!("no layer ids reach {engine}; its default matches"),
        )
        .with_fix(format!("set {setting} to [1, 15, 28] for {engine}"))
        .with_engine(engine)
    }

    #[test]
    fn findings_the_same_but_for_the_engine_collapse_with_their_fixes() {
        let mut report = Report::new("gate");
        report.findings = vec![
            fallback("sglang@0.5.23", "eagle_config.ids"),
            fallback("eagle", "eagle_config.ids"),
            fallback("modelopt:hf", "--aux-layers"),
            Finding::warning(FindingName::DefaultFallback, "no layer ids reach x"),
        ];
        let groups = report.finding_groups();
        assert_eq!(groups, vec![vec![0, 1, 2], vec![3]]);
        let c = report.collapsed(&groups[0]);
        assert_eq!(c.engines, ["sglang@0.5.23", "eagle", "modelopt:hf"]);
        assert_eq!(
            c.finding.message,
            "no layer ids reach each engine; its default matches"
        );
        assert_eq!(
            c.fixes,
            [
                "set eagle_config.ids to [1, 15, 28] for sglang@0.5.23, eagle",
                "set --aux-layers to [1, 15, 28] for modelopt:hf"
            ]
        );
        // Another message, another row.
        report.findings[1].message.push('!');
        assert_eq!(report.finding_groups().len(), 3);
    }

    #[test]
    fn tables_wrap_to_the_width_given() {
        let mut report = Report::new("gate");
        report.findings.push(fallback(
            "sglang@0.5.23",
            &"a_long_setting_name ".repeat(12),
        ));
        for width in [60u16, 100, 140] {
            let table = report.to_table_width(Some(width));
            for line in table.lines() {
                assert!(
                    line.chars().count() <= width as usize,
                    "{width}: {line:?} is {} wide",
                    line.chars().count()
                );
            }
        }
        assert!(report.to_table_width(Some(60)).lines().count() > 10);
    }
}
