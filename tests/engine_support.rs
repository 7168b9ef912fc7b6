//! Engine truth, second round (issue 25): which engine versions can serve an architecture at all,
//! what their capture point holds, and which draft formats they load. Each case is replayed
//! from the released wheel named in its comment (the facts, with lines, are in
//! `fixtures/engines/FACTS.md` sections 1.5, 2.1 and 8), on real published configs
//! (`fixtures/real-configs/`).

use crate::support::{eagle_check, fixture, gate_json, p, scratch};
use std::path::{Path, PathBuf};

fn real(rel: &str) -> PathBuf {
    fixture(&format!("real-configs/{rel}"))
}

/// A spec named `name` capturing `b` for a target of width `h`, with a `target:` block when
/// given (its `{...}` body).
fn write_spec(dir: &Path, name: &str, target: Option<&str>, b: [usize; 3], h: usize) -> PathBuf {
    let path = dir.join(format!("{name}.yaml"));
    let target = target.map_or(String::new(), |t| format!("target: {{ {t} }}\n"));
    let [b0, b1, b2] = b;
    std::fs::write(
        &path,
        format!(
            "name: {name}\n{target}capture:\n  boundaries: [{b0}, {b1}, {b2}]\nfc: {{ in_features: {} }}\n",
            3 * h
        ),
    )
    .unwrap();
    path
}

/// A spec of the engines' default layout `b = [2, L//2, L-3]` for an `l`-layer target of
/// width `h`.
fn default_spec(dir: &Path, l: usize, h: usize) -> PathBuf {
    write_spec(dir, &format!("default-{l}"), None, [2, l / 2, l - 3], h)
}

/// The gate with a spec and a draft, no target: the family comes from the spec or the draft.
fn gate_draft(spec: &Path, draft: &Path, engine: &str) -> crate::support::Output {
    gate_json(spec, draft, None, engine)
}

/// The message of the report's finding `name`; panics with the report when there is none.
fn message(out: &crate::support::Output, name: &str) -> String {
    finding(&out.json(), name)
        .and_then(|f| f["message"].as_str())
        .unwrap_or_else(|| panic!("no {name} finding: {}", out.stdout))
        .to_string()
}

fn gate(spec: &Path, draft: &Path, target: &Path, engine: &str) -> crate::support::Output {
    gate_json(spec, draft, Some(target), engine)
}

/// SpecForge's Gemma-3-1B draft config with the target's vocabulary: the published file says
/// vocab_size 262145 against Gemma-3-1B's 262144, a `shape` finding of its own that would hide
/// the engine's verdict here.
fn gemma3_draft(dir: &Path) -> PathBuf {
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(real(GEMMA3_DRAFT)).unwrap()).unwrap();
    cfg["vocab_size"] = serde_json::json!(262144);
    let path = dir.join("gemma3-1b-draft.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    path
}

/// The gate on the Gemma-3 target with that draft (no ids: the engine's defaults).
fn gate_target(spec: &Path, target: &Path, engine: &str) -> crate::support::Output {
    let draft = gemma3_draft(spec.parent().unwrap());
    gate(spec, &draft, target, engine)
}

fn finding<'a>(json: &'a serde_json::Value, name: &str) -> Option<&'a serde_json::Value> {
    json["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == name)
}

const GEMMA3_DRAFT: &str = "drafts/draft_eagle3_gemma3-1b__SpecForge.json";
const GEMMA3_TARGET: &str =
    "targets/target_gemma-3-1b-it__TensorRT-LLM_test_modeling_gemma3_PATCHED_L26.json";

/// sglang 0.5.23 `gemma3_causal.py`: `Gemma3TextModel.forward` appends `hidden_states` at the
/// top of each layer while `Gemma3DecoderLayer.forward` returns `(hidden_states, residual)`
/// apart, so a Gemma-3 drafter served there gets the previous layer's branch, not the stream:
/// `missing-residual`, with the fix of a version that captures the stream. 0.5.14's layer
/// returned the sum: consistent there.
#[test]
fn gemma3_on_sglang_0_5_23_feeds_no_residual() {
    let dir = scratch("support-gemma3");
    let spec = default_spec(&dir, 26, 1152);
    let target = real(GEMMA3_TARGET);
    let out = gate_target(&spec, &target, "sglang@0.5.23");
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    let json = out.json();
    let f = finding(&json, "missing-residual").expect("a missing-residual finding");
    assert_eq!(f["severity"], "error");
    let msg = f["message"].as_str().unwrap();
    assert!(msg.contains("gemma3_causal.py"), "{msg}");
    assert!(msg.contains("`gemma3`"), "{msg}");
    // vLLM 0.33.0 / 0.34.0 have no Gemma-3 EAGLE-3 at all: the fix is the older sglang.
    assert_eq!(f["fix"], "serve it with sglang@0.5.14");
    // The newest sglang (no version named) is 0.5.23: the same verdict.
    assert_eq!(gate_target(&spec, &target, "sglang").code, 1);
    // sglang 0.5.14 `gemma3_causal.py` `Gemma3DecoderLayer.forward` adds both residuals.
    let ok = gate_target(&spec, &target, "sglang@0.5.14");
    assert_eq!(ok.code, 0, "{}\n{}", ok.stdout, ok.stderr);
}

