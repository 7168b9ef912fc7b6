//! Engine dumps as `diff --reference` and as junction captures: the fixtures in
//! fixtures/engine-dumps. gen_engine_dumps.py lays HF transformers' reference states out in each
//! engine's own layout (sglang's dumper files and debug-tensor-dump pass files, vLLM's
//! extract_hidden_states files); harness-sglang-tp2 was written by sglang's own dumper code
//! (fixtures/engines/harness/sglang_dumper_tp2.py). Every reference test compares each boundary
//! it reads with HF's own `hidden_states.{b}`, so a layer read one off fails it.

use crate::support::{eagle_check, fixture, p, scratch};
use eagle_check::diff::dump_ref::DumpReference;
use eagle_check::diff::names::NameMap;
use eagle_check::diff::reference::{ReferenceOptions, ReferenceSource};
use eagle_check::readers::read_safetensors;

/// HF's states of the fixture model for the first `t` tokens: (ids, b = 0..=L, pre-norm).
fn hf(model: &str, t: usize) -> (Vec<i64>, Vec<Vec<f32>>, Vec<f32>) {
    let f = read_safetensors(
        &fixture(&format!("models/{model}/reference.safetensors")),
        &Default::default(),
    )
    .unwrap();
    let get = |name: &str| {
        f.tensors
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.clone())
            .unwrap_or_else(|| panic!("{name} missing"))
    };
    let ids = get("input_ids").to_i64_vec().unwrap()[..t].to_vec();
    let h = get("hidden_states.0").dims()[1];
    let mut hs = Vec::new();
    let mut b = 0;
    while f
        .tensors
        .iter()
        .any(|(n, _)| *n == format!("hidden_states.{b}"))
    {
        hs.push(get(&format!("hidden_states.{b}")).to_f32_vec()[..t * h].to_vec());
        b += 1;
    }
    let pre = get("final_pre_norm").to_f32_vec()[..t * h].to_vec();
    (ids, hs, pre)
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn opts(l: usize, h: usize) -> ReferenceOptions {
    ReferenceOptions {
        num_layers: Some(l),
        hidden_size: Some(h),
        ..Default::default()
    }
}

/// The dump read as a reference holds exactly `expect` (b) and, when `pre`, the pre-norm final
/// state, each equal to HF's (f32 dumps of f32 states: only a pair's sum rounds, by an ulp).
fn assert_reference_is_hf(
    dir: &str,
    model: &str,
    opts: ReferenceOptions,
    expect: &[usize],
    pre: bool,
) {
    let reference = DumpReference::open_with(&fixture(dir), &opts).unwrap();
    let entries = reference.entries();
    assert_eq!(entries.len(), 1, "{dir}: one sequence");
    let e = &entries[0];
    let (ids, hs, hf_pre) = hf(model, e.tokens.len());
    assert_eq!(e.tokens, ids, "{dir}: token ids");
    assert_eq!(e.num_layers + 1, hs.len(), "{dir}: L");
    let held: Vec<usize> = (0..e.boundaries.len())
        .filter(|&b| e.boundaries[b].is_some())
        .collect();
    assert_eq!(held, expect, "{dir}: boundaries held");
    for &b in expect {
        let got = e.boundaries[b].as_ref().unwrap();
        let d = max_abs(got, &hs[b]);
        assert!(
            d < 1e-5,
            "{dir}: b = {b} differs from HF's hidden_states.{b} by {d}"
        );
    }
    assert_eq!(e.final_pre_norm.is_some(), pre, "{dir}: pre-norm state");
    if let Some(got) = &e.final_pre_norm {
        assert!(max_abs(got, &hf_pre) < 1e-5, "{dir}: pre-norm state");
    }
}

#[test]
fn sglang_dumper_reference_labels_every_boundary_as_hf_llama() {
    // plan's capture-only run on a Llama target: ids 0..3 + 1 -> b = 1..4 captured inside
    // layers 1..4 (tag layer_id), b = 0 from embed_tokens, b = 5 and pre-norm from the final
    // norm; two TP ranks holding the same states.
    assert_reference_is_hf(
        "engine-dumps/sglang-dumper/llama-reference/reference",
        "llama",
        opts(5, 64),
        &[0, 1, 2, 3, 4, 5],
        true,
    );
}

