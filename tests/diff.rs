//! The diff engine on the planted-fault corpus (fixtures/captures/corpus, made with HF
//! transformers by gen_corpus.py): every case is named exactly, clean samples give nothing.
//! One test per finding, so removing a detector fails the test named after it.

use crate::support::{corpus, diff_entry, eagle_check, fixture, p, root, scratch};
use candle_core::{DType, Device};
use eagle_check::diff::dump_ref::DumpReference;
use eagle_check::diff::reference::RunnerReference;
use eagle_check::diff::{DiffInput, DiffStats, diff};
use eagle_check::engine::{DraftIds, Engine, EngineSel, resolve};
use eagle_check::model::open_target;
use eagle_check::report::Report;
use eagle_check::spec::Spec;
use std::collections::BTreeSet;
use std::path::PathBuf;

fn run_entry(entry: &serde_json::Value) -> (Report, DiffStats) {
    let (report, stats, _) = run_entry_with(entry, false, false, None);
    (report, stats)
}

type Names = BTreeSet<(String, Option<u64>)>;

fn expected(entry: &serde_json::Value) -> Names {
    entry["expect"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["name"].as_str().unwrap().to_string(), f["slot"].as_u64()))
        .collect()
}

fn found(report: &Report) -> Names {
    report
        .findings
        .iter()
        .map(|f| (f.name.as_str().to_string(), f.slot.map(|s| s as u64)))
        .collect()
}

/// Runs every corpus entry of `case` and checks the findings are exactly the expected ones.
fn check_case(case: &str) {
    let entries: Vec<_> = corpus().into_iter().filter(|e| e["case"] == case).collect();
    assert!(!entries.is_empty(), "no corpus entries for {case}");
    for entry in &entries {
        let (report, stats) = run_entry(entry);
        let label = format!("{} {} {}", entry["arch"], case, entry["format"]);
        assert_eq!(
            found(&report),
            expected(entry),
            "{label}: {:#?}",
            report.findings
        );
        let samples = entry["samples"].as_array().unwrap().len();
        assert_eq!(stats.samples, samples, "{label}");
        // A finding about a sample names that sample's file.
        let files: Vec<&str> = entry["samples"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["file"].as_str().unwrap())
            .collect();
        for f in report.findings.iter().filter(|f| f.sample.is_some()) {
            let file = f.file.as_deref().unwrap_or_default();
            assert!(
                files
                    .iter()
                    .any(|s| std::path::Path::new(file).ends_with(s)),
                "{label}: {} names {file:?}, not one of {files:?}",
                f.name.as_str()
            );
        }
        // Many samples of one kind collapse into one finding with a count.
        for f in &report.findings {
            assert_eq!(
                f.count.unwrap_or(1),
                samples,
                "{label}: {}",
                f.name.as_str()
            );
        }
        if expected(entry).is_empty() {
            assert_eq!(report.exit_code(), 0, "{label}");
        } else {
            assert_eq!(report.exit_code(), 1, "{label}");
        }
        let distinct: BTreeSet<&str> = files.iter().copied().collect();
        assert_eq!(stats.files, distinct.len(), "{label}: files read");
        // Where the manifest says which boundary each slot holds, identification agrees. A
        // slot named by an expected finding has that status; the others are `ok` unless a
        // finding about the whole file (order, embedding capture) is expected, whose slots
        // each say how they are off.
        let truth = entry["found_boundaries"].as_array().unwrap();
        let want = expected(entry);
        let file_level = want.iter().any(|(_, s)| s.is_none());
        for capture in &report.captures {
            for slot in &capture.slots {
                let mine: Vec<&String> = want
                    .iter()
                    .filter(|(_, s)| *s == Some(slot.slot as u64))
                    .map(|(n, _)| n)
                    .collect();
                assert!(
                    mine.contains(&&slot.status)
                        || (mine.is_empty() && (slot.status == "ok" || file_level)),
                    "{label} slot {}: status {} but the expected findings are {want:?}",
                    slot.slot,
                    slot.status
                );
                if let Some(b) = truth.get(slot.slot).and_then(|b| b.as_u64()) {
                    assert_eq!(
                        slot.found_boundary,
                        Some(b as usize),
                        "{label} {} slot {}",
                        capture.file,
                        slot.slot
                    );
                }
            }
        }
    }
}