/// sglang 0.5.10 `gemma3_causal.py` has no `set_eagle3_layers_to_capture` and
/// `model_runner.py` `ModelRunner.initialize` calls it unguarded (AttributeError); vLLM 0.33.0
/// `gemma3.py` `Gemma3ForCausalLM` does not implement `SupportsEagle3` (`eagle3_utils.py`
/// `set_eagle3_aux_hidden_state_layers` raises RuntimeError). Both are
/// `unsupported-architecture` errors naming the failure, with a version that serves it.
#[test]
fn gemma3_on_sglang_0_5_10_and_vllm_0_33_0_is_unsupported() {
    let dir = scratch("support-gemma3-unsupported");
    let spec = default_spec(&dir, 26, 1152);
    let target = real(GEMMA3_TARGET);
    for (engine, needle, fix) in [
        ("sglang@0.5.10", "AttributeError", Some("sglang@0.5.14")),
        ("vllm", "SupportsEagle3", None),
        ("vllm:v1", "SupportsEagle3", None),
    ] {
        let out = gate_target(&spec, &target, engine);
        assert_eq!(out.code, 1, "{engine}: {}\n{}", out.stdout, out.stderr);
        let json = out.json();
        let f = finding(&json, "unsupported-architecture")
            .unwrap_or_else(|| panic!("{engine}: {}", json["findings"]));
        assert_eq!(f["severity"], "error");
        let msg = f["message"].as_str().unwrap();
        assert!(msg.contains(needle) && msg.contains("`gemma3`"), "{msg}");
        if let Some(fix) = fix {
            assert!(f["fix"].as_str().unwrap().contains(fix), "{}", f["fix"]);
        }
    }
}