#[test]
fn sglang_dumper_reference_labels_every_boundary_as_hf_deepseek() {
    // DeepSeek (DeepseekV2DecoderLayer): ids 0..3 read raw (first-id rule) -> b = 0..3, the
    // embedding among the captures.
    assert_reference_is_hf(
        "engine-dumps/sglang-dumper/deepseek-reference/reference",
        "deepseek_v3",
        opts(4, 64),
        &[0, 1, 2, 3, 4],
        true,
    );
}

#[test]
fn sglang_layer_output_pairs_are_summed_into_boundaries() {
    // sglang <= 0.5.14 LlamaDecoderLayer returns (hidden_states, residual): the boundary after
    // layer i is their sum; reading one of them alone would give another state.
    assert_reference_is_hf(
        "engine-dumps/sglang-dumper/llama-layer-pairs",
        "llama",
        opts(5, 64),
        &[0, 1, 2, 3, 4, 5],
        true,
    );
}

#[test]
fn sglang_pass_files_read_as_reference() {
    // --debug-tensor-dump-output-folder: input_layernorm's (normed, residual) for layers >= 1,
    // embed_tokens, the final norm's pair; the decode pass is skipped.
    assert_reference_is_hf(
        "engine-dumps/sglang-pass/llama",
        "llama",
        opts(5, 64),
        &[0, 1, 2, 3, 4, 5],
        true,
    );
}

#[test]
fn sglang_layer_count_is_inferred_when_not_given() {
    assert_reference_is_hf(
        "engine-dumps/sglang-pass/llama",
        "llama",
        ReferenceOptions::default(),
        &[0, 1, 2, 3, 4, 5],
        true,
    );
}

#[test]
fn vllm_all_layer_file_reads_as_reference() {
    // ids 0..=L raw: slots b = 0..L-1 and the pre-norm state.
    assert_reference_is_hf(
        "engine-dumps/vllm/llama-reference",
        "llama",
        opts(5, 64),
        &[0, 1, 2, 3, 4],
        true,
    );
    assert_reference_is_hf(
        "engine-dumps/vllm/llama-reference",
        "llama",
        ReferenceOptions::default(),
        &[0, 1, 2, 3, 4],
        true,
    );
}

#[test]
fn vllm_deepseek_file_without_the_embedding_reads_from_b_1() {
    // vLLM's deepseek_v2 backbone cannot capture id 0, so plan asks for ids 1..=L: L slots.
    assert_reference_is_hf(
        "engine-dumps/vllm/deepseek-reference",
        "deepseek_v3",
        opts(4, 64),
        &[1, 2, 3],
        true,
    );
}

#[test]
fn reference_map_reads_user_names_and_reference_tokens_supply_ids() {
    let map = NameMap::parse(&[r"^resid_in_L(\d+)$=input".to_string()]).unwrap();
    let tokens: Vec<i64> =
        std::fs::read_to_string(fixture("engine-dumps/sglang-dumper/custom-tokens.txt"))
            .unwrap()
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
    let o = ReferenceOptions {
        map: Some(map),
        tokens: Some((
            tokens,
            fixture("engine-dumps/sglang-dumper/custom-tokens.txt"),
        )),
        ..opts(5, 64)
    };
    assert_reference_is_hf(
        "engine-dumps/sglang-dumper/custom-names",
        "llama",
        o.clone(),
        &[1, 2, 3, 4],
        false,
    );
    let r =
        DumpReference::open_with(&fixture("engine-dumps/sglang-dumper/custom-names"), &o).unwrap();
    let facts = r.facts();
    let names = facts.iter().find(|(k, _)| k == "reference_names").unwrap();
    assert!(names.1.starts_with("--reference-map"), "{}", names.1);
    assert!(names.1.contains(r"^resid_in_L(\d+)$=input"), "{}", names.1);
    let tokens = facts.iter().find(|(k, _)| k == "reference_tokens").unwrap();
    assert!(tokens.1.contains("--reference-tokens"), "{}", tokens.1);
}

