//! Public incidents replayed through the gate: the config, engine and version as reported, and
//! the verdict the fix implies. Where a report does not give every number, the test says which
//! ones are reconstructed.

use crate::support::{Output, gate_json, scratch};
use serde_json::json;
use std::path::PathBuf;

/// A draft config with ids at the top level and/or under `eagle_config`.
fn draft(dir: &std::path::Path, h: usize, top: Option<&[i64]>, nested: Option<&[i64]>) -> PathBuf {
    let mut cfg = json!({
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 1,
        "intermediate_size": 4 * h,
        "vocab_size": 32000,
        "draft_vocab_size": 32000,
    });
    if let Some(ids) = top {
        cfg["eagle_aux_hidden_state_layer_ids"] = json!(ids);
    }
    if let Some(ids) = nested {
        cfg["eagle_config"] =
            json!({"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": true});
    }
    let path = dir.join("draft.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}

fn spec(dir: &std::path::Path, model_type: &str, l: usize, h: usize, capture: &str) -> PathBuf {
    let path = dir.join("spec.yaml");
    std::fs::write(
        &path,
        format!(
            "name: incident\ntarget: {{ num_hidden_layers: {l}, hidden_size: {h}, model_type: {model_type} }}\ncapture: {capture}\n"
        ),
    )
    .unwrap();
    path
}

fn gate(spec: &std::path::Path, draft: &std::path::Path, engine: &str) -> Output {
    gate_json(spec, draft, None, engine)
}

fn errors(out: &Output) -> Vec<String> {
    out.json()["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == "error")
        .map(|f| f["name"].as_str().unwrap().to_string())
        .collect()
}

/// The issue's own case: a Llama drafter with ids [2, 16, 29] trained on b = [2, 16, 29]. The
/// earlier flat rule ("+1 only when the first id is 1") called sglang consistent; sglang's
/// llama.py adds 1 to every id (FACTS.md 1.2), so it feeds [3, 17, 30]. vLLM reads them raw.
#[test]
fn llama_ids_2_16_29_are_off_by_one_on_sglang_and_right_on_vllm() {
    let dir = scratch("incident-llama-2-16-29");
    let ids = [2, 16, 29];
    let d = draft(&dir, 4096, Some(&ids), Some(&ids));
    let s = spec(&dir, "llama", 32, 4096, "{ boundaries: [2, 16, 29] }");
    let sg = gate(&s, &d, "sglang");
    assert_eq!(sg.code, 1);
    assert_eq!(errors(&sg), vec!["off-by-one"]);
    let vllm = gate(&s, &d, "vllm");
    assert_eq!(vllm.code, 0, "{}", vllm.stdout);
}

/// sglang PR 32334: gpt-oss-120b (L = 36) drafter with ids [24, 30, 36], meant as boundaries
/// with the pre-norm final state last. sglang's +1 asked for 37 (captured nothing; the draft's
/// fc then fails on the width); gpt_oss.py in 0.5.23 reads them raw when the largest is L.
#[test]
fn sglang_pr_32334_gpt_oss_boundaries_with_the_final_state() {
    let dir = scratch("incident-32334");
    let d = draft(&dir, 2880, None, Some(&[24, 30, 36]));
    let s = spec(
        &dir,
        "gpt_oss",
        36,
        2880,
        "{ boundaries: [24, 30, 36], final_norm: pre }",
    );
    let before = gate(&s, &d, "sglang@0.5.14");
    assert_eq!(before.code, 1);
    let names = errors(&before);
    assert!(names.contains(&"out-of-range".to_string()), "{names:?}");
    let after = gate(&s, &d, "sglang");
    assert_eq!(after.code, 0, "{}", after.stdout);
}

/// sglang PR 25454: a Kimi-K2.5 drafter written in the input convention (ids = boundaries
/// [2, 30, 58]) lost accept length to the +1 rule; after the PR, deepseek_v2.py reads them raw
/// because the first id is not 1.
#[test]
fn sglang_pr_25454_kimi_input_convention() {
    let dir = scratch("incident-25454");
    let d = draft(&dir, 7168, None, Some(&[2, 30, 58]));
    let s = spec(
        &dir,
        "kimi_k25",
        61,
        7168,
        "{ layers: [2, 30, 58], convention: in }",
    );
    let before = gate(&s, &d, "sglang@0.5.10");
    assert_eq!(errors(&before), vec!["off-by-one"]);
    for engine in ["sglang@0.5.14", "sglang"] {
        assert_eq!(gate(&s, &d, engine).code, 0, "{engine}");
    }
}

/// vLLM PR 43671: a MiniMax-M2.5 drafter trained with sglang (OUT ids, +1) and served by vLLM,
/// which reads the ids raw: every slot one boundary low (position-0 acceptance ~10% vs ~45%).
/// Reconstructed: the target's L = 62 and H = 3072 and SpecForge's default ids [1, 30, 58]; the
/// config carries the ids at both keys, as converted configs do.
#[test]
fn vllm_pr_43671_minimax_trained_on_sglang_served_raw() {
    let dir = scratch("incident-43671");
    let ids = [1, 30, 58];
    let d = draft(&dir, 3072, Some(&ids), Some(&ids));
    let s = spec(
        &dir,
        "minimax_m2",
        62,
        3072,
        "{ layers: [1, 30, 58], convention: out }",
    );
    assert_eq!(gate(&s, &d, "sglang").code, 0);
    let vllm = gate(&s, &d, "vllm");
    assert_eq!(errors(&vllm), vec!["off-by-one"]);
    let fix = vllm.json()["findings"][0]["fix"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(fix.contains("[2, 31, 59]"), "{fix}");
}

/// vLLM PR 50170 (a Llama-3.3-70B drafter silently on the default heuristic: 1.2% vs 58.9%) and
/// the key-location incidents (tokenspeed PR 526, llama.cpp PR 27040, vllm-rbln PR 831): ids
/// written where the engine does not read them. Reconstructed: L = 80, H = 8192, trained on
/// b = [4, 40, 76].
#[test]
fn ids_where_the_engine_does_not_read_them_fall_back_silently() {
    let dir = scratch("incident-50170");
    let s = spec(&dir, "llama", 80, 8192, "{ boundaries: [4, 40, 76] }");
    // Nested only: vLLM's default V2 runner reads the top level only.
    let nested = draft(&dir, 8192, None, Some(&[4, 40, 76]));
    let v2 = gate(&s, &nested, "vllm");
    assert_eq!(v2.code, 1);
    assert_eq!(errors(&v2), vec!["ids-not-read", "default-fallback"]);
    let fix = v2.json()["findings"][0]["fix"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        fix.contains("top-level") && fix.contains("[4, 40, 76]"),
        "{fix}"
    );
    assert_eq!(gate(&s, &nested, "vllm:v1").code, 0);
    // Top level only: sglang reads eagle_config only.
    let dir = scratch("incident-50170-top");
    let s = spec(&dir, "llama", 80, 8192, "{ boundaries: [4, 40, 76] }");
    let top = draft(&dir, 8192, Some(&[3, 39, 75]), None);
    let sg = gate(&s, &top, "sglang");
    assert_eq!(errors(&sg), vec!["ids-not-read", "default-fallback"]);
    let fix = sg.json()["findings"][0]["fix"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        fix.contains("eagle_config") && fix.contains("[3, 39, 75]"),
        "{fix}"
    );
}

/// vLLM PR 46973: an id equal to L captured nothing on the deepseek backbone before the fix; in
/// vLLM 0.33.0 `DeepseekV2Model.forward` appends the pre-norm state for `end_layer`.
#[test]
fn vllm_pr_46973_id_l_on_deepseek_is_the_pre_norm_state() {
    let dir = scratch("incident-46973");
    let ids = [2, 30, 61];
    let d = draft(&dir, 7168, Some(&ids), None);
    let s = spec(
        &dir,
        "deepseek_v3",
        61,
        7168,
        "{ boundaries: [2, 30, 61], final_norm: pre }",
    );
    assert_eq!(gate(&s, &d, "vllm").code, 0);
    // The same spec on sglang: b = L is never captured there.
    let d = draft(&dir, 7168, None, Some(&ids));
    let sg = gate(&s, &d, "sglang");
    assert_eq!(errors(&sg), vec!["refused"]);
}