/// sglang 0.5.10 has no Qwen3.5 setter (`qwen3_5.py`, `qwen3_vl.py`; 0.5.14 added one, but
/// 0.5.14's `Qwen3_5ForCausalLM.forward` captures only DFlash-flagged layers, fixed in 0.5.23):
/// a Qwen3.5 deployment there is refused; 0.5.23 serves it. The target is the real
/// Qwen3.5-35B-A3B config (`qwen3_5_moe` wrapping `qwen3_5_moe_text`).
#[test]
fn qwen3_5_is_refused_on_sglang_before_0_5_23() {
    let dir = scratch("support-qwen3-5");
    let spec = default_spec(&dir, 40, 2048);
    let target = real("targets/target_qwen3.5-35b-a3b__aiconfigurator_model_configs.json");
    // SpecForge's Qwen3.5 draft (a 4B's; the gate reads its ids and vocabulary, both fit).
    let draft = real("drafts/draft_eagle3_qwen3.5-4b__SpecForge.json");
    let gate = |engine: &str| gate(&spec, &draft, &target, engine);
    for engine in ["sglang@0.5.10", "sglang@0.5.14"] {
        let out = gate(engine);
        assert_eq!(out.code, 1, "{engine}: {}\n{}", out.stdout, out.stderr);
        assert!(
            out.finding_names()
                .contains(&"unsupported-architecture".to_string()),
            "{engine}: {}",
            out.stdout
        );
        let fix = finding(&out.json(), "unsupported-architecture").unwrap()["fix"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(fix.contains("sglang@0.5.23"), "{engine}: {fix}");
    }
    let out = gate("sglang@0.5.23");
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
}

/// Gemma-4's text configs say `gemma4_text`, its wrapper `gemma4`: one family. sglang 0.5.10
/// has no gemma4 model file at all; the spec's `gemma4_text` gets that row, not the generic one.
#[test]
fn text_model_types_get_their_familys_rules() {
    let dir = scratch("support-text-types");
    let gemma4 = "num_hidden_layers: 60, hidden_size: 5376, model_type: gemma4_text";
    let spec4 = write_spec(&dir, "gemma4", Some(gemma4), [2, 30, 57], 5376);
    let gemma4_draft = real("drafts/draft_eagle3_gemma4-26b-a4b__SpecForge.json");
    let out = gate_draft(&spec4, &gemma4_draft, "sglang@0.5.10");
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    let msg = message(&out, "unsupported-architecture");
    assert!(msg.contains("no Gemma-4 model file"), "{msg}");
    // The real Gemma-4 wrapper config (model_type gemma4, text_config gemma4_text) too, and
    // no note says the generic rule was applied.
    let target = real("targets/target_gemma-4-31b-it-nvfp4__aiconfigurator_model_configs.json");
    let spec = default_spec(&dir, 60, 5376);
    for engine in ["sglang@0.5.10", "sglang@0.5.23"] {
        let out = gate(&spec, &gemma4_draft, &target, engine);
        let names = out.finding_names();
        assert_eq!(
            names.contains(&"unsupported-architecture".to_string()),
            engine == "sglang@0.5.10",
            "{engine}: {}",
            out.stdout
        );
    }
    // gemma3_text targets get sglang 0.5.23's gemma3 row (the branch capture), not the generic.
    let gemma3 = "num_hidden_layers: 26, hidden_size: 1152, model_type: gemma3_text";
    let spec3 = write_spec(&dir, "gemma3", Some(gemma3), [2, 13, 23], 1152);
    let out = gate_draft(&spec3, &gemma3_draft(&dir), "sglang@0.5.23");
    assert!(
        out.finding_names()
            .contains(&"missing-residual".to_string()),
        "{}",
        out.stdout
    );
    assert!(!out.stdout.contains("no rule of its own"), "{}", out.stdout);
}

/// The draft config's own `target_model_type` (SpecForge writes it) names the family when no
/// target is given: the Gemma-3 drafter alone, with a spec of L and H only, gets gemma3's rows.
#[test]
fn the_drafts_target_model_type_names_the_family() {
    let dir = scratch("support-target-model-type");
    let dims = "num_hidden_layers: 26, hidden_size: 1152";
    let spec = write_spec(&dir, "gemma3-dims", Some(dims), [2, 13, 23], 1152);
    let out = gate_draft(&spec, &real(GEMMA3_DRAFT), "vllm");
    assert!(
        out.finding_names()
            .contains(&"unsupported-architecture".to_string()),
        "{}",
        out.stdout
    );
}

/// SpecForge's Qwen2.5-VL-7B draft config (`rope_scaling: {type: mrope, ...}`) against the
/// real Qwen2.5-VL-7B target config: the gate needs no rope and the config gates (it was
/// refused with "rope type `mrope` is not supported").
#[test]
fn the_qwen2_5_vl_draft_config_gates() {
    let dir = scratch("support-qwen2-5-vl");
    let spec = default_spec(&dir, 28, 3584);
    let draft = real("drafts/draft_eagle3_qwen2.5-vl-7b__SpecForge.json");
    let target = real("targets/target_qwen2.5-vl-7b-instruct__tt-metal_model_params.json");
    for engine in ["sglang", "sglang@0.5.10", "vllm"] {
        let out = gate(&spec, &draft, &target, engine);
        assert_eq!(out.code, 0, "{engine}: {}\n{}", out.stdout, out.stderr);
    }
}

/// Every real draft and target config we hold reads (the gate needs only L, H, the ids and the
/// family): unknown rope types, vision settings, MoE keys of other families and `null`s are no
/// reason to refuse.
#[test]
fn every_real_config_reads() {
    for sub in ["drafts", "targets", ""] {
        let dir = real(sub);
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            if name.starts_with("draft_") {
                eagle_check::config::DraftConfig::load(&path)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
            } else {
                let t = eagle_check::config::TargetInfo::load(&path)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                assert!(!t.family.name.ends_with("_text"), "{name}");
            }
        }
    }
}