#[test]
fn clean_f32_samples_give_no_finding() {
    check_case("clean-f32");
}

#[test]
fn clean_bf16_samples_give_no_finding() {
    check_case("clean-bf16");
}

#[test]
fn clean_pre_norm_final_state_gives_no_finding() {
    check_case("clean-final-pre");
}

/// The seed incident: [embedding, layer a, layer b] where training held three layer states.
#[test]
fn embedding_capture_is_named() {
    check_case("embedding-capture");
}

#[test]
fn off_by_one_is_named() {
    check_case("off-by-one");
}

#[test]
fn wrong_layer_is_named() {
    check_case("wrong-layer");
}

#[test]
fn order_is_named() {
    check_case("order");
}

#[test]
fn count_is_named() {
    check_case("count");
}

/// nnsight issue 630: a fused-residual engine's `hidden_states` without `+ residual`.
#[test]
fn missing_residual_is_named() {
    check_case("missing-residual");
}

#[test]
fn token_shift_is_named() {
    check_case("token-shift");
}

/// sglang PR 14280: aux states need an all-gather under expert/tensor parallelism.
#[test]
fn shard_is_named() {
    check_case("shard");
}

/// NVIDIA's debug tooling found a 50.6x scale bug while cosine read 1.000003.
#[test]
fn scale_is_named() {
    check_case("scale");
}

#[test]
fn non_finite_is_named() {
    check_case("non-finite");
}

#[test]
fn unidentified_is_named() {
    check_case("unidentified");
}

#[test]
fn final_norm_side_is_named() {
    check_case("final-norm");
}

/// Adjacent boundaries of a residual stream are strongly correlated; the margin between the
/// true boundary and its neighbours is measured over every clean slot of the corpus.
#[test]
fn adjacent_boundaries_are_told_apart() {
    let mut min_margin = f64::INFINITY;
    for entry in corpus() {
        let case = entry["case"].as_str().unwrap();
        if !case.starts_with("clean") {
            continue;
        }
        let (_, stats) = run_entry(&entry);
        let m = stats.min_neighbour_margin.unwrap();
        eprintln!(
            "{} {case} {}: min neighbour margin {m:.4}",
            entry["arch"], entry["format"]
        );
        min_margin = min_margin.min(m);
    }
    eprintln!("smallest true-vs-neighbour cosine margin over the clean corpus: {min_margin:.4}");
    assert!(min_margin > 0.01, "{min_margin}");
}

