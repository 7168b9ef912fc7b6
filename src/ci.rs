//! CI-native renderings of a [`Report`]: JUnit XML (`--format junit`) for test-report
//! consumers, and GitHub workflow commands (`--format github`) that annotate the draft config's
//! ids line or the spec's line on a pull request. Both render the same value as the table.
//!
//! JUnit layout: one `<testsuite>` per engine with one `<testcase>` per `fc` slot (gate, run,
//! diff's inference side), one per capture file with one `<testcase>` per slot (diff), and a
//! `checks` suite for the findings that belong to neither (configs, weight headers). A testcase
//! fails when its slot is wrong or an error names it; the `<failure>` carries the finding's
//! name (`type`), message and fix. Warnings go to the testcase's `<system-out>`.

use crate::report::{Finding, Report, Severity};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// One `<testcase>` while it is being filled.
struct Case {
    name: String,
    /// The slot is not what training held, whatever the findings say (with the reason).
    wrong: Option<String>,
    errors: Vec<usize>,
    warnings: Vec<usize>,
}

impl Case {
    fn new(name: String, wrong: Option<String>) -> Case {
        Case {
            name,
            wrong,
            errors: Vec::new(),
            warnings: Vec::new(),
        }
    }

    fn failed(&self) -> bool {
        self.wrong.is_some() || !self.errors.is_empty()
    }

    fn add(&mut self, i: usize, f: &Finding) {
        let list = match f.severity {
            Severity::Error => &mut self.errors,
            Severity::Warning => &mut self.warnings,
        };
        if !list.contains(&i) {
            list.push(i);
        }
    }
}

/// One `<testsuite>`.
struct Suite {
    name: String,
    classname: String,
    cases: Vec<Case>,
}

