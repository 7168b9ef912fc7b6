//! Renderings for people and for CI: findings collapsed over engines, `--quiet`, JUnit XML read
//! back by a real parser and checked against the structure JUnit consumers read, GitHub
//! annotations on the right lines.

use crate::support::{eagle_check, root};
use quick_xml::XmlVersion;
use quick_xml::events::Event;

const LLAMA_SPEC: &str = "specs/llama3.1-8b-specforge.yaml";
const LLAMA_DRAFT: &str = "fixtures/real-configs/draft_eagle3_llama3.1-8b__SpecForge.json";
const DS_SPEC: &str = "specs/deepseek-v3-specforge.yaml";
const DS_DRAFT: &str = "fixtures/real-configs/draft_eagle3_deepseek-v3-671b__SpecForge.json";

fn gate(spec: &str, draft: &str, extra: &[&str]) -> crate::support::Output {
    let mut args = vec!["gate", "--spec", spec, "--draft", draft];
    args.extend(extra);
    eagle_check(args)
}

/// The 1-based line of the first line of `path` (relative to the repository) holding `needle`.
fn line_of(path: &str, needle: &str) -> usize {
    let text = std::fs::read_to_string(root().join(path)).unwrap();
    text.lines().position(|l| l.contains(needle)).unwrap() + 1
}

/// The SpecForge Llama-3.1-8B config names no ids: every engine falls back to its default,
/// which matches the spec. Six warnings the same but for their engine are one row naming the
/// six engines; JSON keeps the six entries, each listing the six engines.
#[test]
fn identical_findings_over_engines_are_one_row_naming_them() {
    let out = gate(LLAMA_SPEC, LLAMA_DRAFT, &["--engine", "all"]);
    assert_eq!(out.code, 0, "{}", out.stdout);
    let rows = out
        .stdout
        .lines()
        .filter(|l| l.contains("default-fallback"))
        .count();
    assert_eq!(rows, 1, "{}", out.stdout);
    assert!(out.stdout.contains("no layer ids reach each engine"));
    assert!(
        out.stdout
            .ends_with("verdict: consistent (0 errors, 6 warnings)\n")
    );
    // Every engine is named once in the findings table (cells wrap at spaces only here).
    let findings = &out.stdout[out.stdout.find("│ finding").unwrap()..];
    for engine in [
        "sglang@0.5.23",
        "vllm:v2@0.34.0",
        "trtllm:one-model",
        "specforge:offline",
        "modelopt:hf",
        "speculators@0.9.0",
    ] {
        assert_eq!(findings.matches(engine).count(), 2, "{engine}: {findings}");
    }

    let json = gate(
        LLAMA_SPEC,
        LLAMA_DRAFT,
        &["--engine", "all", "--format", "json"],
    )
    .json();
    let findings = json["findings"].as_array().unwrap();
    assert_eq!(findings.len(), 6);
    for f in findings {
        assert_eq!(f["engines"].as_array().unwrap().len(), 6, "{f}");
        assert!(f["engine"].is_string());
    }
}

/// Findings that differ beyond their engine stay apart: vLLM's V1 runner reads the DeepSeek
/// ids one below training (an error), while its V2 runner never reads them (warnings).
#[test]
fn findings_that_differ_beyond_the_engine_stay_apart() {
    let json = gate(DS_SPEC, DS_DRAFT, &["--engine", "all", "--format", "json"]).json();
    for f in json["findings"].as_array().unwrap() {
        let engines: Vec<&str> = f["engines"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e.as_str().unwrap())
            .collect();
        assert!(engines.contains(&f["engine"].as_str().unwrap()), "{f}");
        if f["name"] == "off-by-one" {
            assert_eq!(engines.len(), 1, "{f}");
        }
    }
}

#[test]
fn quiet_prints_only_the_verdict_line() {
    let out = gate(LLAMA_SPEC, LLAMA_DRAFT, &["--engine", "all", "--quiet"]);
    assert_eq!(out.code, 0);
    assert_eq!(out.stdout, "verdict: consistent (0 errors, 6 warnings)\n");
    let out = gate(DS_SPEC, DS_DRAFT, &["--engine", "vllm:v1", "-q"]);
    assert_eq!(out.code, 1);
    assert_eq!(out.stdout, "verdict: MISMATCH (1 errors, 0 warnings)\n");
    gate(DS_SPEC, DS_DRAFT, &["--quiet", "--format", "json"])
        .assert_could_not_check(&["--quiet", "--format json"]);
}

/// An XML element as a JUnit consumer reads it.
#[derive(Debug)]
struct Element {
    name: String,
    attrs: Vec<(String, String)>,
    children: Vec<Element>,
    text: String,
}

