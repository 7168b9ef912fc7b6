//! The acceptance probe (issue 12) on the trained pair (`fixtures/trained`: a Llama target and
//! an EAGLE-3 drafter trained on b = [1, 4, 7]) and on random-weight drafts.

use crate::support::{eagle_check, fixture, scratch};
use candle_core::{DType, Device, Tensor};
use eagle_check::config::{DraftConfig, ModelConfig};
use eagle_check::model::draft::{Chain, open_draft};
use eagle_check::model::source::SafetensorsSource;
use eagle_check::model::{CaptureRequest, Progress, load_target};
use eagle_check::tokenize::read_token_file;

fn bundle() -> String {
    fixture("bundles/trained-llama").display().to_string()
}

fn prompts() -> String {
    fixture("trained/prompts.jsonl").display().to_string()
}

fn rows(report: &serde_json::Value) -> Vec<serde_json::Value> {
    report["probe"].as_array().cloned().unwrap_or_default()
}

fn row_with<'a>(rows: &'a [serde_json::Value], label: &str) -> &'a serde_json::Value {
    rows.iter()
        .find(|r| {
            r["labels"]
                .as_array()
                .unwrap()
                .iter()
                .any(|l| l.as_str().unwrap().contains(label))
        })
        .unwrap_or_else(|| panic!("no row labelled {label}"))
}

