//! The seed incident on the tiny DeepSeek-V3 target, through the binary (issue 5): `run` and
//! `diff` with a DeepSeek-V3 SpecForge-style spec, the seed's local patch (ids [-1, 0, 1] under
//! sglang before PR 25454: [embedding, b1, b2] instead of [b1, b2, b3]) named
//! `embedding-capture` with its fix, and the draft against its PyTorch reference.
//! Fixtures: fixtures/gen_deepseek_bundle.py (bundles/tiny-deepseek{,-seed},
//! models/deepseek_v3-draft, captures/deepseek-seed).

use crate::support::{Output, eagle_check, fixture, p, scratch};
use candle_core::{DType, Device, Tensor};
use eagle_check::compare::closeness;
use eagle_check::config::{DraftConfig, ModelConfig};
use eagle_check::model::draft::Eagle3Draft;
use eagle_check::model::load_target;
use eagle_check::model::source::{SafetensorsSource, Vb};
use std::collections::HashMap;

/// The f32 parity bound, with its reason: `eagle_check::tolerance::PARITY_F32`.
const F32_TOL: f64 = eagle_check::tolerance::PARITY_F32;
const SPEC: &str = "fixtures/bundles/tiny-deepseek/spec.yaml";
const TARGET: &str = "fixtures/models/deepseek_v3";
const CLEAN: &str = "fixtures/captures/deepseek-seed/clean";
const SEED_FAULT: &str = "fixtures/captures/deepseek-seed/seed-fault";

fn load(path: &std::path::Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn reference_ids() -> String {
    let r = load(&fixture("models/deepseek_v3/reference.safetensors"));
    let ids: Vec<i64> = r["input_ids"].to_vec1().unwrap();
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn diff_json(captures: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "diff",
        "--spec",
        SPEC,
        "--target",
        TARGET,
        "--captures",
        captures,
        "--format",
        "json",
    ];
    args.extend_from_slice(extra);
    eagle_check(args)
}

/// Per capture file, the boundary each fc slot was identified as.
fn found_boundaries(json: &serde_json::Value) -> Vec<Vec<Option<u64>>> {
    json["captures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            c["slots"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| s["found_boundary"].as_u64())
                .collect()
        })
        .collect()
}