/// The report as JUnit XML (the schema Jenkins, GitLab and the GitHub test-report actions
/// read: `testsuites` > `testsuite(name, tests, failures)` > `testcase(classname, name)` >
/// `failure(message, type)`).
pub fn to_junit(report: &Report) -> String {
    let command = &report.command;
    let mut suites: Vec<Suite> = Vec::new();
    let mut placed = vec![false; report.findings.len()];

    // Engines: a testcase per fc slot, in the order the slot rows came.
    let mut engines: Vec<&str> = Vec::new();
    for row in &report.slots {
        if !engines.contains(&row.engine.as_str()) {
            engines.push(&row.engine);
        }
    }
    for engine in engines {
        let rows: Vec<_> = report.slots.iter().filter(|r| r.engine == engine).collect();
        let mut cases: Vec<Case> = rows
            .iter()
            .map(|r| {
                let b = |v: Option<usize>| v.map_or("nothing".to_string(), |b| format!("b = {b}"));
                let wrong = (!r.ok).then(|| {
                    format!(
                        "fc slot {}: {engine} feeds {}, training held {}",
                        r.slot,
                        b(r.fed),
                        b(r.expected)
                    )
                });
                Case::new(format!("fc slot {}", r.slot), wrong)
            })
            .collect();
        let mine: Vec<usize> = (0..report.findings.len())
            .filter(|&i| report.findings[i].engine.as_deref() == Some(engine))
            .collect();
        for &i in &mine {
            let f = &report.findings[i];
            let pinned = f.slot.and_then(|s| rows.iter().position(|r| r.slot == s));
            match (pinned, f.severity) {
                (Some(c), _) => cases[c].add(i, f),
                // An error about the whole feed fails every slot it made wrong.
                (None, Severity::Error) => {
                    for case in cases.iter_mut().filter(|c| c.wrong.is_some()) {
                        case.add(i, f);
                    }
                }
                (None, Severity::Warning) => {}
            }
            placed[i] = cases
                .iter()
                .any(|c| c.errors.contains(&i) || c.warnings.contains(&i));
        }
        // What no slot took (a warning about the whole feed, an error on slots that are right,
        // such as the side of the final norm) goes to the first slot.
        for &i in &mine {
            if !placed[i]
                && let Some(first) = cases.first_mut()
            {
                first.add(i, &report.findings[i]);
                placed[i] = true;
            }
        }
        // A wrong slot no error names carries every error of its engine.
        let errors: Vec<usize> = mine
            .iter()
            .copied()
            .filter(|&i| report.findings[i].severity == Severity::Error)
            .collect();
        for case in cases.iter_mut().filter(|c| c.wrong.is_some()) {
            if case.errors.is_empty() {
                case.errors.extend(&errors);
            }
        }
        suites.push(Suite {
            name: format!("{command} {engine}"),
            classname: format!("{command} {engine}"),
            cases,
        });
    }

    // Capture files (diff): a testcase per slot; the findings are collapsed over samples, so a
    // slot carries the finding of the name its status gives.
    for capture in &report.captures {
        let mut cases = capture
            .slots
            .iter()
            .map(|s| {
                let wrong = (s.status != "ok").then(|| {
                    format!(
                        "slot {}: {} (found {}, expected {})",
                        s.slot,
                        s.status,
                        s.found_boundary
                            .map_or("nothing".into(), |b| format!("b = {b}")),
                        s.expected_boundary
                            .map_or("nothing".into(), |b| format!("b = {b}"))
                    )
                });
                let mut case = Case::new(format!("slot {}", s.slot), wrong);
                let named = |f: &Finding, slot: Option<usize>| {
                    f.engine.is_none() && f.name.as_str() == s.status && f.slot == slot
                };
                let find =
                    |slot: Option<usize>| report.findings.iter().position(|f| named(f, slot));
                let same_slot = find(Some(s.slot));
                let any_slot = find(None);
                if let Some(i) = same_slot.or(any_slot) {
                    case.add(i, &report.findings[i]);
                    placed[i] = true;
                }
                case
            })
            .collect::<Vec<Case>>();
        // A wrong slot whose own status no finding names (the one-apart slots of an embedding
        // capture) carries the errors its file's other slots carry.
        let file_errors: Vec<usize> = cases.iter().flat_map(|c| c.errors.clone()).collect();
        for case in cases.iter_mut().filter(|c| c.wrong.is_some()) {
            if case.errors.is_empty() {
                for &i in &file_errors {
                    case.add(i, &report.findings[i]);
                }
            }
        }
        suites.push(Suite {
            name: format!("{command} {}", capture.file),
            classname: format!("{command} {}", capture.file),
            cases,
        });
    }

    // Everything else: the engine-independent checks.
    let mut checks = Case::new("static checks".to_string(), None);
    for (i, f) in report.findings.iter().enumerate() {
        if !placed[i] {
            checks.add(i, f);
        }
    }
    if suites.is_empty() || !checks.errors.is_empty() || !checks.warnings.is_empty() {
        suites.push(Suite {
            name: format!("{command} checks"),
            classname: format!("{command} checks"),
            cases: vec![checks],
        });
    }

    let tests: usize = suites.iter().map(|s| s.cases.len()).sum();
    let failures: usize = suites
        .iter()
        .map(|s| s.cases.iter().filter(|c| c.failed()).count())
        .sum();
    let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    let _ = writeln!(
        out,
        "<testsuites name=\"{}\" tests=\"{tests}\" failures=\"{failures}\" errors=\"0\">",
        xml(&format!("eagle-check {command}"))
    );
    for suite in &suites {
        let failed = suite.cases.iter().filter(|c| c.failed()).count();
        let _ = writeln!(
            out,
            "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{failed}\" errors=\"0\" skipped=\"0\">",
            xml(&suite.name),
            suite.cases.len()
        );
        for case in &suite.cases {
            let _ = write!(
                out,
                "    <testcase classname=\"{}\" name=\"{}\"",
                xml(&suite.classname),
                xml(&case.name)
            );
            if !case.failed() && case.warnings.is_empty() {
                out.push_str("/>\n");
                continue;
            }
            out.push_str(">\n");
            if case.failed() {
                let (kind, message) = match case.errors.first() {
                    Some(&i) => {
                        let f = &report.findings[i];
                        (
                            f.name.as_str(),
                            format!("{}: {}", f.name.as_str(), f.message),
                        )
                    }
                    None => ("mismatch", case.wrong.clone().unwrap_or_default()),
                };
                let mut body: Vec<String> = case.wrong.iter().cloned().collect();
                body.extend(
                    case.errors
                        .iter()
                        .map(|&i| finding_text(&report.findings[i])),
                );
                let _ = writeln!(
                    out,
                    "      <failure message=\"{}\" type=\"{}\">{}</failure>",
                    xml(&message),
                    xml(kind),
                    xml_text(&body.join("\n\n"))
                );
            }
            if !case.warnings.is_empty() {
                let text: Vec<String> = case
                    .warnings
                    .iter()
                    .map(|&i| finding_text(&report.findings[i]))
                    .collect();
                let _ = writeln!(
                    out,
                    "      <system-out>{}</system-out>",
                    xml_text(&text.join("\n\n"))
                );
            }
            out.push_str("    </testcase>\n");
        }
        out.push_str("  </testsuite>\n");
    }
    out.push_str("</testsuites>\n");
    out
}

/// A finding as the text of a `<failure>` or `<system-out>`: name, severity, message, fix.
fn finding_text(f: &Finding) -> String {
    let severity = match f.severity {
        Severity::Error => "error",
        Severity::Warning => "warning",
    };
    let mut text = format!("{} ({severity}): {}", f.name.as_str(), f.message);
    if let Some(fix) = &f.fix {
        let _ = write!(text, "\nfix: {fix}");
    }
    text
}

