//! Findings and the one `Report` value every command returns; rendered as a table or JSON.

use comfy_table::{ContentArrangement, Table, presets::UTF8_FULL_CONDENSED};
use serde::Serialize;
use std::fmt::Write as _;

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
    pub findings: Vec<Finding>,
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
            findings: Vec::new(),
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
        }
        serde_json::to_string_pretty(&value).unwrap_or_default()
    }

    pub fn to_table(&self) -> String {
        let mut out = String::new();
        for (key, value) in &self.subject {
            let _ = writeln!(out, "{:>12}: {value}", key.replace('_', " "));
        }
        if !self.slots.is_empty() {
            let _ = writeln!(out, "{}", self.slot_table());
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
            for f in &self.findings {
                let mut place = Vec::new();
                if let Some(e) = &f.engine {
                    place.push(e.clone());
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
                    f.fix.clone().unwrap_or_default(),
                ]);
            }
            let _ = writeln!(out, "{table}");
        }
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
        let _ = writeln!(
            out,
            "verdict: {verdict} ({errors} errors, {warnings} warnings)"
        );
        out
    }
}

impl Report {
    /// One engine: a row per fc slot. Several: a row per engine with the whole layout.
    fn slot_table(&self) -> Table {
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

fn opt(v: Option<usize>) -> String {
    v.map_or("-".into(), |x| x.to_string())
}

fn new_table(header: &[&str]) -> Table {
    let mut table = Table::new();
    table
        .load_style(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_width(140)
        .set_header(header.to_vec());
    table
}