/// SpecForge ids [0, 1, 2] (OUT) under sglang-legacy's +1 rule: b = [1, 2, 3] = the spec.
#[test]
fn deepseek_bundle_is_consistent() {
    let out = eagle_check([
        "run",
        &p(&fixture("bundles/tiny-deepseek")),
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let json = out.json();
    assert_eq!(json["verdict"], "consistent");
    assert!(out.finding_names().is_empty(), "{:?}", out.finding_names());
    assert_eq!(json["subject"]["engine"], "sglang@0.5.10");
    assert_eq!(json["subject"]["spec_b"], "[1, 2, 3]");
    assert_eq!(json["subject"]["fed_b"], "[1, 2, 3]");
}

/// The seed's local patch: -1 prepended, the last id dropped. Stock sglang 0.5.10 crashes on
/// it at layer 0; the patched engine fed [embedding, b1, b2]. The findings say both and the fix
/// restores the trained ids.
#[test]
fn seed_patch_bundle_is_embedding_capture_with_the_fix() {
    let out = eagle_check([
        "run",
        &p(&fixture("bundles/tiny-deepseek-seed")),
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(out.finding_names(), vec!["refused", "embedding-capture"]);
    let json = out.json();
    assert_eq!(json["verdict"], "mismatch");
    assert!(
        json["subject"]["fed_b"]
            .as_str()
            .unwrap()
            .ends_with("(patched to capture the embedding: [0, 1, 2])"),
        "{}",
        json["subject"]
    );
    assert_eq!(json["subject"]["spec_b"], "[1, 2, 3]");
    assert!(
        json["subject"]["draft_ids"]
            .as_str()
            .unwrap()
            .contains("[-1, 0, 1]"),
        "{}",
        json["subject"]
    );
    let f = &json["findings"][1];
    assert_eq!(f["severity"], "error");
    assert_eq!(f["slot"], 0);
    let fix = f["fix"].as_str().unwrap();
    assert!(
        fix.contains("eagle_aux_hidden_state_layer_ids") && fix.contains("[0, 1, 2]"),
        "{fix}"
    );

    // The table report says the same.
    let table = eagle_check(["run", &p(&fixture("bundles/tiny-deepseek-seed"))]);
    assert_eq!(table.code, 1);
    assert!(
        table.stdout.contains("embedding-capture") && table.stdout.contains("MISMATCH"),
        "{}",
        table.stdout
    );
}

/// `run --dump` on the DeepSeek bundle: every boundary as HF transformers returns it, and the
/// fc input sglang-legacy assembles = what the PyTorch draft reference concatenated. On the
/// seed bundle the dumped fc input is the seed's fault (embedding + two layers).
#[test]
fn deepseek_dump_matches_transformers_and_the_draft_reference() {
    let dir = scratch("deepseek-cli-dump");
    let r = load(&fixture("models/deepseek_v3/reference.safetensors"));
    let d = load(&fixture(
        "models/deepseek_v3-draft/draft_reference.safetensors",
    ));
    for (bundle, fc_key, code) in [
        ("tiny-deepseek", "fc_input", 0),
        ("tiny-deepseek-seed", "seed_fault.fc_input", 1),
    ] {
        let dump = dir.join(format!("{bundle}.safetensors"));
        let out = eagle_check([
            "run",
            &p(&fixture(&format!("bundles/{bundle}"))),
            "--tokens",
            &reference_ids(),
            "--dump",
            &p(&dump),
        ]);
        assert_eq!(out.code, code, "{bundle}: {}\n{}", out.stdout, out.stderr);
        let got = load(&dump);
        assert_eq!(
            got["input_ids"].to_vec1::<i64>().unwrap(),
            r["input_ids"].to_vec1::<i64>().unwrap()
        );
        for b in 0..=4 {
            let key = format!("hidden_states.{b}");
            let c = closeness(&got[&key], &r[&key]).unwrap();
            eprintln!("{bundle} {key}: max rel {:.2e}", c.max_rel);
            assert_eq!(c.non_finite, 0);
            assert!(c.max_rel <= F32_TOL, "{bundle} {key}: {:.2e}", c.max_rel);
        }
        let c = closeness(&got["final_pre_norm"], &r["final_pre_norm"]).unwrap();
        assert!(
            c.max_rel <= F32_TOL,
            "{bundle} final_pre_norm: {:.2e}",
            c.max_rel
        );
        assert_eq!(got["fc_input"].dims(), &[12, 192]);
        let c = closeness(&got["fc_input"], &d[fc_key]).unwrap();
        eprintln!("{bundle} fc_input vs {fc_key}: max rel {:.2e}", c.max_rel);
        assert!(c.max_rel <= F32_TOL, "{bundle} fc_input: {:.2e}", c.max_rel);
    }
}

/// Clean SpecForge captures (cat(h[1], h[2], h[3]) from HF DeepseekV3ForCausalLM): no finding.
#[test]
fn clean_deepseek_captures_give_no_finding() {
    let out = diff_json(CLEAN, &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let json = out.json();
    assert_eq!(json["verdict"], "consistent");
    assert!(out.finding_names().is_empty(), "{:?}", out.finding_names());
    let found = found_boundaries(&json);
    assert_eq!(found.len(), 2, "both samples");
    for slots in found {
        assert_eq!(slots, vec![Some(1), Some(2), Some(3)]);
    }
}

/// The seed's fault in the captures, cat(h[0], h[1], h[2]): one `embedding-capture` finding
/// that covers both samples.
#[test]
fn seed_fault_captures_are_one_embedding_capture() {
    let out = diff_json(SEED_FAULT, &[]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(out.finding_names(), vec!["embedding-capture"]);
    let json = out.json();
    assert_eq!(json["findings"][0]["count"], 2, "{}", json["findings"]);
    assert_eq!(json["findings"][0]["severity"], "error");
    let found = found_boundaries(&json);
    assert_eq!(found.len(), 2, "both samples");
    for slots in found {
        assert_eq!(slots, vec![Some(0), Some(1), Some(2)]);
    }
}

/// Spec, training data and inference side by side: the seed-patched draft under sglang-legacy
/// feeds exactly what the faulty captures hold, and both differ from the spec.
#[test]
fn three_way_table_shows_the_seed_incident() {
    let draft = p(&fixture("bundles/tiny-deepseek-seed/draft"));
    let out = diff_json(
        SEED_FAULT,
        &["--draft", &draft, "--engine", "sglang-legacy"],
    );
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    let json = out.json();
    let rows = json["three_way"].as_array().unwrap();
    let col = |k: &str| {
        rows.iter()
            .map(|r| r[k].as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(col("spec"), vec![1, 2, 3]);
    assert_eq!(col("training"), vec![0, 1, 2]);
    assert_eq!(col("inference"), vec![0, 1, 2]);
    let names = out.finding_names();
    assert!(
        names.contains(&"embedding-capture".to_string())
            && names
                .iter()
                .all(|n| n == "embedding-capture" || n == "refused"),
        "{names:?}"
    );

    // The consistent draft on the clean captures: all three columns agree.
    let ok = diff_json(
        CLEAN,
        &[
            "--draft",
            &p(&fixture("bundles/tiny-deepseek/draft")),
            "--engine",
            "sglang-legacy",
        ],
    );
    assert_eq!(ok.code, 0, "{}\n{}", ok.stdout, ok.stderr);
    for row in ok.json()["three_way"].as_array().unwrap() {
        assert_eq!(row["spec"], row["training"], "{row}");
        assert_eq!(row["spec"], row["inference"], "{row}");
    }
}

/// The DeepSeek draft (SpecForge layout, GQA, d2t/t2d) against gen_draft.py's PyTorch forward,
/// on the right fc input and on the seed's faulty one.
#[test]
fn deepseek_draft_logits_match_the_pytorch_reference() {
    let tdir = fixture("models/deepseek_v3");
    let tcfg = ModelConfig::load(&tdir).unwrap();
    let tsrc = SafetensorsSource::open(&tdir).unwrap();
    let model = load_target(&tcfg, &tsrc, DType::F32, &Device::Cpu).unwrap();
    let ddir = fixture("models/deepseek_v3-draft");
    let dcfg = DraftConfig::load(&ddir).unwrap();
    let dsrc = SafetensorsSource::open(&ddir).unwrap();
    let vb = Vb::new(&dsrc, DType::F32, &Device::Cpu);
    let d = Eagle3Draft::load(&dcfg, &vb, tcfg.hidden_size, 3).unwrap();
    let r = load(&ddir.join("draft_reference.safetensors"));
    let ids: Vec<u32> = r["draft_input_ids"]
        .to_vec1::<i64>()
        .unwrap()
        .into_iter()
        .map(|x| x as u32)
        .collect();
    let n = ids.len();
    let fault_fc = r["seed_fault.fc_input"].narrow(0, 0, n).unwrap();
    for (fc, logits_key, next_key) in [
        (
            r["draft_fc_input"].clone(),
            "draft_logits",
            "draft_next_target_ids",
        ),
        (
            fault_fc,
            "seed_fault.draft_logits",
            "seed_fault.draft_next_target_ids",
        ),
    ] {
        let out = d.forward(&ids, &fc, model.embeddings()).unwrap();
        let c = closeness(&out.logits, &r[logits_key]).unwrap();
        eprintln!("deepseek_v3-draft {logits_key}: max rel {:.2e}", c.max_rel);
        assert!(c.max_rel <= F32_TOL, "{logits_key}: {:.3e}", c.max_rel);
        let want: Vec<i64> = r[next_key].to_vec1::<i64>().unwrap();
        assert_eq!(out.next_target_ids, want, "{next_key}");
    }
    // The fault is visible in the draft's greedy tokens.
    assert_ne!(
        r["draft_next_target_ids"].to_vec1::<i64>().unwrap(),
        r["seed_fault.draft_next_target_ids"]
            .to_vec1::<i64>()
            .unwrap()
    );
}