#[test]
fn builtin_detection_is_named_in_the_report() {
    let r = DumpReference::open_with(
        &fixture("engine-dumps/sglang-dumper/llama-reference/reference"),
        &opts(5, 64),
    )
    .unwrap();
    let facts = r.facts();
    let get = |k: &str| {
        facts
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
            .unwrap_or_default()
    };
    assert!(
        get("reference_names").starts_with("built-in sglang rules"),
        "{facts:?}"
    );
    assert!(
        get("reference_names").contains("eagle_aux_capture"),
        "{facts:?}"
    );
    assert!(get("reference_ranks").contains("ranks [0, 1]"), "{facts:?}");
    assert!(
        get("reference_layout").contains("sglang dumper"),
        "{facts:?}"
    );
}

fn diff_json(reference: &str, captures: &str, extra: &[&str]) -> crate::support::Output {
    let mut args = vec![
        "diff".to_string(),
        "--spec".into(),
        p(&fixture("bundles/tiny-llama/spec.yaml")),
        "--target".into(),
        p(&fixture("models/llama/config.json")),
        "--reference".into(),
        p(&fixture(reference)),
        "--captures".into(),
        p(&fixture(captures)),
        "--format".into(),
        "json".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    eagle_check(args)
}

/// Each capture file's (or junction's) found boundaries, by its label.
fn found(out: &crate::support::Output) -> Vec<(String, Vec<Option<u64>>)> {
    out.json()["captures"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["file"].as_str().unwrap().to_string(),
                c["slots"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s["found_boundary"].as_u64())
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn sglang_junction_dumps_are_identified_against_an_sglang_reference() {
    // The founding incident at its three junctions: captures [b0, b2, b3], the aux tensor the
    // logits processor stores, and the draft's fc input (whose ids are shifted one: EAGLE's
    // alignment), all identified against the engine's own reference dump.
    let out = diff_json(
        "engine-dumps/sglang-dumper/llama-reference/reference",
        "engine-dumps/sglang-dumper/llama-junctions/junctions",
        &[],
    );
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    let found = found(&out);
    assert_eq!(found.len(), 3, "{found:?}");
    for (label, b) in &found {
        assert_eq!(b, &[Some(0), Some(2), Some(3)], "{label}");
    }
    let labels: Vec<&str> = found.iter().map(|(l, _)| l.as_str()).collect();
    assert!(
        labels
            .iter()
            .any(|l| l.contains("junction 1") && l.contains("layers [0, 2, 3]")),
        "{labels:?}"
    );
    assert!(
        labels.iter().any(|l| l.contains("junction 2")),
        "{labels:?}"
    );
    assert!(
        labels
            .iter()
            .any(|l| l.contains("junction 3") && l.contains("target's tokens of step 0")),
        "{labels:?}"
    );
    assert!(
        out.finding_names()
            .contains(&"embedding-capture".to_string()),
        "{}",
        out.stdout
    );
}

#[test]
fn vllm_junction_file_is_identified_against_a_vllm_reference() {
    // SpecForge ids [1, 2, 3] read raw by vLLM: b = [1, 2, 3] where training held [2, 3, 4].
    let out = diff_json(
        "engine-dumps/vllm/llama-reference",
        "engine-dumps/vllm/llama-junctions",
        &[],
    );
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(found(&out)[0].1, [Some(1), Some(2), Some(3)]);
    assert!(
        out.finding_names().contains(&"off-by-one".to_string()),
        "{}",
        out.stdout
    );
}

#[test]
fn pass_file_reference_serves_the_vllm_junctions() {
    let out = diff_json(
        "engine-dumps/sglang-pass/llama",
        "engine-dumps/vllm/llama-junctions",
        &[],
    );
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(found(&out)[0].1, [Some(1), Some(2), Some(3)]);
    let facts = &out.json()["subject"];
    assert!(facts.to_string().contains("reference_skipped"), "{facts}");
}

#[test]
fn replicated_ranks_that_disagree_are_refused() {
    diff_json(
        "engine-dumps/sglang-dumper/tp-disagree",
        "engine-dumps/vllm/llama-junctions",
        &[],
    )
    .assert_could_not_check(&["rank 0", "rank 1", "b = 2", "must agree across ranks"]);
}

#[test]
fn tensor_parallel_shards_are_refused() {
    diff_json(
        "engine-dumps/sglang-dumper/tp-shard",
        "engine-dumps/vllm/llama-junctions",
        &[],
    )
    .assert_could_not_check(&[
        "32 wide",
        "1/2 of the hidden size 64",
        "tensor-parallel shard",
    ]);
}

#[test]
fn unknown_names_ask_for_a_reference_map() {
    diff_json(
        "engine-dumps/sglang-dumper/custom-names",
        "engine-dumps/vllm/llama-junctions",
        &[],
    )
    .assert_could_not_check(&["--reference-map", "resid_in_L{i}"]);
}

#[test]
fn dumps_without_token_ids_ask_for_reference_tokens() {
    diff_json(
        "engine-dumps/sglang-dumper/custom-names",
        "engine-dumps/vllm/llama-junctions",
        &["--reference-map", r"^resid_in_L(\d+)$=input"],
    )
    .assert_could_not_check(&["no input_ids", "--reference-tokens FILE"]);
    let out = diff_json(
        "engine-dumps/sglang-dumper/custom-names",
        "engine-dumps/vllm/llama-junctions",
        &[
            "--reference-map",
            r"^resid_in_L(\d+)$=input",
            "--reference-tokens",
            &p(&fixture("engine-dumps/sglang-dumper/custom-tokens.txt")),
        ],
    );
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(found(&out)[0].1, [Some(1), Some(2), Some(3)]);
}

#[test]
fn a_bad_reference_map_is_a_command_line_error() {
    diff_json(
        "engine-dumps/sglang-dumper/custom-names",
        "engine-dumps/vllm/llama-junctions",
        &["--reference-map", "^x$=sideways"],
    )
    .assert_could_not_check(&["--reference-map", "unknown quantity"]);
}

#[test]
fn an_incomplete_pair_is_refused() {
    // One summand of a (hidden_states, residual) pair without the other is not a boundary.
    let dir = scratch("engine-dumps-half-pair");
    let src = fixture("engine-dumps/sglang-dumper/llama-layer-pairs");
    for entry in std::fs::read_dir(&src).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !name.contains("layers.2.output.1") {
            std::fs::copy(&path, dir.join(&name)).unwrap();
        }
    }
    diff_json(&p(&dir), "engine-dumps/vllm/llama-junctions", &[]).assert_could_not_check(&[
        "layers.2.output.0",
        "b = 3",
        "other summand is missing",
    ]);
}

// ---------------------------------------------------------------------------------------------
// Dumps written by the engines' own code (fixtures/engines/harness/): sglang 0.5.23's dumper.py,
// source patcher and aux-state module, and vLLM 0.33.0's ExampleHiddenStatesConnector, each at
// TP 2 over gloo on the tiny Llama with the environment and flags `plan` prints; not assembled by
// hand. Each engine's `clean` dump ran HF's sequence and the corpus's llama clean-f32 and
// off-by-one sequences; `missing-residual` plants an engine fault (each aux capture without the
// residual stream) on the clean-f32 sequences.

const SGLANG_HARNESS: &str = "engine-dumps/harness-sglang-tp2/clean/reference";
const SGLANG_PLANTED: &str = "engine-dumps/harness-sglang-tp2/missing-residual/reference";
const VLLM_HARNESS: &str = "engine-dumps/harness-vllm-tp2/clean";
const VLLM_PLANTED: &str = "engine-dumps/harness-vllm-tp2/missing-residual";

/// `diff --reference` on a harness dump against the corpus's vLLM-format captures of `case`.
fn diff_harness(reference: &str, case: &str) -> crate::support::Output {
    eagle_check([
        "diff",
        "--spec",
        &p(&fixture("captures/corpus/llama/spec.yaml")),
        "--target",
        &p(&fixture("models/llama")),
        "--reference",
        &p(&fixture(reference)),
        "--captures",
        &p(&fixture(&format!("captures/corpus/llama/{case}/vllm"))),
        "--format",
        "json",
    ])
}

/// The harness dump's entry for HF's own sequence holds HF's `hidden_states.{b}` at every b in
/// `expect` and HF's pre-norm state.
fn assert_harness_entry_is_hf(dir: &str, expect: &[usize]) {
    let reference = DumpReference::open_with(&fixture(dir), &opts(5, 64)).unwrap();
    let entries = reference.entries();
    assert_eq!(
        entries.len(),
        5,
        "{dir}: HF's sequence and four corpus sequences"
    );
    let (ids, hs, hf_pre) = hf("llama", 12);
    let e = entries
        .iter()
        .find(|e| e.tokens == ids)
        .unwrap_or_else(|| panic!("{dir}: HF's sequence among the harness's"));
    for &b in expect {
        let got = e.boundaries[b]
            .as_ref()
            .unwrap_or_else(|| panic!("{dir}: b = {b} missing"));
        let d = max_abs(got, &hs[b]);
        // f32 on both sides; torch's CPU kernels sum in another order than HF's: a few ulps.
        assert!(
            d < 1e-5,
            "{dir}: b = {b} differs from HF's hidden_states.{b} by {d}"
        );
    }
    let pre = e.final_pre_norm.as_ref().expect("pre-norm state");
    assert!(max_abs(pre, &hf_pre) < 1e-5, "{dir}: pre-norm state");
}

#[test]
fn real_sglang_dumper_files_read_as_hf_boundaries() {
    // Both TP ranks' files merged; b = 5 is the final norm's output (norm.output.0).
    assert_harness_entry_is_hf(SGLANG_HARNESS, &[0, 1, 2, 3, 4, 5]);
}

#[test]
fn real_vllm_connector_files_read_as_hf_boundaries() {
    // ids 0..=5 read raw: b = 0..=4, the last slot the pre-norm state (no post-norm b = 5).
    assert_harness_entry_is_hf(VLLM_HARNESS, &[0, 1, 2, 3, 4]);
}

fn assert_consistent_with_clean_captures(reference: &str) -> serde_json::Value {
    let out = diff_harness(reference, "clean-f32");
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert!(out.finding_names().is_empty(), "{}", out.stdout);
    for (label, b) in found(&out) {
        assert_eq!(b, [Some(2), Some(3), Some(4)], "{label}");
    }
    out.json()["subject"].clone()
}

#[test]
fn real_sglang_dumper_reference_is_consistent_with_clean_captures() {
    let subject = assert_consistent_with_clean_captures(SGLANG_HARNESS);
    let text = |k: &str| subject[k].as_str().unwrap().to_string();
    assert!(
        text("reference_layout").starts_with("sglang dumper: 90 file(s)"),
        "{subject}"
    );
    assert!(
        text("reference_ranks").starts_with("replicated across tensor-parallel ranks"),
        "{subject}"
    );
}

#[test]
fn real_vllm_connector_reference_is_consistent_with_clean_captures() {
    let subject = assert_consistent_with_clean_captures(VLLM_HARNESS);
    assert!(
        subject["reference_layout"]
            .as_str()
            .unwrap()
            .starts_with("vLLM extract_hidden_states"),
        "{subject}"
    );
}

#[test]
fn real_engine_references_name_off_by_one_captures() {
    for reference in [SGLANG_HARNESS, VLLM_HARNESS] {
        let out = diff_harness(reference, "off-by-one");
        assert_eq!(out.code, 1, "{reference}: {}\n{}", out.stdout, out.stderr);
        assert_eq!(
            out.finding_names(),
            ["off-by-one"],
            "{reference}: {}",
            out.stdout
        );
        for (label, b) in found(&out) {
            assert_eq!(b, [Some(1), Some(2), Some(3)], "{reference}: {label}");
        }
    }
}

#[test]
fn real_engine_capture_without_the_residual_leaves_clean_captures_unidentified() {
    // The planted engine fault: the same clean captures the clean dumps identify match none of
    // the planted dump's states.
    for reference in [SGLANG_PLANTED, VLLM_PLANTED] {
        let out = diff_harness(reference, "clean-f32");
        assert_eq!(out.code, 1, "{reference}: {}\n{}", out.stdout, out.stderr);
        let names = out.finding_names();
        assert!(!names.is_empty(), "{reference}: {}", out.stdout);
        assert!(
            names.iter().all(|n| n == "unidentified"),
            "{reference}: {names:?}"
        );
        for (label, b) in found(&out) {
            assert_eq!(b, [None, None, None], "{reference}: {label}");
        }
    }
}