/// transformers writes `"architectures": null` for a config built in code and reads it back;
/// it was refused as "not valid JSON".
#[test]
fn a_null_architectures_list_reads_as_none() {
    let dir = scratch("support-null-arch");
    let src = fixture("models/llama/config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src).unwrap()).unwrap();
    cfg["architectures"] = serde_json::Value::Null;
    let path = dir.join("config.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let t = eagle_check::config::TargetInfo::load(&path).unwrap();
    assert_eq!(t.family.name, "llama");
    assert_eq!(t.family.class, None);
    eagle_check::config::ModelConfig::load(&path).unwrap();
}

/// A target checkpoint the runner cannot read is bad input (exit 2, one line naming the
/// checkpoint and the contradiction), not a `shape` layout mismatch (exit 1): a config whose
/// hidden size the weights contradict, and a checkpoint without `embed_tokens`.
#[test]
fn an_unreadable_target_checkpoint_is_exit_2() {
    let dir = scratch("support-bad-checkpoint");
    let plain = fixture("models/llama");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(plain.join("config.json")).unwrap()).unwrap();
    let h = cfg["hidden_size"].as_u64().unwrap();
    cfg["hidden_size"] = serde_json::json!(h * 2);
    let wide = dir.join("wide");
    std::fs::create_dir_all(&wide).unwrap();
    std::fs::write(wide.join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(
        plain.join("model.safetensors"),
        wide.join("model.safetensors"),
    )
    .unwrap();
    let spec = fixture("bundles/tiny-llama/spec.yaml");
    let draft = fixture("bundles/tiny-llama/draft");
    let gate = |target: &Path| {
        eagle_check([
            "gate",
            "--spec",
            &p(&spec),
            "--draft",
            &p(&draft),
            "--target",
            &p(target),
        ])
    };
    gate(&wide).assert_could_not_check(&["embed_tokens.weight", "wide"]);

    // No decoder under any known prefix.
    let weights =
        candle_core::safetensors::load(plain.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let renamed: std::collections::HashMap<String, candle_core::Tensor> = weights
        .into_iter()
        .map(|(k, v)| (format!("transformer.{k}"), v))
        .collect();
    let odd = dir.join("odd");
    std::fs::create_dir_all(&odd).unwrap();
    std::fs::copy(plain.join("config.json"), odd.join("config.json")).unwrap();
    candle_core::safetensors::save(&renamed, odd.join("model.safetensors")).unwrap();
    gate(&odd).assert_could_not_check(&["no embed_tokens.weight", "odd"]);
}

/// sglang (every audited version) registers only `LlamaForCausalLMEagle3` and, from 0.5.14,
/// `Eagle3DeepseekV2ForCausalLM` as EAGLE-3 drafts, and reads no speculators-format config;
/// vLLM 0.33.0 prefixes `Eagle3` and looks the name up in its registry. A draft the engine
/// cannot load is `unsupported-draft`.
#[test]
fn drafts_an_engine_cannot_load_are_named() {
    let dir = scratch("support-drafts");
    let spec = default_spec(&dir, 24, 2880);
    let target = real("targets/target_gpt-oss-20b__aiconfigurator_model_configs.json");
    // SpecForge's gpt-oss draft says GptOssForCausalLMEagle3: neither engine registers it.
    let draft = real("drafts/draft_eagle3_gpt-oss-20b__SpecForge.json");
    for engine in ["sglang", "vllm"] {
        let out = gate(&spec, &draft, &target, engine);
        assert_eq!(out.code, 1, "{engine}: {}", out.stdout);
        let f = finding(&out.json(), "unsupported-draft")
            .cloned()
            .unwrap_or_else(|| panic!("{engine}: {}", out.stdout));
        assert!(
            f["message"]
                .as_str()
                .unwrap()
                .contains("GptOssForCausalLMEagle3"),
            "{f}"
        );
    }
    // The EAGLE reference's LlamaForCausalLM draft: vLLM renames it Eagle3LlamaForCausalLM,
    // sglang loads it as a plain target class.
    let reference = real("draft_eagle3_llama3.1-8b__SafeAILab-EAGLE_traineagle3.json");
    let spec = default_spec(&dir, 32, 4096);
    let llama =
        real("target_llama-3.1-8b__TensorRT-LLM_test_modeling_llama_LLAMA_3_1_8B_CONFIG.json");
    let names = |engine: &str| gate(&spec, &reference, &llama, engine).finding_names();
    assert!(names("sglang").contains(&"unsupported-draft".to_string()));
    assert!(!names("vllm").contains(&"unsupported-draft".to_string()));
    // A SpecForge LlamaForCausalLMEagle3 draft loads on both.
    let specforge = real("draft_eagle3_llama3.1-8b__SpecForge.json");
    for engine in ["sglang", "vllm"] {
        let out = gate(&spec, &specforge, &llama, engine);
        assert!(
            !out.finding_names()
                .contains(&"unsupported-draft".to_string()),
            "{engine}: {}",
            out.stdout
        );
    }
}

/// A spec's `target.model_type` may name the family or the text model's own `model_type`:
/// Kimi-K2.5's config is the `kimi_k25` wrapper around a `kimi_k2` text model, and a spec
/// written for either is the same target; one written for `llama` is not.
#[test]
fn a_spec_names_its_target_by_family_or_text_model_type() {
    let dir = scratch("support-spec-model-type");
    let target = real("targets/target_kimi-k2.5__aiconfigurator_model_configs.json");
    let draft = real("draft_eagle3_kimi-k2.5-mla__TorchSpec.json");
    let written_for = |m: &str| {
        let dims = format!("num_hidden_layers: 61, hidden_size: 7168, model_type: {m}");
        let spec = write_spec(&dir, m, Some(&dims), [2, 30, 58], 7168);
        gate(&spec, &draft, &target, "sglang").stdout
    };
    for m in ["kimi_k25", "kimi_k2"] {
        let out = written_for(m);
        assert!(!out.contains("the spec was written for"), "{m}: {out}");
    }
    assert!(written_for("llama").contains("the spec was written for a `llama` target"));
}