impl Element {
    fn attr(&self, key: &str) -> &str {
        self.attrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("<{}> has no `{key}`: {:?}", self.name, self.attrs))
    }

    fn all(&self, name: &str) -> Vec<&Element> {
        self.children.iter().filter(|c| c.name == name).collect()
    }
}

/// Parses a whole document with quick-xml; panics on anything malformed.
fn parse_xml(text: &str) -> Element {
    fn open(e: &quick_xml::events::BytesStart) -> Element {
        Element {
            name: e.name().as_ref().to_string(),
            attrs: e
                .attributes()
                .map(|a| {
                    let a = a.expect("a well-formed attribute");
                    (
                        a.key.as_ref().to_string(),
                        a.normalized_value(XmlVersion::Explicit1_0)
                            .expect("an escaped value")
                            .into_owned(),
                    )
                })
                .collect(),
            children: Vec::new(),
            text: String::new(),
        }
    }
    let mut reader = quick_xml::Reader::from_str(text);
    let mut stack: Vec<(Element, String)> = Vec::new();
    let mut root = None;
    let mut decl = false;
    loop {
        match reader.read_event().expect("well-formed XML") {
            Event::Decl(_) => decl = true,
            Event::Start(e) => stack.push((open(&e), String::new())),
            Event::Empty(e) => {
                let el = open(&e);
                stack
                    .last_mut()
                    .expect("inside the root")
                    .0
                    .children
                    .push(el);
            }
            Event::Text(t) => {
                if let Some((_, raw)) = stack.last_mut() {
                    raw.push_str(&t.xml10_content());
                }
            }
            Event::GeneralRef(r) => {
                if let Some((_, raw)) = stack.last_mut() {
                    raw.push('&');
                    raw.push_str(&r.xml10_content());
                    raw.push(';');
                }
            }
            Event::End(e) => {
                let (mut el, raw) = stack.pop().expect("balanced tags");
                assert_eq!(e.name().as_ref(), el.name.as_str());
                el.text = quick_xml::escape::unescape(&raw)
                    .expect("known entities")
                    .into_owned();
                match stack.last_mut() {
                    Some((parent, _)) => parent.children.push(el),
                    None => root = Some(el),
                }
            }
            Event::Eof => break,
            other => panic!("unexpected XML event {other:?}"),
        }
    }
    assert!(decl, "no XML declaration");
    root.expect("a root element")
}

/// Checks the structure JUnit consumers expect and that every count adds up; returns the
/// failing testcases as (suite name, testcase name, failure type).
fn check_junit(text: &str) -> Vec<(String, String, String)> {
    let root = parse_xml(text);
    assert_eq!(root.name, "testsuites");
    let mut failing = Vec::new();
    let (mut tests, mut failures) = (0, 0);
    for suite in root.all("testsuite") {
        assert!(!suite.attr("name").is_empty());
        let cases = suite.all("testcase");
        assert!(!cases.is_empty(), "{suite:?}");
        assert_eq!(suite.attr("tests"), cases.len().to_string());
        let failed: Vec<_> = cases
            .iter()
            .filter(|c| !c.all("failure").is_empty())
            .collect();
        assert_eq!(suite.attr("failures"), failed.len().to_string());
        assert_eq!(suite.attr("errors"), "0");
        for case in &cases {
            assert!(!case.attr("classname").is_empty());
            assert!(!case.attr("name").is_empty());
            for child in &case.children {
                assert!(
                    ["failure", "system-out"].contains(&child.name.as_str()),
                    "{child:?}"
                );
            }
            let f = case.all("failure");
            assert!(f.len() <= 1, "one failure per testcase: {case:?}");
            if let Some(f) = f.first() {
                assert!(!f.attr("message").is_empty());
                assert!(!f.text.is_empty());
                failing.push((
                    suite.attr("name").to_string(),
                    case.attr("name").to_string(),
                    f.attr("type").to_string(),
                ));
            }
        }
        tests += cases.len();
        failures += failed.len();
    }
    assert_eq!(root.attr("tests"), tests.to_string());
    assert_eq!(root.attr("failures"), failures.to_string());
    failing
}