/// The same diff through the binary, with the three-way table: vLLM reads the tiny llama
/// draft's ids [1, 2, 3] raw, the training captures hold [2, 3, 4].
#[test]
fn three_way_table_through_the_binary() {
    let out = eagle_check([
        "diff",
        "--spec",
        "fixtures/captures/corpus/llama/spec.yaml",
        "--target",
        "fixtures/models/llama",
        "--captures",
        "fixtures/captures/corpus/llama/clean-f32",
        "--draft",
        "fixtures/models/llama-draft",
        "--engine",
        "vllm:v1",
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 1, "{}", out.stderr);
    let json = out.json();
    let rows = json["three_way"].as_array().unwrap();
    let col = |k: &str| {
        rows.iter()
            .map(|r| r[k].as_u64().unwrap())
            .collect::<Vec<_>>()
    };
    assert_eq!(col("spec"), vec![2, 3, 4]);
    assert_eq!(col("training"), vec![2, 3, 4]);
    assert_eq!(col("inference"), vec![1, 2, 3]);
    let names = out.finding_names();
    assert!(names.iter().all(|n| n == "off-by-one"), "{names:?}");
    assert_eq!(json["captures"][0]["slots"][0]["status"], "ok");
    for key in [
        "slot",
        "expected_boundary",
        "found_boundary",
        "state",
        "cosine",
        "rel_err",
        "norm_ratio",
        "margin",
        "status",
    ] {
        assert!(json["captures"][0]["slots"][0].get(key).is_some(), "{key}");
    }

    let ok = eagle_check([
        "diff",
        "--spec",
        "fixtures/captures/corpus/llama/spec.yaml",
        "--target",
        "fixtures/models/llama",
        "--captures",
        "fixtures/captures/corpus/llama/clean-f32",
        "--draft",
        "fixtures/models/llama-draft",
        "--engine",
        "sglang",
    ]);
    assert_eq!(ok.code, 0, "{}", ok.stdout);
    assert!(ok.stdout.contains("training b"), "{}", ok.stdout);
}

/// The llama SpecForge corpus entry of `case`, and a scratch directory holding eagle-check's own
/// `run --dump` (`ref_{i}.safetensors`) of each of its samples' tokens.
fn dump_llama_entry(case: &str, scratch_name: &str) -> (serde_json::Value, PathBuf) {
    let entry = corpus()
        .into_iter()
        .find(|e| e["arch"] == "llama" && e["case"] == case && e["format"] == "specforge")
        .unwrap();
    let dir = scratch(scratch_name);
    for (i, sample) in entry["samples"].as_array().unwrap().iter().enumerate() {
        let file = root().join(sample["file"].as_str().unwrap());
        let s = &eagle_check::readers::read_capture_path(&file).unwrap()[0];
        let ids: Vec<String> = s
            .token_ids
            .as_ref()
            .unwrap()
            .iter()
            .map(|t| t.to_string())
            .collect();
        let out = eagle_check([
            "run",
            "--target",
            "fixtures/models/llama",
            "--engine",
            "sglang",
            "--tokens",
            &ids.join(","),
            "--dump",
            &p(&dir.join(format!("ref_{i}.safetensors"))),
        ]);
        assert_eq!(out.code, 0, "{}", out.stderr);
    }
    (entry, dir)
}

/// `--reference` takes the boundaries from an all-layer dump instead of running the target:
/// here eagle-check's own `run --dump` of the same tokens stands in for an engine's dump.
#[test]
fn reference_dump_is_a_second_source_of_the_same_boundaries() {
    let (entry, dir) = dump_llama_entry("off-by-one", "diff-reference");
    let spec = Spec::load(&root().join(entry["spec"].as_str().unwrap())).unwrap();
    let mut reference = DumpReference::open(&dir).unwrap();
    let captures: Vec<PathBuf> = vec![root().join(entry["path"].as_str().unwrap())];
    let (report, _) = diff(
        &DiffInput {
            spec: &spec,
            captures: &captures,
            feed: None,
            arch: None,
            batching: Default::default(),
        },
        &mut reference,
    )
    .unwrap();
    assert_eq!(found(&report), expected(&entry));
    // And a feed from a dump source answers the same three-way question.
    let feed = resolve(
        &EngineSel::newest(Engine::Sglang),
        Some("llama"),
        &DraftIds::nested(&[1, 2, 3]),
        5,
    );
    let (report, _) = diff(
        &DiffInput {
            spec: &spec,
            captures: &captures,
            feed: Some(&feed),
            arch: Some("llama"),
            batching: Default::default(),
        },
        &mut reference,
    )
    .unwrap();
    assert_eq!(
        report
            .three_way
            .iter()
            .map(|r| r.training)
            .collect::<Vec<_>>(),
        vec![Some(1), Some(2), Some(3)]
    );
}

/// An evil .pt (a pickle that calls os.system) is refused with a clear error; nothing runs.
#[test]
fn evil_pickle_is_refused_and_nothing_runs() {
    let marker = std::path::Path::new("/tmp/eagle_check_pwned");
    let _ = std::fs::remove_file(marker);
    let evil = fixture("captures/readers/evil");
    let files: Vec<_> = std::fs::read_dir(&evil)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.to_string_lossy().contains("os_system") && p.extension().is_some_and(|x| x == "pt")
        })
        .collect();
    assert!(!files.is_empty());
    for file in files {
        let out = eagle_check([
            "diff",
            "--spec",
            "fixtures/captures/corpus/llama/spec.yaml",
            "--target",
            "fixtures/models/llama",
            "--captures",
            &p(&file),
        ]);
        let name = file.file_name().unwrap().to_string_lossy().to_string();
        out.assert_could_not_check(&[&name, "system", "not allowed"]);
    }
    assert!(!marker.exists(), "the pickle's payload ran");
}