/// Text escaped for an XML attribute; characters XML 1.0 cannot hold are dropped.
fn xml(text: &str) -> String {
    escape(text, true)
}

/// Text escaped for an element's content (newlines kept as they are).
fn xml_text(text: &str) -> String {
    escape(text, false)
}

fn escape(text: &str, attribute: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' if attribute => out.push_str("&quot;"),
            '\'' if attribute => out.push_str("&apos;"),
            // Parsers normalise a raw newline in an attribute value to a space; keep it.
            '\n' if attribute => out.push_str("&#10;"),
            '\t' | '\r' | '\n' => out.push(c),
            c if (c as u32) < 0x20 => {}
            c => out.push(c),
        }
    }
    out
}

/// Which file of the report an annotation points into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Which {
    Spec,
    Draft,
}

/// The draft config keys a finding without an engine may name (the longest first, so that
/// `draft_vocab_size` is not read as `vocab_size`).
const DRAFT_KEYS: &[&str] = &[
    "num_aux_hidden_states",
    "target_hidden_size",
    "draft_vocab_size",
    "vocab_size",
];

/// Where a finding belongs: candidate (file, key) pairs, the first whose key is found wins.
fn places(f: &Finding) -> Vec<(Which, &'static str)> {
    use crate::report::FindingName as N;
    const CAPTURE: [(Which, &str); 2] = [(Which::Spec, "boundaries"), (Which::Spec, "layers")];
    let msg = f.message.as_str();
    if f.name == N::FinalNorm {
        [(Which::Spec, "final_norm")]
            .into_iter()
            .chain(CAPTURE)
            .collect()
    } else if f.engine.is_some() {
        // What an engine is fed comes from the draft config's ids (or their absence, when the
        // spec's line is the best place left).
        [(Which::Draft, "eagle_aux_hidden_state_layer_ids")]
            .into_iter()
            .chain(CAPTURE)
            .collect()
    } else if let Some(key) = DRAFT_KEYS.iter().find(|k| msg.contains(*k)) {
        vec![(Which::Draft, key)]
    } else if msg.contains("fc.in_features") {
        vec![(Which::Spec, "in_features")]
    } else if msg.starts_with("the spec was written for") {
        let key = if msg.contains("-layer target") {
            "num_hidden_layers"
        } else if msg.contains("hidden size") {
            "hidden_size"
        } else {
            "model_type"
        };
        vec![(Which::Spec, key), (Which::Spec, "target")]
    } else if msg.starts_with("the spec names") {
        CAPTURE.to_vec()
    } else {
        Vec::new()
    }
}

/// The 1-based line where `key` is written as a key (`"key":` in JSON, `key:` in YAML, also
/// inside a `{ ... }` flow mapping); YAML comments do not count.
pub fn key_line(text: &str, key: &str) -> Option<usize> {
    let opens = |c: char| c.is_whitespace() || "\"'{,-".contains(c);
    for (n, line) in text.lines().enumerate() {
        let line = match line.find('#') {
            Some(0) => "",
            Some(at) if line[..at].ends_with(char::is_whitespace) => &line[..at],
            _ => line,
        };
        let mut from = 0;
        while let Some(at) = line[from..].find(key).map(|i| i + from) {
            let before = line[..at].chars().next_back();
            let after = line[at + key.len()..].trim_start_matches(['"', '\'']);
            if before.is_none_or(opens) && after.trim_start().starts_with(':') {
                return Some(n + 1);
            }
            from = at + key.len();
        }
    }
    None
}

/// The report as GitHub workflow commands: one `::error` or `::warning` per finding (findings
/// the same but for their engine are one annotation naming every engine), pointing at the
/// draft config's ids line or the spec's line when the file and the key are found, then the
/// verdict line as plain log text.
pub fn to_github(report: &Report) -> String {
    let read = |p: &Option<PathBuf>| {
        p.as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok().map(|t| (p.clone(), t)))
    };
    github_annotations(
        report,
        read(&report.sources.spec).as_ref(),
        read(&report.sources.draft_config).as_ref(),
    )
}