/// Gate with every engine on the DeepSeek drafter: a testcase per engine x fc slot, failing
/// exactly where the JSON report's slot rows are wrong (speculators reads the SpecForge ids
/// raw), each failure naming the finding with its message and fix.
#[test]
fn junit_has_a_testcase_per_engine_and_slot_and_fails_where_the_slots_are_wrong() {
    let out = gate(DS_SPEC, DS_DRAFT, &["--engine", "all", "--format", "junit"]);
    assert_eq!(out.code, 1, "{}", out.stderr);
    let failing = check_junit(&out.stdout);
    let root = parse_xml(&out.stdout);
    let json = gate(DS_SPEC, DS_DRAFT, &["--engine", "all", "--format", "json"]).json();
    let slots = json["slots"].as_array().unwrap();
    let cases: usize = root
        .all("testsuite")
        .iter()
        .filter(|s| s.attr("name").starts_with("gate ") && s.attr("name") != "gate checks")
        .map(|s| s.all("testcase").len())
        .sum();
    assert_eq!(cases, slots.len());
    let wrong: Vec<(String, String)> = slots
        .iter()
        .filter(|s| s["ok"] == false)
        .map(|s| {
            (
                format!("gate {}", s["engine"].as_str().unwrap()),
                format!("fc slot {}", s["slot"]),
            )
        })
        .collect();
    let failed: Vec<(String, String)> = failing
        .iter()
        .map(|(s, c, _)| (s.clone(), c.clone()))
        .collect();
    assert_eq!(failed, wrong);
    // speculators passes [1, 29, 57] to vLLM raw: every slot fails as off-by-one, fix included.
    assert_eq!(failing.len(), 3, "{failing:?}");
    assert!(
        failing
            .iter()
            .all(|(s, _, t)| s.starts_with("gate speculators") && t == "off-by-one"),
        "{failing:?}"
    );
    let suite = root
        .all("testsuite")
        .into_iter()
        .find(|s| s.attr("name").starts_with("gate speculators"))
        .unwrap();
    let failure = suite.all("testcase")[0].all("failure")[0];
    assert!(failure.attr("message").starts_with("off-by-one: "));
    assert!(failure.text.contains("fix: set"), "{}", failure.text);
    assert!(failure.text.contains("[2, 30, 58]"), "{}", failure.text);
}

/// diff: a suite per capture file, a testcase per slot.
#[test]
fn junit_for_diff_has_a_testcase_per_capture_file_and_slot() {
    let out = eagle_check([
        "diff",
        "--spec",
        "fixtures/captures/corpus/llama/spec.yaml",
        "--target",
        "fixtures/models/llama",
        "--captures",
        "fixtures/captures/corpus/llama/embedding-capture",
        "--format",
        "junit",
    ]);
    assert_eq!(out.code, 1, "{}", out.stderr);
    let failing = check_junit(&out.stdout);
    let root = parse_xml(&out.stdout);
    let files: Vec<_> = root
        .all("testsuite")
        .into_iter()
        .filter(|s| s.attr("name").contains("embedding-capture"))
        .collect();
    assert!(!files.is_empty());
    for suite in &files {
        assert_eq!(suite.all("testcase").len(), 3, "{suite:?}");
    }
    assert!(!failing.is_empty());
    assert!(
        failing.iter().all(|(_, _, t)| t == "embedding-capture"),
        "{failing:?}"
    );
}

/// An error on the ids points at the draft config's ids line; a default that happens to match
/// (no ids in the config) warns on the spec's boundaries line.
#[test]
fn github_annotations_point_at_the_ids_line_or_the_spec_line() {
    let out = gate(
        DS_SPEC,
        DS_DRAFT,
        &["--engine", "vllm:v1", "--format", "github"],
    );
    assert_eq!(out.code, 1);
    let first = out.stdout.lines().next().unwrap();
    let line = line_of(DS_DRAFT, "eagle_aux_hidden_state_layer_ids");
    assert!(
        first.starts_with(&format!(
            "::error file={DS_DRAFT},line={line},title=eagle-check off-by-one (vllm%3Av1@0.33.0%2C slot 0)::"
        )),
        "{first}"
    );
    assert!(first.contains("%0Afix: set"), "{first}");
    assert_eq!(
        out.stdout.lines().last().unwrap(),
        "verdict: MISMATCH (1 errors, 0 warnings)"
    );

    let out = gate(
        LLAMA_SPEC,
        LLAMA_DRAFT,
        &["--engine", "all", "--format", "github"],
    );
    assert_eq!(out.code, 0);
    let lines: Vec<&str> = out.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "one annotation for six engines: {lines:?}");
    let line = line_of(LLAMA_SPEC, "boundaries:");
    assert!(
        lines[0].starts_with(&format!(
            "::warning file={LLAMA_SPEC},line={line},title=eagle-check default-fallback ("
        )),
        "{}",
        lines[0]
    );
}

/// Progress bars are for a terminal: a run whose stderr is a pipe writes nothing there.
#[test]
fn no_progress_reaches_stderr_off_a_terminal() {
    let out = eagle_check(["run", "fixtures/bundles/tiny-llama"]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stderr, "");
}