/// A SpecForge output directory also holds vocab_mapping.pt (d2t, t2d): it is skipped, not
/// judged; a directory with nothing but such files is "could not check".
#[test]
fn files_without_hidden_states_are_skipped() {
    let dir = scratch("diff-skip");
    let src = fixture("captures/corpus/llama/clean-f32/specforge/rows_0-2/data_0.ckpt");
    std::fs::copy(&src, dir.join("data_0.ckpt")).unwrap();
    let mut vocab = std::collections::HashMap::new();
    vocab.insert(
        "d2t".to_string(),
        candle_core::Tensor::new(&[0i64, 1, 2], &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&vocab, dir.join("vocab_mapping.safetensors")).unwrap();
    let run = |captures: &std::path::Path| {
        eagle_check([
            "diff",
            "--spec",
            "fixtures/captures/corpus/llama/spec.yaml",
            "--target",
            "fixtures/models/llama",
            "--captures",
            &p(captures),
            "--format",
            "json",
        ])
    };
    let out = run(&dir);
    assert_eq!(out.code, 0, "{}", out.stdout);
    assert_eq!(out.json()["subject"]["samples"], "1");
    std::fs::remove_file(dir.join("data_0.ckpt")).unwrap();
    let out = run(&dir);
    assert_eq!(out.code, 2);
    assert!(
        out.stderr.contains("no captured hidden states"),
        "{}",
        out.stderr
    );
}

/// A vLLM `extract_hidden_states` file of every layer (ids 0..L-1, raw b = id, then the final
/// pre-norm state) is a reference too: built here from eagle-check's own dump of the tokens.
#[test]
fn vllm_all_layer_dump_is_a_reference() {
    let (entry, dir) = dump_llama_entry("order", "diff-vllm-reference");
    let vllm_dir = dir.join("vllm");
    std::fs::create_dir_all(&vllm_dir).unwrap();
    for i in 0..entry["samples"].as_array().unwrap().len() {
        let d =
            candle_core::safetensors::load(dir.join(format!("ref_{i}.safetensors")), &Device::Cpu)
                .unwrap();
        let mut slots: Vec<&candle_core::Tensor> =
            (0..5).map(|b| &d[&format!("hidden_states.{b}")]).collect();
        slots.push(&d["final_pre_norm"]);
        let stacked = candle_core::Tensor::stack(&slots, 1).unwrap(); // [T, L + 1, H]
        let mut out = std::collections::HashMap::new();
        out.insert("token_ids".to_string(), d["input_ids"].clone());
        out.insert("hidden_states".to_string(), stacked);
        candle_core::safetensors::save(&out, vllm_dir.join(format!("hs_{i}.safetensors"))).unwrap();
    }
    let out = eagle_check([
        "diff",
        "--spec",
        entry["spec"].as_str().unwrap(),
        "--reference",
        &p(&vllm_dir),
        "--captures",
        entry["path"].as_str().unwrap(),
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(out.finding_names(), vec!["order"]);
    assert!(
        out.json()["subject"]["reference"]
            .as_str()
            .unwrap()
            .starts_with("dump:")
    );
}

/// Captures the target cannot be re-run on are "could not check", one line naming the file.
#[test]
fn captures_that_cannot_be_checked_exit_2_naming_the_file() {
    for (file, words) in [
        ("captures/readers/modelopt/17.pt", "vocabulary"),
        ("captures/readers/plain/aux_f32.npy", "no token ids"),
        (
            "captures/readers/torch/tensors.pt",
            "no captured hidden states",
        ),
        ("captures/readers/evil/truncated.pt", "truncated.pt"),
    ] {
        let out = eagle_check([
            "diff",
            "--spec",
            "fixtures/captures/corpus/llama/spec.yaml",
            "--target",
            "fixtures/models/llama",
            "--captures",
            &p(&fixture(file)),
        ]);
        let name = std::path::Path::new(file)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .to_string();
        out.assert_could_not_check(&[&name, words]);
    }
}

/// Only slot 0 one boundary early: the finding names slot 0 and the other slots say `ok`.
#[test]
fn one_slot_off_is_named_on_that_slot_alone() {
    check_case("one-slot-off");
    let entry = corpus()
        .into_iter()
        .find(|e| e["case"] == "one-slot-off")
        .unwrap();
    let (report, _) = run_entry(&entry);
    for capture in &report.captures {
        let statuses: Vec<&str> = capture.slots.iter().map(|s| s.status.as_str()).collect();
        assert_eq!(statuses, ["off-by-one", "ok", "ok"], "{}", capture.file);
    }
}

/// SpecForge and Model-Optimizer (without `hidden_states_prenorm`) train on the post-norm final
/// state; a pre-norm one stored there is named.
#[test]
fn pre_norm_training_target_is_named() {
    check_case("target-pre-norm");
}

/// Model-Optimizer files that set `hidden_states_prenorm` hold the pre-norm state on purpose.
#[test]
fn flagged_pre_norm_training_target_is_clean() {
    check_case("target-pre-norm-flagged");
}

/// vLLM files end with the final state speculators trains on through the verifier's norm: pre
/// is right, post is named, and the extra slot never hides a fault of the fc slots.
#[test]
fn vllm_trailing_training_target_is_judged_apart_from_the_fc_slots() {
    check_case("clean-target");
    check_case("target-post-norm");
    check_case("off-by-one-target");
}

/// A vLLM file whose token ids and rows differ in length is a broken file: exit 2 naming both
/// counts, not a slot fault.
#[test]
fn rows_and_token_ids_of_different_lengths_cannot_be_checked() {
    let entry = corpus()
        .into_iter()
        .find(|e| e["case"] == "clean-f32" && e["format"] == "vllm")
        .unwrap();
    let src = root().join(entry["samples"][0]["file"].as_str().unwrap());
    let bytes = std::fs::read(&src).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ids = st.tensor("token_ids").unwrap();
    let hs = st.tensor("hidden_states").unwrap();
    let short = ids.shape()[0] - 1;
    let dir = scratch("diff-rows-vs-ids");
    let file = dir.join("hs_0.safetensors");
    let tensors = [
        (
            "token_ids",
            safetensors::tensor::TensorView::new(
                ids.dtype(),
                vec![short],
                &ids.data()[..short * 8],
            )
            .unwrap(),
        ),
        (
            "hidden_states",
            safetensors::tensor::TensorView::new(hs.dtype(), hs.shape().to_vec(), hs.data())
                .unwrap(),
        ),
    ];
    safetensors::serialize_to_file(tensors, None, &file).unwrap();
    let out = eagle_check([
        "diff",
        "--spec",
        "fixtures/captures/corpus/llama/spec.yaml",
        "--target",
        "fixtures/models/llama",
        "--captures",
        &p(&dir),
    ]);
    assert_eq!(out.code, 2, "{}\n{}", out.stdout, out.stderr);
    let line = out.stderr.trim();
    assert_eq!(line.lines().count(), 1, "{line}");
    assert!(line.contains("hs_0.safetensors"), "{line}");
    assert!(
        line.contains(&format!("{short} token ids"))
            && line.contains(&format!("{} rows", hs.shape()[0])),
        "{line}"
    );
}

/// A file of several samples reports, per slot, its worst sample (the lowest cosine): a batch
/// of [noisy, clean] says what the noisy sample alone says, not what the clean one says.
#[test]
fn a_batched_file_reports_its_worst_sample_per_slot() {
    let dir = scratch("diff-batch-worst");
    let r =
        candle_core::safetensors::load(fixture("models/llama/reference.safetensors"), &Device::Cpu)
            .unwrap();
    let ids = r["input_ids"].to_dtype(DType::I64).unwrap();
    let t = ids.dim(0).unwrap();
    let clean = candle_core::Tensor::cat(
        &[
            &r["hidden_states.2"],
            &r["hidden_states.3"],
            &r["hidden_states.4"],
        ],
        1,
    )
    .unwrap();
    // A fixed perturbation of slot 0 alone, small enough that b = 2 is still what it holds.
    let wiggle: Vec<f32> = (0..t * 192)
        .map(|i| {
            if i % 192 < 64 {
                ((i * 7919 % 13) as f32 / 13.0 - 0.5) * 0.2
            } else {
                0.0
            }
        })
        .collect();
    let noisy =
        (&clean + candle_core::Tensor::from_vec(wiggle, (t, 192), &Device::Cpu).unwrap()).unwrap();
    let write = |name: &str, rows: &[&candle_core::Tensor]| -> PathBuf {
        let path = dir.join(name);
        let n = rows.len();
        let tensors = std::collections::HashMap::from([
            (
                "input_ids".to_string(),
                candle_core::Tensor::stack(&vec![&ids; n], 0).unwrap(),
            ),
            (
                "aux_hidden_states".to_string(),
                candle_core::Tensor::stack(rows, 0).unwrap(),
            ),
        ]);
        candle_core::safetensors::save(&tensors, &path).unwrap();
        path
    };
    let target = fixture("models/llama");
    let spec = Spec::load(&fixture("captures/corpus/llama/spec.yaml")).unwrap();
    let slots = |capture: PathBuf| {
        let mut reference = RunnerReference {
            target: open_target(&target, DType::F32, &Device::Cpu).unwrap(),
            path: target.clone(),
            forward_seconds: 0.0,
        };
        let (report, _) = diff(
            &DiffInput {
                spec: &spec,
                captures: &[capture],
                feed: None,
                arch: None,
                batching: Default::default(),
            },
            &mut reference,
        )
        .unwrap();
        assert_eq!(report.captures.len(), 1);
        report.captures[0].slots.clone()
    };
    let alone = slots(write("noisy.safetensors", &[&noisy]));
    let clean_alone = slots(write("clean.safetensors", &[&clean]));
    let both = slots(write("both.safetensors", &[&noisy, &clean]));
    assert_eq!(alone[0].found_boundary, Some(2), "{alone:?}");
    assert!(
        alone[0].cosine < clean_alone[0].cosine,
        "the wiggle lowers slot 0's cosine: {} vs {}",
        alone[0].cosine,
        clean_alone[0].cosine
    );
    assert_eq!(both.len(), 3);
    for (b, a) in both.iter().zip(&alone) {
        assert_eq!(b.cosine, a.cosine, "slot {}", b.slot);
        assert_eq!(b.found_boundary, a.found_boundary, "slot {}", b.slot);
    }
}

/// `diff` refuses what needs no weight before it reads one (shared/docs/style.md, "Refuse
/// before loading"): a target whose config is fine but whose weights file is garbage still
/// gets the refusal of a spec written for another layer count, and of a missing capture
/// folder, rather than the weights error the load would give (the last run shows that error
/// is there to be hit).
#[test]
fn diff_refuses_a_layer_mismatch_or_missing_captures_before_reading_a_weight() {
    let dir = scratch("diff-refuses-before-loading");
    let target = dir.join("target");
    std::fs::create_dir_all(&target).unwrap();
    std::fs::copy(
        fixture("models/llama/config.json"),
        target.join("config.json"),
    )
    .unwrap();
    std::fs::write(target.join("model.safetensors"), b"not a safetensors file").unwrap();
    let six = dir.join("six-layers.yaml");
    std::fs::write(
        &six,
        "name: six\ntarget: { num_hidden_layers: 6, hidden_size: 64 }\ncapture:\n  boundaries: [2, 3, 4]\n",
    )
    .unwrap();
    let five = "fixtures/captures/corpus/llama/spec.yaml";
    let clean = "fixtures/captures/corpus/llama/clean-f32";
    let missing = dir.join("no-such-captures");
    let diff = |spec: &str, captures: &str| {
        eagle_check([
            "diff",
            "--spec",
            spec,
            "--target",
            &p(&target),
            "--captures",
            captures,
        ])
    };
    diff(&p(&six), clean).assert_could_not_check(&[
        "the spec was written for a 6-layer target, the reference has 5 layers",
    ]);
    diff(five, &p(&missing)).assert_could_not_check(&["no-such-captures"]);
    diff(five, clean).assert_could_not_check(&["model.safetensors"]);
}

/// `entry`'s captures against its target (f32 on the CPU, streamed when `stream`), batched or
/// one forward per sample (`per_sample`), with a pass budget of `budget` bytes.
fn run_entry_with(
    entry: &serde_json::Value,
    stream: bool,
    per_sample: bool,
    budget: Option<u64>,
) -> (Report, DiffStats, RunnerReference) {
    let opts = eagle_check::model::TargetOptions {
        stream_layers: stream,
        ..eagle_check::model::TargetOptions::new(DType::F32, &Device::Cpu)
    };
    diff_entry(entry, &opts, per_sample, budget)
}

/// What a diff found, as JSON: every finding (name, slot, message, count, file, sample) and
/// every file's slot table, values to the last bit.
fn verdicts(report: &Report) -> (serde_json::Value, serde_json::Value) {
    (
        serde_json::to_value(&report.findings).unwrap(),
        serde_json::to_value(&report.captures).unwrap(),
    )
}

/// Issue 30: `diff` over many samples runs the target once over all of them, layer by layer,
/// scoring each state as it is made, and finds exactly what one forward per sample finds, on
/// every corpus entry (every fault class, every capture format). Streamed, the report says
/// each layer was read once and the bytes read are the checkpoint's, once; a pass budget
/// smaller than the samples splits them into passes that each read it once.
#[test]
fn batched_diff_reads_each_layer_once_and_finds_what_the_per_sample_diff_finds() {
    let mut passes = 0;
    for entry in corpus() {
        let label = format!("{} {} {}", entry["arch"], entry["case"], entry["format"]);
        let (alone, alone_stats, _) = run_entry_with(&entry, false, true, None);
        let (batched, stats, _) = run_entry_with(&entry, false, false, None);
        assert_eq!(verdicts(&batched), verdicts(&alone), "{label}");
        assert_eq!(alone_stats.passes, 0, "{label}");
        assert_eq!(stats.samples, alone_stats.samples, "{label}");
        assert_eq!(
            stats.rerun, 0,
            "{label}: a sample sent back to a forward of its own"
        );
        passes += stats.passes;

        let (streamed, _, reference) = run_entry_with(&entry, true, false, None);
        assert_eq!(verdicts(&streamed), verdicts(&alone), "{label} streamed");
        let l = reference.target.cfg.num_layers;
        let cost = reference.target.model.stream_stats().unwrap();
        assert_eq!(
            (cost.forwards, cost.layers_loaded),
            (1, l),
            "{label}: {cost:?}"
        );
        let line = streamed
            .subject
            .iter()
            .find(|(k, _)| k == "streaming")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        assert!(
            line.starts_with(&format!("{l} layers loaded over 1 forward(s)")),
            "{label}: {line}"
        );
        // Every layer's bytes once, plus the embedding rows and the final norm: no more than
        // the checkpoint holds.
        let dir = fixture(&format!("models/{}", entry["arch"].as_str().unwrap()));
        let weights: u64 = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
            .filter(|e| !e.path().ends_with("reference.safetensors"))
            .map(|e| e.metadata().unwrap().len())
            .sum();
        assert!(
            cost.bytes_read <= weights,
            "{label}: read {} of {weights} bytes",
            cost.bytes_read
        );

        // One byte of budget: every file is a pass of its own, each reading the layers once.
        let (split, stats, reference) = run_entry_with(&entry, true, false, Some(1));
        assert_eq!(
            verdicts(&split),
            verdicts(&alone),
            "{label} one pass per file"
        );
        let files = stats.files;
        let cost = reference.target.model.stream_stats().unwrap();
        assert_eq!(stats.passes, files, "{label}");
        assert_eq!(cost.layers_loaded, files * l, "{label}");
    }
    assert!(passes > 10, "{passes} batched passes over the corpus");
}