fn boundaries(row: &serde_json::Value) -> Vec<u64> {
    row["boundaries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap())
        .collect()
}

/// The probe's first-token acceptance of the fed layout is `run`'s `draft top1` figure: the
/// same fc input, the same draft, the same alignment (a probe that fed fc another tensor, or
/// paired the feature at t with another token, would disagree).
#[test]
fn the_fed_layout_scores_what_run_measures() {
    let run = eagle_check(["run", &bundle(), "--format", "json"]);
    assert_eq!(run.code, 0, "{}", run.stderr);
    let top1 = run.json()["subject"]["draft_top1"]
        .as_str()
        .unwrap()
        .to_string();
    let (agree, total) = top1.split_once(' ').unwrap().0.split_once('/').unwrap();
    let (agree, total): (f64, f64) = (agree.parse().unwrap(), total.parse().unwrap());
    assert_eq!((agree, total), (159.0, 255.0), "{top1}");

    let out = eagle_check(["probe", &bundle(), "--format", "json"]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let report = out.json();
    let rows = rows(&report);
    let fed = row_with(&rows, "fed by sglang@0.5.23");
    assert_eq!(boundaries(fed), [1, 4, 7]);
    let acc = fed["acceptance"]["value"].as_f64().unwrap();
    assert!((acc - agree / total).abs() < 1e-12, "{acc} vs {top1}");
    // Interval around it, and the control far below.
    assert!(fed["acceptance"]["lo"].as_f64().unwrap() < acc);
    assert!(fed["acceptance"]["hi"].as_f64().unwrap() > acc);
    let control = row_with(&rows, "control");
    assert!(control["acceptance"]["value"].as_f64().unwrap() < acc - 0.2);
}

/// With enough text the trained layout ranks first by cross-entropy, and `--search` recovers
/// it exactly (exhaustive over the 672 layouts of L = 8, k = 3) with a margin beyond its
/// interval; the spec it writes reads back and gates consistent for SpecForge.
#[test]
fn the_search_recovers_the_trained_layout() {
    let dir = scratch("probe-search");
    let spec = dir.join("found.yaml");
    let out = eagle_check([
        "probe",
        &bundle(),
        "--prompts",
        &prompts(),
        "--search",
        "--write-spec",
        spec.to_str().unwrap(),
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let report = out.json();
    let rows = rows(&report);
    assert_eq!(boundaries(&rows[0]), [1, 4, 7], "{:#}", rows[0]);
    assert_eq!(rows[0]["rank"], 1);
    let labels = rows[0]["labels"].to_string();
    assert!(
        labels.contains("search: best") && labels.contains("spec"),
        "{labels}"
    );
    let subject = &report["subject"];
    let best = subject["search_best"].as_str().unwrap();
    assert!(best.starts_with("[1, 4, 7]; runner-up"), "{best}");
    assert!(!best.contains("within its interval"), "{best}");
    assert!(
        subject["search"]
            .as_str()
            .unwrap()
            .contains("672 layouts scored (exhaustive)"),
        "{subject}"
    );
    let runner_up = row_with(&rows, "search: runner-up");
    assert!(
        runner_up["above_best"]["lo"].as_f64().unwrap() > 0.0,
        "{runner_up}"
    );

    let text = std::fs::read_to_string(&spec).unwrap();
    assert!(text.contains("boundaries: [1, 4, 7]"), "{text}");
    let gate = eagle_check([
        "gate",
        "--spec",
        spec.to_str().unwrap(),
        "--draft",
        &fixture("trained/draft").display().to_string(),
        "--engine",
        "specforge",
    ]);
    assert_eq!(gate.code, 0, "{}\n{}", gate.stdout, gate.stderr);
}

/// vLLM's V1 runner reads the SpecForge ids [0, 3, 6] raw: fed b = [0, 3, 6], one boundary
/// shallower than training on every slot. The probe measures what that costs (README of
/// fixtures/trained: 0.656 -> 0.488 on all held-out text) and names the fix.
#[test]
fn a_layout_one_shallower_loses_acceptance_beyond_its_interval() {
    let out = eagle_check([
        "probe",
        &bundle(),
        "--engine",
        "vllm:v1",
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    let report = out.json();
    let f = report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == "acceptance")
        .unwrap_or_else(|| panic!("{:#}", report["findings"]));
    assert_eq!(f["severity"], "error");
    let message = f["message"].as_str().unwrap();
    assert!(
        message.contains("feeds [0, 3, 6]") && message.contains("better from [1, 4, 7]"),
        "{message}"
    );
    assert_eq!(
        f["fix"],
        "set eagle_aux_hidden_state_layer_ids to [1, 4, 7] for vllm:v1@0.33.0"
    );
    let rows = rows(&report);
    let fed = row_with(&rows, "fed by vllm:v1@0.33.0");
    let lost = fed["below_best"]["value"].as_f64().unwrap();
    assert!(lost > 0.1, "{fed}");
}

/// 200 pseudo-random ids below `vocab`.
fn random_tokens(vocab: u64) -> String {
    let mut x: u64 = 12345;
    (0..200)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            ((x >> 33) % vocab).to_string()
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// A drafter with random weights predicts no better from any layout than from features of the
/// wrong positions: the probe says so and infers nothing; `--search` cannot check (exit 2).
#[test]
fn a_random_draft_has_no_signal() {
    let tokens = random_tokens(128);
    let b = fixture("bundles/tiny-llama").display().to_string();
    let out = eagle_check(["probe", &b, "--tokens", &tokens, "--format", "json"]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(
        out.finding_names().contains(&"no-signal".to_string()),
        "{}",
        out.stdout
    );
    assert!(!out.finding_names().contains(&"acceptance".to_string()));
    let search = eagle_check(["probe", &b, "--tokens", &tokens, "--search"]);
    search.assert_could_not_check(&["probe --search", "no better", "tiny-llama/draft"]);
}

#[test]
fn too_few_positions_are_refused() {
    let out = eagle_check(["probe", &bundle(), "--tokens", "1,2,3,4,5,6,7,8,9,10"]);
    out.assert_could_not_check(&["9 draft positions", "at least 8 blocks"]);
}

/// The training data of the pair (SpecForge `.ckpt` samples) holds the trained layout, and
/// `diff` identifies it in every sample.
#[test]
fn diff_identifies_the_trained_layout_in_the_pairs_own_samples() {
    let out = eagle_check([
        "diff",
        "--spec",
        &fixture("bundles/trained-llama/spec.yaml")
            .display()
            .to_string(),
        "--target",
        &fixture("trained/target").display().to_string(),
        "--captures",
        &fixture("trained/captures").display().to_string(),
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let captures = out.json()["captures"].as_array().cloned().unwrap();
    assert_eq!(captures.len(), 8);
    for c in &captures {
        let found: Vec<u64> = c["slots"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["found_boundary"].as_u64().unwrap())
            .collect();
        assert_eq!(found, [1, 4, 7], "{c}");
    }
}

/// The chain is EAGLE-3's training-time-test attention; inference decodes the same chain as a
/// growing causal sequence (step j of row t is position t + j, attending to positions 0..=t of
/// the first pass and to the chain's own earlier positions). Decoding that way, one row at a
/// time through plain single steps, must give the chain's tokens at every row and step, and
/// the probe's accepted length.
#[test]
fn the_chain_equals_decoding_a_growing_sequence() {
    let tdir = fixture("trained/target");
    let tcfg = ModelConfig::load(&tdir).unwrap();
    let tsrc = SafetensorsSource::open(&tdir).unwrap();
    let target = load_target(&tcfg, &tsrc, DType::F32, &Device::Cpu).unwrap();
    let ddir = fixture("trained/draft");
    let dcfg = DraftConfig::load(&ddir).unwrap();
    let (draft, k) = open_draft(&dcfg, &ddir, tcfg.hidden_size, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(k, 3);
    let tokens = read_token_file(&fixture("trained/tokens.txt")).unwrap();
    let tokens = &tokens[..160];
    let cap = target
        .forward(tokens, &CaptureRequest::all(), &mut Progress::hidden())
        .unwrap();
    let n = tokens.len() - 1;
    let fc_in = Tensor::cat(&[&cap.hidden[&1], &cap.hidden[&4], &cap.hidden[&7]], 1)
        .unwrap()
        .narrow(0, 0, n)
        .unwrap();
    let fc = draft.fc_forward(&fc_in).unwrap();
    let embed = target.embeddings();
    const STEPS: usize = 3;
    let mut chain = Chain::default();
    let mut preds = Vec::new();
    let mut logits = Vec::new();
    let mut hidden = fc.clone();
    let mut ids: Vec<u32> = tokens[1..].to_vec();
    for _ in 0..STEPS {
        let s = draft.step(&ids, &hidden, embed, Some(&mut chain)).unwrap();
        ids = s.next_target_ids.iter().map(|&t| t as u32).collect();
        hidden = s.hidden;
        preds.push(s.next_target_ids);
        logits.push(s.logits);
    }
    for t in [0, 1, 17, 80, n - 1] {
        // Row t's chain as a sequence: rows 0..=t of the first pass, then one row per step.
        let mut seq_ids: Vec<u32> = tokens[1..=t + 1].to_vec();
        let mut seq_hidden = fc.narrow(0, 0, t + 1).unwrap();
        for (j, pred) in preds.iter().enumerate() {
            let s = draft.step(&seq_ids, &seq_hidden, embed, None).unwrap();
            let last = *s.next_target_ids.last().unwrap();
            assert_eq!(last, pred[t], "row {t}, step {j}");
            // f32 throughout, the same ops on other shapes: summation order only.
            let got = s.logits.get(t + j).unwrap();
            let want = logits[j].get(t).unwrap();
            let c = eagle_check::compare::closeness(&got, &want).unwrap();
            assert!(c.max_rel < 1e-5, "row {t}, step {j}: {c:?}");
            seq_ids.push(last as u32);
            let h = s.hidden.narrow(0, t + j, 1).unwrap();
            seq_hidden = Tensor::cat(&[&seq_hidden, &h], 0).unwrap();
        }
    }
    // The accepted length the probe reports for [1, 4, 7] on these tokens, counted here.
    let greedy: Vec<i64> = cap
        .logits
        .as_ref()
        .unwrap()
        .argmax(1)
        .unwrap()
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec1()
        .unwrap();
    let valid: Vec<usize> = (0..n).filter(|&t| t + STEPS <= n).collect();
    let total: usize = valid
        .iter()
        .map(|&t| {
            (0..STEPS)
                .take_while(|&j| preds[j][t] == greedy[t + 1 + j])
                .count()
        })
        .sum();
    let want = total as f64 / valid.len() as f64;
    let list: Vec<String> = tokens.iter().map(|t| t.to_string()).collect();
    let out = eagle_check([
        "probe",
        &bundle(),
        "--tokens",
        &list.join(","),
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let report = out.json();
    let rows = rows(&report);
    let fed = row_with(&rows, "fed by sglang@0.5.23");
    let got = fed["accepted_length"]["value"].as_f64().unwrap();
    assert!((got - want).abs() < 1e-12, "probe {got}, counted {want}");
    assert!(want > 0.5, "{want}");
}

/// An MLA draft (`Eagle3DeepseekV2ForCausalLM`) is probed on its first step: the report says
/// the chain was cut to one step, and the figures are there.
#[test]
fn an_mla_draft_is_probed_on_its_first_step() {
    let tokens: Vec<String> = (0..160).map(|i| ((i * 37 + 5) % 200).to_string()).collect();
    let out = eagle_check([
        "probe",
        "--target",
        &fixture("models/deepseek_v3").display().to_string(),
        "--draft",
        &fixture("models/mla-draft").display().to_string(),
        "--engine",
        "sglang",
        "--tokens",
        &tokens.join(","),
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let report = out.json();
    assert!(
        report["subject"]["steps"]
            .as_str()
            .unwrap()
            .starts_with("1 (an MLA draft"),
        "{}",
        report["subject"]
    );
    let rows = rows(&report);
    assert!(rows.len() > 3);
    assert!(rows.iter().all(|r| r["accepted_length"].is_null()));
    assert!(rows[0]["acceptance"]["value"].as_f64().is_some());
}

/// Streaming the target's layers changes where its weights live, not what the probe measures.
#[test]
fn a_streamed_target_gives_the_same_probe() {
    let run = |extra: &[&str]| {
        let mut args = vec![
            "probe".to_string(),
            bundle(),
            "--format".into(),
            "json".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let out = eagle_check(&args);
        assert_eq!(out.code, 0, "{}", out.stderr);
        out.json()["probe"].clone()
    };
    let resident = run(&[]);
    let streamed = run(&["--stream-layers"]);
    assert!(resident.as_array().is_some_and(|a| a.len() > 3));
    assert_eq!(resident, streamed);
}

/// Issue 30: the probe runs the target over every token set at once, so streamed it reads
/// each layer once for all the prompts (not once per prompt), and its layouts are the
/// resident probe's.
#[test]
fn a_streamed_probe_reads_each_layer_once_for_every_prompt() {
    let probe = |extra: &[&str]| -> serde_json::Value {
        let (b, p) = (bundle(), prompts());
        let mut args = vec!["probe", &b, "--prompts", &p, "--format", "json"];
        args.extend_from_slice(extra);
        let out = eagle_check(&args);
        assert!(out.code < 2, "{}", out.stderr);
        serde_json::from_str(&out.stdout).unwrap()
    };
    let resident = probe(&[]);
    let streamed = probe(&["--stream-layers"]);
    assert_eq!(rows(&streamed), rows(&resident));
    let line = streamed["subject"]["streaming"]
        .as_str()
        .unwrap_or_default();
    let l = ModelConfig::load(&fixture("trained/target"))
        .unwrap()
        .num_layers;
    assert!(
        line.starts_with(&format!("{l} layers loaded over 1 forward(s)")),
        "{line}"
    );
}