/// [`to_github`] on file texts already read: `(path, text)` of the spec and the draft config.
pub fn github_annotations(
    report: &Report,
    spec: Option<&(PathBuf, String)>,
    draft: Option<&(PathBuf, String)>,
) -> String {
    let mut out = String::new();
    for group in report.finding_groups() {
        let c = report.collapsed(&group);
        let f = &c.finding;
        let level = match f.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
        let mut props: Vec<String> = Vec::new();
        let located = places(f).into_iter().find_map(|(which, key)| {
            let (path, text) = match which {
                Which::Spec => spec?,
                Which::Draft => draft?,
            };
            key_line(text, key).map(|line| (path, line))
        });
        match located {
            Some((path, line)) => {
                props.push(format!("file={}", property(&repo_path(path))));
                props.push(format!("line={line}"));
            }
            None => {
                if let Some(file) = &f.file {
                    props.push(format!("file={}", property(&repo_path(Path::new(file)))));
                }
            }
        }
        let mut place: Vec<String> = Vec::new();
        if !c.engines.is_empty() {
            place.push(c.engines.join(", "));
        }
        if let Some(s) = f.slot {
            place.push(format!("slot {s}"));
        }
        let title = if place.is_empty() {
            format!("eagle-check {}", f.name.as_str())
        } else {
            format!("eagle-check {} ({})", f.name.as_str(), place.join(", "))
        };
        props.push(format!("title={}", property(&title)));
        let mut message = f.message.clone();
        for fix in &c.fixes {
            let _ = write!(message, "\nfix: {fix}");
        }
        let _ = writeln!(out, "::{level} {}::{}", props.join(","), data(&message));
    }
    let _ = writeln!(out, "{}", report.verdict_line());
    out
}

/// A path as GitHub wants it: relative to the workspace (the working directory), no `./`.
fn repo_path(path: &Path) -> String {
    let rel = std::env::current_dir()
        .ok()
        .and_then(|cwd| path.strip_prefix(cwd).ok().map(Path::to_path_buf))
        .unwrap_or_else(|| path.to_path_buf());
    let text = rel.to_string_lossy().into_owned();
    text.strip_prefix("./").map(str::to_string).unwrap_or(text)
}

/// Escapes a workflow command's message (GitHub's `escapeData`).
fn data(text: &str) -> String {
    text.replace('%', "%25")
        .replace('\r', "%0D")
        .replace('\n', "%0A")
}

/// Escapes a workflow command's property value (GitHub's `escapeProperty`).
fn property(text: &str) -> String {
    data(text).replace(':', "%3A").replace(',', "%2C")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::FindingName;

    #[test]
    fn key_lines_are_found_in_json_and_yaml() {
        let json = "{\n  \"vocab_size\": 1,\n  \"draft_vocab_size\": 2,\n  \"eagle_config\": {\n    \"eagle_aux_hidden_state_layer_ids\": [1, 2]\n  }\n}\n";
        assert_eq!(key_line(json, "vocab_size"), Some(2));
        assert_eq!(key_line(json, "draft_vocab_size"), Some(3));
        assert_eq!(key_line(json, "eagle_aux_hidden_state_layer_ids"), Some(5));
        let yaml = "# boundaries: in a comment\nname: x\ntarget: { num_hidden_layers: 32, hidden_size: 4096 }\ncapture:\n  boundaries: [2, 16, 29]\nfc: { in_features: 12288 }\n";
        assert_eq!(key_line(yaml, "boundaries"), Some(5));
        assert_eq!(key_line(yaml, "hidden_size"), Some(3));
        assert_eq!(key_line(yaml, "in_features"), Some(6));
        assert_eq!(key_line(yaml, "final_norm"), None);
    }

    #[test]
    fn annotations_escape_and_point_at_lines() {
        let mut report = Report::new("gate");
        report.findings.push(
            Finding::error(
                FindingName::OffByOne,
                "fed [1, 29]: 100% wrong\nsecond line",
            )
            .with_engine("vllm:v1@0.33.0")
            .with_fix("set ids to [2, 30]"),
        );
        let report = report.finish();
        let draft = (
            PathBuf::from("draft/config.json"),
            "{\n  \"eagle_aux_hidden_state_layer_ids\": [1, 29]\n}\n".to_string(),
        );
        let out = github_annotations(&report, None, Some(&draft));
        let first = out.lines().next().unwrap();
        assert_eq!(
            first,
            "::error file=draft/config.json,line=2,title=eagle-check off-by-one (vllm%3Av1@0.33.0)::\
             fed [1, 29]: 100%25 wrong%0Asecond line%0Afix: set ids to [2, 30]"
        );
        assert_eq!(out.lines().last().unwrap(), report.verdict_line());
    }

    #[test]
    fn xml_escapes_markup_and_drops_control_characters() {
        assert_eq!(
            xml("a<b & \"c\" 'd'\u{1}\n"),
            "a&lt;b &amp; &quot;c&quot; &apos;d&apos;&#10;"
        );
        assert_eq!(xml_text("a<b & \"c\"\u{1}\n"), "a&lt;b &amp; \"c\"\n");
    }
}
