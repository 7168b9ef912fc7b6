//! `eagle-check run` end to end through the binary: bundles, exit codes, the dump's contents
//! against the HF reference, and bad input.

use crate::support::{eagle_check, fixture, p, scratch};
use candle_core::{DType, Device, Tensor};
use eagle_check::compare::closeness;
use std::collections::HashMap;

fn load(path: &std::path::Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn reference_ids() -> String {
    let r = load(&fixture("models/llama/reference.safetensors"));
    let ids: Vec<i64> = r["input_ids"].to_vec1().unwrap();
    ids.iter()
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

#[test]
fn consistent_bundle_exits_0() {
    let out = eagle_check([
        "run",
        &p(&fixture("bundles/tiny-llama")),
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let json = out.json();
    assert_eq!(json["verdict"], "consistent");
    assert_eq!(json["subject"]["fed_b"], "[2, 3, 4]");
}

#[test]
fn bundle_whose_engine_reads_ids_raw_exits_1_with_off_by_one() {
    let out = eagle_check([
        "run",
        &p(&fixture("bundles/tiny-llama-vllm-offbyone")),
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(out.finding_names(), vec!["off-by-one"]);
    assert_eq!(out.json()["subject"]["fed_b"], "[1, 2, 3]");
}

/// The dump holds every boundary as HF returns it, and the fc input the engine assembled:
/// for sglang on this draft that is b = [2, 3, 4], which is what the PyTorch draft reference
/// (SpecForge's OUT rule on HF hidden states) concatenated.
#[test]
fn dump_matches_transformers_and_the_reference_fc_input() {
    let dir = scratch("run-dump");
    let dump = dir.join("capture.safetensors");
    let out = eagle_check([
        "run",
        &p(&fixture("bundles/tiny-llama")),
        "--tokens",
        &reference_ids(),
        "--dump",
        &p(&dump),
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let got = load(&dump);
    let r = load(&fixture("models/llama/reference.safetensors"));
    assert_eq!(got["input_ids"].dtype(), DType::I64);
    assert_eq!(
        got["input_ids"].to_vec1::<i64>().unwrap(),
        r["input_ids"].to_vec1::<i64>().unwrap()
    );
    for b in 0..=5 {
        let key = format!("hidden_states.{b}");
        assert_eq!(got[&key].dtype(), DType::F32);
        let c = closeness(&got[&key], &r[&key]).unwrap();
        assert!(c.max_rel <= 1e-4, "{key}: {:.2e}", c.max_rel);
    }
    let c = closeness(&got["final_pre_norm"], &r["final_pre_norm"]).unwrap();
    assert!(c.max_rel <= 1e-4);
    let d = load(&fixture("models/llama-draft/draft_reference.safetensors"));
    assert_eq!(got["fc_input"].dims(), &[12, 192]);
    let c = closeness(&got["fc_input"], &d["fc_input"]).unwrap();
    assert!(c.max_rel <= 1e-4, "fc_input: {:.2e}", c.max_rel);
    assert!(!dir.join("capture.safetensors.partial").exists());
    // The draft ran on the training alignment: the feature at t with the embedding of token
    // t + 1 (gen_draft.py's draft_fc_input = fc_input[:-1], draft_input_ids = input_ids[1:]).
    let c = closeness(&got["draft_logits"], &d["draft_logits"]).unwrap();
    assert!(c.max_rel <= 1e-4, "draft_logits: {:.2e}", c.max_rel);
    let next = got["draft_next_target_ids"].to_vec1::<i64>().unwrap();
    assert_eq!(next, d["draft_next_target_ids"].to_vec1::<i64>().unwrap());
    // And the agreement in the report pairs draft row t with the target's greedy token at t + 1.
    let greedy: Vec<i64> = r["logits"]
        .argmax(1)
        .unwrap()
        .to_dtype(DType::I64)
        .unwrap()
        .to_vec1()
        .unwrap();
    let agree = next
        .iter()
        .zip(&greedy[1..])
        .filter(|(a, b)| a == b)
        .count();
    let json = eagle_check([
        "run",
        &p(&fixture("bundles/tiny-llama")),
        "--tokens",
        &reference_ids(),
        "--format",
        "json",
    ])
    .json();
    assert_eq!(
        json["subject"]["draft_top1"],
        format!("{agree}/11 positions agree with the target's greedy token")
    );
}

#[test]
fn run_rejects_bad_input_with_exit_2() {
    let bundle = p(&fixture("bundles/tiny-llama"));
    eagle_check(["run", &bundle, "--tokens", "1,2,99999"])
        .assert_could_not_check(&["99999", "vocab"]);
    eagle_check(["run", "fixtures/no-such-bundle"]).assert_could_not_check(&["no-such-bundle"]);
    eagle_check(["run", &bundle, "--device", "cuda"]).assert_could_not_check(&["CUDA"]);
    let file = scratch("run-bad-tokens").join("ids.txt");
    std::fs::write(&file, "1\n2\nthree\n").unwrap();
    eagle_check(["run", &bundle, "--token-file", &p(&file)])
        .assert_could_not_check(&["ids.txt", "three"]);
    let llama = p(&fixture("models/llama"));
    eagle_check(["run", "--target", &llama, "--tokens", "1,2,3"])
        .assert_could_not_check(&["--engine"]);
}

/// An HF cache entry (`models--org--name` with `refs/main` and `snapshots/<rev>`) loads the
/// snapshot refs/main names, not another one beside it.
#[test]
fn hf_cache_entry_resolves_to_the_refs_main_snapshot() {
    let dir = scratch("hf-cache");
    let entry = dir.join("models--tiny--llama");
    let good = entry.join("snapshots").join("abc123");
    let stale = entry.join("snapshots").join("old999");
    for snap in [&good, &stale] {
        std::fs::create_dir_all(snap).unwrap();
    }
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture("models/llama").join(file), good.join(file)).unwrap();
    }
    std::fs::write(stale.join("config.json"), "{ not json").unwrap();
    std::fs::create_dir_all(entry.join("refs")).unwrap();
    std::fs::write(entry.join("refs").join("main"), "abc123\n").unwrap();
    let out = eagle_check([
        "run",
        "--target",
        &p(&entry),
        "--engine",
        "vllm",
        "--tokens",
        &reference_ids(),
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(
        out.json()["subject"]["target"]
            .as_str()
            .unwrap()
            .contains("models--tiny--llama")
    );
    // Without refs/main two snapshots are ambiguous: exit 2, naming the entry.
    std::fs::remove_file(entry.join("refs").join("main")).unwrap();
    let out = eagle_check([
        "run",
        "--target",
        &p(&entry),
        "--engine",
        "vllm",
        "--tokens",
        "1,2,3",
    ]);
    out.assert_could_not_check(&["models--tiny--llama", "snapshots"]);
}

/// A spec and an engine without a draft: what the engine feeds by default is judged.
#[test]
fn spec_without_draft_judges_the_engine_default() {
    let run = |engine: &str| {
        eagle_check([
            "run",
            "--target",
            &p(&fixture("models/llama")),
            "--spec",
            &p(&fixture("bundles/tiny-llama/spec.yaml")),
            "--engine",
            engine,
            "--tokens",
            "1,2,3,4",
            "--format",
            "json",
        ])
    };
    // L = 5: the default is b = [2, L/2, L-3] = [2, 2, 2] against a spec of [2, 3, 4].
    let out = run("vllm");
    assert_eq!(out.code, 1, "{}", out.stdout);
    assert_eq!(out.finding_names(), vec!["default-fallback"]);
}

/// `run` reads the draft's weight headers before any weight: a draft whose `lm_head` has half
/// its rows is named as a `shape` error (exit 1) and nothing is run (no draft agreement in the
/// report), instead of failing later while loading it.
#[test]
fn run_names_a_misshapen_draft_head_before_running_anything() {
    let dir = scratch("run-misshapen-draft-head");
    let bundle = fixture("bundles/tiny-llama");
    std::os::unix::fs::symlink(bundle.join("target"), dir.join("target")).unwrap();
    std::fs::copy(bundle.join("spec.yaml"), dir.join("spec.yaml")).unwrap();
    std::fs::create_dir(dir.join("draft")).unwrap();
    std::fs::copy(
        bundle.join("draft/config.json"),
        dir.join("draft/config.json"),
    )
    .unwrap();
    // Through the safetensors crate: the draft holds a bool t2d, which candle does not load.
    let bytes = std::fs::read(bundle.join("draft/model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, safetensors::tensor::TensorView)> = st
        .tensors()
        .into_iter()
        .map(|(name, t)| {
            if name != "lm_head.weight" {
                return (name, t);
            }
            let (rows, cols) = (t.shape()[0] / 2, t.shape()[1]);
            let size = rows * cols * t.dtype().bitsize() / 8;
            let half = safetensors::tensor::TensorView::new(
                t.dtype(),
                vec![rows, cols],
                &t.data()[..size],
            )
            .unwrap();
            (name, half)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("draft/model.safetensors")).unwrap();

    let out = eagle_check(["run", &p(&dir), "--format", "json"]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    let json = out.json();
    let shape = json["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == "shape")
        .unwrap_or_else(|| panic!("no shape finding: {}", out.stdout));
    assert!(shape.to_string().contains("lm_head.weight"), "{shape}");
    assert!(
        json["subject"].get("draft_top1").is_none(),
        "{}",
        out.stdout
    );
}

/// `--generate N` adds the greedy continuation to the report; without it there is none.
#[test]
fn generate_adds_the_greedy_continuation_only_when_asked() {
    let bundle = p(&fixture("bundles/tiny-llama"));
    let with = eagle_check(["run", &bundle, "--generate", "3", "--format", "json"]);
    assert_eq!(with.code, 0, "{}", with.stderr);
    let text = with.json()["subject"]["greedy_continuation"].clone();
    assert!(text.is_string(), "{}", with.stdout);
    let without = eagle_check(["run", &bundle, "--format", "json"]);
    assert_eq!(without.code, 0, "{}", without.stderr);
    assert!(
        without.json()["subject"]
            .get("greedy_continuation")
            .is_none(),
        "{}",
        without.stdout
    );
}

/// One token gives no pair to align the draft with: refused (exit 2); two are enough.
#[test]
fn run_needs_two_tokens_and_two_are_enough() {
    let bundle = p(&fixture("bundles/tiny-llama"));
    let one = eagle_check(["run", &bundle, "--tokens", "5"]);
    assert_eq!(one.code, 2, "{}", one.stderr);
    assert!(one.stderr.contains("at least 2 tokens"), "{}", one.stderr);
    let two = eagle_check(["run", &bundle, "--tokens", "5,6"]);
    assert_eq!(two.code, 0, "{}\n{}", two.stdout, two.stderr);
}
