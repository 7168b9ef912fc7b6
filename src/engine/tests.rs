//! One test per audited rule: each names the upstream file and version it encodes (the facts
//! with line numbers are in fixtures/engines/FACTS.md) and fails if the row changes meaning.

use super::*;

fn feed(engine: &str, arch: Option<&str>, ids: Option<&[i64]>, l: usize) -> Feed {
    let sel = EngineSel::parse(engine).unwrap();
    let ids = ids.map_or_else(DraftIds::default, DraftIds::nested);
    resolve(&sel, arch, &ids, l)
}

fn fed(f: &Feed) -> Vec<usize> {
    f.slots.iter().map(|s| s.boundary.0).collect()
}

fn refused(f: &Feed) -> bool {
    f.how == How::Refused
        && f.problems
            .iter()
            .any(|p| matches!(p, IdProblem::Refused { .. }))
}

/// The engine version cannot serve the architecture at all.
fn unsupported(f: &Feed) -> bool {
    f.how == How::Refused
        && f.problems
            .iter()
            .any(|p| matches!(p, IdProblem::Unsupported { .. }))
}

fn dropped(f: &Feed) -> Vec<i64> {
    f.problems
        .iter()
        .filter_map(|p| match p {
            IdProblem::OutOfRange { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

/// sglang 0.5.23 sglang/srt/models/llama.py `set_eagle3_layers_to_capture` (l. 929): +1 on
/// every id, whatever the first id. A Llama drafter with ids [2, 16, 29] gets b = [3, 17, 30];
/// vLLM 0.33.0 reads the same ids raw.
#[test]
fn sglang_llama_adds_one_to_every_id_and_vllm_reads_them_raw() {
    let ids = [2, 16, 29];
    assert_eq!(
        fed(&feed("sglang", Some("llama"), Some(&ids), 32)),
        [3, 17, 30]
    );
    assert_eq!(
        fed(&feed("sglang", Some("qwen3"), Some(&ids), 32)),
        [3, 17, 30]
    );
    let vllm = resolve(
        &EngineSel::parse("vllm").unwrap(),
        Some("llama"),
        &DraftIds {
            top: Some(ids.to_vec()),
            nested: Some(ids.to_vec()),
        },
        32,
    );
    assert_eq!(fed(&vllm), [2, 16, 29]);
}

/// sglang 0.5.14 and 0.5.23 sglang/srt/models/deepseek_v2.py `set_eagle3_layers_to_capture`
/// (l. 2799 / 3458), PR 25454: +1 only when the first id is 1. sglang 0.5.10 (l. 2295): +1.
#[test]
fn sglang_deepseek_first_id_rule_by_version() {
    for arch in ["deepseek_v3", "kimi_k2", "kimi_k25", "glm4_moe_lite"] {
        for v in ["sglang", "sglang@0.5.14"] {
            assert_eq!(
                fed(&feed(v, Some(arch), Some(&[1, 29, 57]), 61)),
                [2, 30, 58]
            );
            assert_eq!(
                fed(&feed(v, Some(arch), Some(&[2, 30, 58]), 61)),
                [2, 30, 58]
            );
        }
    }
    assert_eq!(
        fed(&feed(
            "sglang@0.5.10",
            Some("deepseek_v3"),
            Some(&[2, 30, 58]),
            61
        )),
        [3, 31, 59]
    );
    // glm4_moe_lite inherits deepseek_v2's +1 setter in 0.5.10 (glm4_moe_lite.py has none).
    assert_eq!(
        fed(&feed(
            "sglang@0.5.10",
            Some("glm4_moe_lite"),
            Some(&[2, 30, 58]),
            61
        )),
        [3, 31, 59]
    );
}

/// sglang 0.5.23 sglang/srt/layers/aux_hidden_states.py `AuxHiddenStatePacker.finalize` (l. 84):
/// a DeepSeek forward that captures fewer states than ids raises. -1 on the raw path, an id
/// past L and a duplicate all do; in 0.5.14 (list-based) they are dropped silently.
#[test]
fn sglang_0_5_23_deepseek_raises_where_0_5_14_drops() {
    for ids in [&[-1, 2, 30][..], &[2, 30, 61], &[2, 30, 30]] {
        assert!(
            refused(&feed("sglang", Some("deepseek_v3"), Some(ids), 61)),
            "{ids:?}"
        );
    }
    let old = feed("sglang@0.5.14", Some("deepseek_v3"), Some(&[-1, 2, 30]), 61);
    assert_eq!(fed(&old), [2, 30]);
    assert_eq!(dropped(&old), [-1]);
    // glm4_moe_lite keeps its own list-based forward: silent.
    assert_eq!(
        fed(&feed(
            "sglang",
            Some("glm4_moe_lite"),
            Some(&[-1, 2, 30]),
            61
        )),
        [2, 30]
    );
}

/// b = 0 by version and model (FACTS.md 1.3): 0.5.10/0.5.14 crash on llama's `residual is None`
/// at layer 0; qwen2/qwen3 guard it (qwen2.py `Qwen2Model.forward`); 0.5.23 captures it
/// everywhere (layer_boundary/stage.py); deepseek_v2 0.5.14 captures it through the
/// communicator.
#[test]
fn the_embedding_slot_depends_on_version_and_model() {
    let minus_one = Some(&[-1i64, 2, 30][..]);
    assert!(refused(&feed(
        "sglang@0.5.10",
        Some("llama"),
        minus_one,
        61
    )));
    assert!(refused(&feed(
        "sglang@0.5.14",
        Some("llama"),
        minus_one,
        61
    )));
    assert_eq!(
        fed(&feed("sglang", Some("llama"), minus_one, 61)),
        [0, 3, 31]
    );
    assert_eq!(
        fed(&feed("sglang@0.5.10", Some("qwen3"), minus_one, 61)),
        [0, 3, 31]
    );
    assert!(refused(&feed(
        "sglang@0.5.10",
        Some("deepseek_v3"),
        minus_one,
        61
    )));
    assert_eq!(
        fed(&feed(
            "sglang@0.5.14",
            Some("deepseek_v3"),
            Some(&[0, 2, 30]),
            61
        )),
        [0, 2, 30]
    );
}

/// sglang 0.5.23 sglang/srt/models/gpt_oss.py `set_eagle3_layers_to_capture` (l. 1337): raw when
/// max(ids) == L, b = L captured pre-norm; 0.5.14 (l. 1273) adds 1 to every id.
#[test]
fn sglang_gpt_oss_reads_boundaries_when_the_last_id_is_l() {
    let new = feed("sglang", Some("gpt_oss"), Some(&[24, 30, 36]), 36);
    assert_eq!(fed(&new), [24, 30, 36]);
    assert_eq!(new.slots[2].norm, Some(FinalNorm::Pre));
    assert_eq!(
        fed(&feed("sglang", Some("gpt_oss"), Some(&[23, 29, 35]), 36)),
        [24, 30, 36]
    );
    let old = feed("sglang@0.5.14", Some("gpt_oss"), Some(&[24, 30, 36]), 36);
    assert_eq!(fed(&old), [25, 31]);
    assert_eq!(dropped(&old), [36]);
}

/// sglang sglang/srt/models/qwen2_moe.py `Qwen2MoeModel.set_eagle3_layers_to_capture`
/// (0.5.23 l. 1153): tags `self.layers[b]`, so b = L raises IndexError and a negative b wraps.
#[test]
fn sglang_qwen_moe_indexes_its_layer_list() {
    assert!(refused(&feed(
        "sglang",
        Some("qwen3_moe"),
        Some(&[1, 20, 47]),
        48
    )));
    assert_eq!(
        fed(&feed("sglang", Some("qwen3_moe"), Some(&[-2, 1, 20]), 48)),
        [2, 21, 47]
    );
}

/// sglang 0.5.23 attention_backend_setup.py `configure_aux_hidden_state_capture`: DeepSeek-V4
/// has no EAGLE-3 setter and sglang raises.
#[test]
fn sglang_refuses_eagle3_on_deepseek_v4() {
    assert!(unsupported(&feed(
        "sglang",
        Some("deepseek_v4"),
        Some(&[1, 2, 3]),
        61
    )));
    assert!(unsupported(&feed("sglang", Some("deepseek_v4"), None, 61)));
    assert!(!refused(&feed("sglang", Some("deepseek_v4"), None, 61)));
}

/// sglang 0.5.10 `gemma3_causal.py`, `qwen3_vl.py`, `qwen3_5.py` have no
/// `set_eagle3_layers_to_capture` (`model_runner.py` `ModelRunner.initialize` calls it
/// unguarded); 0.5.10 has no gemma4 model file. 0.5.14 adds the gemma3 and Qwen3-VL setters;
/// 0.5.14's Qwen3.5 captures nothing (`qwen3_5.py` `Qwen3_5ForCausalLM.forward`), 0.5.23's does.
/// Every `*_text` spelling is its family.
#[test]
fn sglang_versions_that_cannot_serve_an_architecture() {
    for arch in [
        "gemma3",
        "gemma3_text",
        "gemma4_text",
        "qwen3_vl",
        "qwen3_5_moe_text",
    ] {
        assert!(
            unsupported(&feed("sglang@0.5.10", Some(arch), Some(&[1, 5, 9]), 12)),
            "{arch}"
        );
        assert!(
            !unsupported(&feed("sglang@0.5.23", Some(arch), Some(&[1, 5, 9]), 12)),
            "{arch}"
        );
    }
    assert!(!unsupported(&feed(
        "sglang@0.5.14",
        Some("gemma3_text"),
        None,
        12
    )));
    assert!(unsupported(&feed(
        "sglang@0.5.14",
        Some("qwen3_5"),
        None,
        12
    )));
    for arch in ["mistral3", "exaone4", "minicpmv"] {
        for v in ["0.5.10", "0.5.14", "0.5.23"] {
            assert!(
                unsupported(&feed(&format!("sglang@{v}"), Some(arch), None, 12)),
                "{arch} {v}"
            );
        }
    }
}

/// sglang 0.5.23 `gemma3_causal.py`: `Gemma3TextModel.forward` appends `hidden_states` while
/// `Gemma3DecoderLayer.forward` keeps the residual apart. The ids map as for llama; what the
/// slots hold is the branch. 0.5.14 captured the stream.
#[test]
fn sglang_0_5_23_gemma3_captures_the_branch() {
    let f = feed("sglang@0.5.23", Some("gemma3_text"), Some(&[1, 12, 22]), 26);
    assert_eq!(fed(&f), [2, 13, 23]);
    assert!(matches!(f.rule.captures, rules::Capture::Branch(_)));
    let f = feed("sglang@0.5.14", Some("gemma3_text"), Some(&[1, 12, 22]), 26);
    assert_eq!(f.rule.captures, rules::Capture::Residual);
    let f = feed("sglang@0.5.23", Some("llama"), Some(&[1, 12, 22]), 26);
    assert_eq!(f.rule.captures, rules::Capture::Residual);
}

/// vLLM 0.33.0: `Gemma3ForCausalLM`, `Glm4MoeForCausalLM`, `BailingMoeV2ForCausalLM`,
/// `LongcatFlashForCausalLM`, `Qwen2MoeForCausalLM` do not implement `SupportsEagle3`
/// (`eagle3_utils.py` `set_eagle3_aux_hidden_state_layers` raises RuntimeError), on every
/// capture path; `mimo.py` declares it and never captures. Llama-4, Gemma-4, Qwen3-MoE serve.
#[test]
fn vllm_targets_without_supports_eagle3() {
    for arch in [
        "gemma3_text",
        "glm4_moe",
        "bailing_moe_v2",
        "longcat_flash",
        "qwen2_moe",
        "mimo",
    ] {
        for engine in ["vllm", "vllm:v1", "vllm:extract"] {
            assert!(
                unsupported(&feed(engine, Some(arch), Some(&[2, 5, 9]), 12)),
                "{engine} {arch}"
            );
        }
    }
    for arch in [
        "llama4_text",
        "gemma4",
        "qwen3_moe",
        "gpt_oss",
        "minimax_m2",
    ] {
        assert!(
            !unsupported(&feed("vllm", Some(arch), Some(&[2, 5, 9]), 12)),
            "{arch}"
        );
    }
}

/// vLLM 0.33.0 `models/deepseek_v32/nvidia/model.py` `DeepseekV32Model.forward`: id 0 is the
/// embedding (it works, unlike `deepseek_v2.py`), id L is never captured, and a note says what
/// the capture holds at tensor parallelism above 1.
#[test]
fn vllm_deepseek_v32_captures_b_0_and_drops_b_l() {
    // The V1 runner reads the nested ids `feed` writes.
    let f = feed("vllm:v1", Some("deepseek_v32"), Some(&[0, 30, 61]), 61);
    assert_eq!(fed(&f), [0, 30]);
    assert_eq!(dropped(&f), [61]);
    assert!(
        f.notes.iter().any(|n| n.contains("tensor parallelism")),
        "{:?}",
        f.notes
    );
    let f = feed("vllm:v1", Some("deepseek_v3"), Some(&[0, 30, 61]), 61);
    assert!(refused(&f));
}

/// A fix for an unsupported deployment names the first version of the same engine that serves
/// it, then the other serving engines that do.
#[test]
fn alternatives_name_the_first_version_that_serves() {
    let sel = EngineSel::parse("sglang@0.5.10").unwrap();
    assert_eq!(
        serving_alternatives(&sel, Some("gemma3_text")),
        ["sglang@0.5.14"]
    );
    let sel = EngineSel::parse("vllm").unwrap();
    assert_eq!(
        serving_alternatives(&sel, Some("gemma3")),
        ["sglang@0.5.14"]
    );
    let sel = EngineSel::parse("sglang").unwrap();
    assert_eq!(
        serving_alternatives(&sel, Some("gemma3")),
        ["sglang@0.5.14"]
    );
    let sel = EngineSel::parse("vllm").unwrap();
    assert_eq!(
        serving_alternatives(&sel, Some("glm4_moe")),
        ["sglang@0.5.23"]
    );
    let sel = EngineSel::parse("sglang@0.5.10").unwrap();
    assert_eq!(
        serving_alternatives(&sel, Some("qwen3_5_moe")),
        ["sglang@0.5.23", "vllm@0.34.0"]
    );
}

/// sglang (every version) reads only `eagle_config.eagle_aux_hidden_state_layer_ids`
/// (0.5.23 spec_aux_hidden_state.py `_resolve_eagle_aux_hidden_state`): a top-level list is
/// ignored and the default used. vLLM 0.33.0's V2 runner (eagle3_utils.py
/// `get_eagle3_aux_layers_from_config`, the default runner) reads only the top level; its V1
/// runner (gpu_model_runner.py `_get_eagle3_aux_layers_from_config`) the top level, then the
/// nested key.
#[test]
fn where_the_ids_are_read() {
    let top = DraftIds {
        top: Some(vec![4, 16, 28]),
        nested: None,
    };
    let nested = DraftIds::nested(&[4, 16, 28]);
    let at = |engine: &str, ids: &DraftIds| {
        resolve(&EngineSel::parse(engine).unwrap(), Some("llama"), ids, 32)
    };
    let sg = at("sglang", &top);
    assert_eq!(sg.how, How::DefaultFallback);
    assert_eq!(fed(&sg), [2, 16, 29]);
    assert!(matches!(sg.problems[0], IdProblem::NotRead { .. }));
    let v2 = at("vllm", &nested);
    assert_eq!(v2.how, How::DefaultFallback);
    assert!(matches!(v2.problems[0], IdProblem::NotRead { .. }));
    assert_eq!(fed(&at("vllm:v1", &nested)), [4, 16, 28]);
    assert_eq!(fed(&at("vllm", &top)), [4, 16, 28]);
    // extract_hidden_states requires the top-level key.
    assert!(refused(&at("vllm:extract", &nested)));
}

/// vLLM 0.33.0 interfaces.py `EagleModelMixin._set_aux_hidden_state_layers` (l. 1616): sorted
/// and de-duplicated; llama.py: index 0 is the embedding, index L the pre-norm final state,
/// -1 never matches. deepseek_v2.py `DeepseekV2Model.forward`: id 0 crashes, id L is captured by
/// the end_layer check.
#[test]
fn vllm_capture_edges() {
    let top = |ids: &[i64]| DraftIds {
        top: Some(ids.to_vec()),
        nested: None,
    };
    let sel = EngineSel::parse("vllm").unwrap();
    let f = resolve(&sel, Some("llama"), &top(&[32, 0, 16, 16, -1]), 32);
    assert_eq!(fed(&f), [0, 16, 32]);
    assert_eq!(f.slots[2].norm, Some(FinalNorm::Pre));
    assert_eq!(dropped(&f), [-1]);
    assert!(refused(&resolve(
        &sel,
        Some("deepseek_v3"),
        &top(&[0, 30, 58]),
        61
    )));
    let ds = resolve(&sel, Some("deepseek_v3"), &top(&[2, 30, 61]), 61);
    assert_eq!(fed(&ds), [2, 30, 61]);
    assert_eq!(ds.slots[2].norm, Some(FinalNorm::Pre));
}

/// TensorRT-LLM at f933a608 tensorrt_llm/_torch/speculative/eagle3.py: b = id + 1 (capture
/// after the layer's MLP), -1 the post-norm final state; the one-model path
/// (`Eagle3OneModelSpecMetadata.__post_init__`, the default) sorts so -1 lands in slot 0, the
/// two-model path (`Eagle3SpecMetadata.__post_init__`) moves a leading -1 last; the default
/// raises for L <= 5; the ids come from `EagleDecodingConfig`, not the draft config.
#[test]
fn trtllm_paths_order_minus_one_differently() {
    let one = feed("trtllm", None, Some(&[-1, 2, 30]), 61);
    assert_eq!(fed(&one), [61, 3, 31]);
    assert_eq!(one.slots[0].norm, Some(FinalNorm::Post));
    let two = feed("trtllm:two-model", None, Some(&[-1, 2, 30]), 61);
    assert_eq!(fed(&two), [3, 31, 61]);
    assert!(
        one.problems
            .iter()
            .any(|p| matches!(p, IdProblem::NotRead { .. }))
    );
    assert!(one.notes.iter().any(|n| n.contains("capture site")));
    let pre = feed("trtllm", None, Some(&[1, 29, 60]), 61);
    assert_eq!(pre.slots[2].norm, Some(FinalNorm::Pre));
    assert!(refused(&feed("trtllm", None, None, 5)));
    assert_eq!(fed(&feed("trtllm", None, None, 6)), [2, 3]);
}

/// SpecForge a6b6b023: `resolve_eagle_capture_layers` then, offline, `resolve_offline_capture`
/// (3 distinct ids in 0..L) or, online, `resolve_server_capture_contract` (3 unique ids >= 0);
/// capture through sglang 0.5.14's per-model setter.
#[test]
fn specforge_checks_then_uses_sglang_0_5_14() {
    assert_eq!(
        fed(&feed(
            "specforge",
            Some("deepseek_v3"),
            Some(&[1, 29, 57]),
            61
        )),
        [2, 30, 58]
    );
    assert_eq!(
        fed(&feed(
            "specforge",
            Some("deepseek_v3"),
            Some(&[2, 30, 58]),
            61
        )),
        [2, 30, 58]
    );
    assert_eq!(
        fed(&feed("specforge", Some("llama"), Some(&[2, 30, 58]), 61)),
        [3, 31, 59]
    );
    for ids in [&[2, 2, 30][..], &[1, 29, 61], &[-1, 2, 30], &[1, 2]] {
        assert!(
            refused(&feed("specforge", Some("llama"), Some(ids), 61)),
            "{ids:?}"
        );
    }
    // Online there is no < L check: id 61 asks for b = 62 and sglang drops it.
    let online = feed("specforge:online", Some("llama"), Some(&[1, 29, 61]), 61);
    assert_eq!(fed(&online), [2, 30]);
    // The default is checked too: L = 5 gives [1, 1, 1].
    assert!(refused(&feed("specforge", Some("llama"), None, 5)));
}

/// SafeAILab EAGLE cb7e0841 eagle/traineagle3/modeling_llama_kv.py: the inputs of layers
/// {2, L//2, L-3}, config ignored; cnets.py `dataprepare` needs three distinct states.
#[test]
fn eagle_hard_codes_its_layers() {
    let f = feed("eagle", None, Some(&[5, 6, 7]), 32);
    assert_eq!(f.how, How::HardCoded);
    assert_eq!(fed(&f), [2, 16, 29]);
    assert_eq!(fed(&feed("eagle", None, None, 3)), [0, 1, 2]);
    assert!(refused(&feed("eagle", None, None, 4)));
}

/// Model-Optimizer a2fbac7b collect_hidden_states: HF dump `hidden_states[id + 1]` with
/// 0 <= id < L (common.py `resolve_aux_layers`), sorted, de-duplicated, default
/// sorted({1, max(0, L//2-1), max(0, L-4)}) (hf_eagle.py `default_eagle_aux_layer_ids`);
/// the vLLM dump passes [*ids, L] raw and stores L as the target, with no default.
#[test]
fn modelopt_dumps() {
    assert!(refused(&feed("modelopt", None, Some(&[-1, 2, 30]), 61)));
    assert_eq!(
        fed(&feed("modelopt", None, Some(&[29, 1, 57]), 61)),
        [2, 30, 58]
    );
    let last = feed("modelopt", None, Some(&[1, 29, 60]), 61);
    assert_eq!(last.slots[2].norm, Some(FinalNorm::Post));
    assert_eq!(fed(&feed("modelopt", None, None, 4)), [1, 2]);
    let vllm = feed("modelopt:vllm", None, Some(&[2, 30, 58]), 61);
    assert_eq!(fed(&vllm), [2, 30, 58]);
    assert_eq!(
        vllm.target.map(|t| (t.boundary.0, t.norm)),
        Some((61, Some(FinalNorm::Pre)))
    );
    assert!(refused(&feed("modelopt:vllm", None, None, 61)));
}

/// speculators 0.9.0 scripts/launch_vllm.py: default [2, L//2, L-3, L], L appended to custom
/// ids; the trainer (data.py `_get_raw_data`) takes the last slot as the target and
/// (utils.py `resolve_target_layer_ids`) refuses negative or repeated ids.
#[test]
fn speculators_keeps_the_last_slot_as_the_target() {
    let d = feed("speculators", None, None, 32);
    assert_eq!(fed(&d), [2, 16, 29]);
    assert_eq!(d.target.map(|t| t.boundary.0), Some(32));
    // An id equal to L is not added twice; it becomes the target and fc loses a slot.
    assert_eq!(
        fed(&feed("speculators", None, Some(&[2, 16, 32]), 32)),
        [2, 16]
    );
    assert!(refused(&feed("speculators", None, Some(&[-1, 2, 16]), 32)));
}

#[test]
fn versions_pick_bands_and_say_so() {
    let sel = EngineSel::parse("sglang@0.5.12").unwrap();
    let s = select(&sel, Some("llama"));
    assert_eq!(s.rule.read, "0.5.10");
    assert!(
        s.notes[0].contains("0.5.12 was not audited"),
        "{:?}",
        s.notes
    );
    assert_eq!(
        EngineSel::parse("sglang-legacy").unwrap().version,
        Some(Version([0, 5, 10]))
    );
    assert!(EngineSel::parse("vllm:v3").unwrap_err().contains("v1"));
    assert!(
        EngineSel::parse("tgi")
            .unwrap_err()
            .contains("unknown engine `tgi`")
    );
    assert!(select(&EngineSel::parse("sglang").unwrap(), None).notes[0].contains("unknown"));
    assert!(
        select(&EngineSel::parse("sglang").unwrap(), Some("llama"))
            .notes
            .is_empty()
    );
}

#[test]
fn every_band_has_a_generic_rule() {
    for engine in Engine::ALL {
        for path in engine.paths() {
            for v in engine.versions() {
                let rows: Vec<&Rule> = RULES
                    .iter()
                    .filter(|r| r.engine == engine && r.path == path && r.since == v)
                    .collect();
                if !rows.is_empty() {
                    assert!(
                        rows.iter().any(|r| r.archs.is_empty()),
                        "{engine}:{path}@{v} has no generic row"
                    );
                }
            }
        }
    }
}

#[test]
fn fixes_round_trip_through_each_rule() {
    let want = |v: &[usize]| -> Vec<Want> { v.iter().map(|&b| (Boundary(b), None)).collect() };
    let fix = |engine: &str, arch: Option<&str>, w: &[Want], l: usize| {
        ids_for(&EngineSel::parse(engine).unwrap(), arch, w, l).map(|x| x.0)
    };
    assert_eq!(
        fix("vllm", None, &want(&[2, 30, 58]), 61),
        Some(vec![2, 30, 58])
    );
    assert_eq!(
        fix("sglang", Some("llama"), &want(&[2, 30, 58]), 61),
        Some(vec![1, 29, 57])
    );
    assert_eq!(fix("eagle", None, &want(&[2, 30, 58]), 61), None);
    // PR 25454's rule cannot feed b = 1 first: id 0 stays raw (b = 0), id 1 turns on the +1.
    assert_eq!(
        fix("sglang", Some("deepseek_v3"), &want(&[1, 5, 9]), 61),
        None
    );
    // No sorting engine feeds a descending order.
    assert_eq!(fix("vllm", None, &want(&[30, 2, 58]), 61), None);
    // TensorRT-LLM: the post-norm final state is -1, which sorts first on the one-model path.
    let post = [
        (Boundary(61), Some(FinalNorm::Post)),
        (Boundary(3), None),
        (Boundary(31), None),
    ];
    assert_eq!(fix("trtllm", None, &post, 61), Some(vec![-1, 2, 30]));
    for (engine, arch) in [
        ("sglang", Some("llama")),
        ("sglang", Some("deepseek_v3")),
        ("sglang@0.5.10", None),
        ("vllm", None),
        ("trtllm", None),
        ("modelopt", None),
    ] {
        let w = want(&[3, 17, 30]);
        let (ids, _) = ids_for(&EngineSel::parse(engine).unwrap(), arch, &w, 32).unwrap();
        let both = DraftIds {
            top: Some(ids.clone()),
            nested: Some(ids),
        };
        let back = resolve(&EngineSel::parse(engine).unwrap(), arch, &both, 32);
        assert_eq!(fed(&back), [3, 17, 30], "{engine}");
    }
}

/// sglang 0.5.10's CUDA-graph caveat (cuda_graph_runner.py `CudaGraphRunner.__init__`, recorded
/// after the default layers are set and before the explicit ids) concerns explicit ids only: a
/// drafter that leaves the default gets no such note; TensorRT-LLM's -1 caveat needs a -1.
#[test]
fn caveats_are_noted_only_where_they_apply() {
    let cuda_graph = |f: &Feed| f.notes.iter().any(|n| n.contains("CUDA graphs"));
    let explicit = feed("sglang@0.5.10", Some("llama"), Some(&[2, 16, 29]), 32);
    assert_eq!(explicit.how, How::Explicit);
    assert!(cuda_graph(&explicit), "{:?}", explicit.notes);
    let default = feed("sglang@0.5.10", Some("llama"), None, 32);
    assert_ne!(default.how, How::Explicit);
    assert!(!cuda_graph(&default), "{:?}", default.notes);
    let minus_one = |f: &Feed| f.notes.iter().any(|n| n.contains("post-norm final state"));
    assert!(minus_one(&feed(
        "trtllm",
        Some("llama"),
        Some(&[-1, 2, 16]),
        32
    )));
    assert!(!minus_one(&feed(
        "trtllm",
        Some("llama"),
        Some(&[1, 2, 16]),
        32
    )));
}

/// A fix at b = L must land on the wanted side of the final norm: TensorRT-LLM captures the
/// last layer's output (pre-norm) for id L-1 and the post-norm output for -1, which its sort
/// puts first. A post-norm b = L wanted last cannot be produced (id L-1 would feed the pre-norm
/// state there), so no ids are offered; wanted first, -1 is; no side asked for, either will do.
#[test]
fn fixes_at_the_last_boundary_keep_their_side_of_the_norm() {
    let sel = EngineSel::parse("trtllm").unwrap();
    let l = 32;
    let at = |b: usize, side: Option<FinalNorm>| (Boundary(b), side);
    let post_last = [at(2, None), at(16, None), at(l, Some(FinalNorm::Post))];
    assert_eq!(ids_for(&sel, Some("llama"), &post_last, l), None);
    let pre_last = [at(2, None), at(16, None), at(l, Some(FinalNorm::Pre))];
    assert_eq!(
        ids_for(&sel, Some("llama"), &pre_last, l).map(|(ids, _)| ids),
        Some(vec![1, 15, 31])
    );
    // No side asked for at b = L: either side will do.
    let any_last = [at(2, None), at(16, None), at(l, None)];
    assert_eq!(
        ids_for(&sel, Some("llama"), &any_last, l).map(|(ids, _)| ids),
        Some(vec![1, 15, 31])
    );
    let post_first = [at(l, Some(FinalNorm::Post)), at(2, None), at(16, None)];
    assert_eq!(
        ids_for(&sel, Some("llama"), &post_first, l).map(|(ids, _)| ids),
        Some(vec![-1, 1, 15])
    );
}

/// When two id lists feed the same boundaries (sglang's deepseek_v2.py adds 1 only when the
/// first id is 1, so [1, 29, 57] and [2, 30, 58] both feed b = [2, 30, 58]), the fix offered
/// is the layer-output form (b - 1) that the published DeepSeek drafter configs use and that
/// sglang 0.5.10's unconditional +1 also reads right; on a raw engine the raw ids.
#[test]
fn fixes_prefer_layer_output_ids_when_several_lists_work() {
    let want: Vec<Want> = [2, 30, 58].map(|b| (Boundary(b), None)).to_vec();
    let ids = |engine: &str| {
        let sel = EngineSel::parse(engine).unwrap();
        ids_for(&sel, Some("deepseek_v3"), &want, 61).map(|(ids, _)| ids)
    };
    assert_eq!(ids("sglang"), Some(vec![1, 29, 57]));
    assert_eq!(ids("sglang@0.5.10"), Some(vec![1, 29, 57]));
    assert_eq!(ids("vllm"), Some(vec![2, 30, 58]));
}

/// vLLM 0.34.0 deleted the V1 runner (`platforms/interface.py` `Platform.validate_environ`
/// refuses VLLM_USE_V2_MODEL_RUNNER=0): `vllm:v1@0.34.0` is refused, `vllm:v1` alone is the
/// last release that has it (0.33.0) and says so; the default path is 0.34.0's V2.
#[test]
fn vllm_0_34_0_has_no_v1_runner() {
    let ids = [2, 5, 9];
    let f = feed("vllm:v1@0.34.0", Some("llama"), Some(&ids), 12);
    assert!(unsupported(&f));
    let f = feed("vllm:v1", Some("llama"), Some(&ids), 12);
    assert_eq!(f.rule.since, Version([0, 33, 0]));
    assert!(
        f.notes.iter().any(|n| n.contains("removed the V1")),
        "{:?}",
        f.notes
    );
    assert_eq!(fed(&f), [2, 5, 9]);
    let f = feed("vllm", Some("llama"), Some(&ids), 12);
    assert_eq!(f.rule.since, Version([0, 34, 0]));
    assert!(
        !f.notes.iter().any(|n| n.contains("no `v2` path")),
        "{:?}",
        f.notes
    );
}

/// vLLM 0.34.0 serves Gemma 1 on the Transformers backend (`registry.py`; `transformers/base.py`
/// has no state before layer 0); 0.33.0's `gemma.py` had no `SupportsEagle3`.
#[test]
fn vllm_0_34_0_serves_gemma_1_on_the_transformers_backend() {
    assert!(unsupported(&feed(
        "vllm:v1@0.33.0",
        Some("gemma"),
        Some(&[2, 5, 9]),
        12
    )));
    let f = feed("vllm@0.34.0", Some("gemma"), None, 12);
    assert!(!unsupported(&f));
    assert_eq!(fed(&f), [2, 6, 9]);
    let f = feed("vllm:extract@0.34.0", Some("gemma"), None, 12);
    assert!(refused(&f), "extract needs ids");
    assert!(unsupported(&feed("vllm@0.34.0", Some("gemma3"), None, 12)));
}

/// What b = 0 and b = L reach on sglang, per model file (FACTS.md round 2): Gemma-3 (0.5.14) and
/// Gemma-4 append the layer input, the whole stream (b = 0 the scaled embedding), and the
/// pre-norm stream after the loop; Qwen3-Next (0.5.10, 0.5.14) and MiniMax-M2 (0.5.14) capture
/// through the communicator, which holds the input at layer 0; the model-level sum crashes at
/// b = 0 (MiniMax-M2 in 0.5.10, llama in 0.5.14) and never reaches b = L.
#[test]
fn sglang_edges_per_model_file() {
    let ids = [-1, 12, 25];
    for (engine, arch) in [
        ("sglang@0.5.14", "gemma3_text"),
        ("sglang@0.5.14", "gemma4"),
        ("sglang@0.5.23", "gemma4_text"),
    ] {
        let f = feed(engine, Some(arch), Some(&ids), 26);
        assert_eq!(fed(&f), [0, 13, 26], "{engine} {arch}");
        assert_eq!(f.slots[2].norm, Some(FinalNorm::Pre), "{engine} {arch}");
    }
    for (engine, arch) in [
        ("sglang@0.5.10", "qwen3_next"),
        ("sglang@0.5.14", "qwen3_next"),
        ("sglang@0.5.14", "minimax_m2"),
    ] {
        let f = feed(engine, Some(arch), Some(&[-1, 12, 22]), 26);
        assert_eq!(fed(&f), [0, 13, 23], "{engine} {arch}");
    }
    for (engine, arch) in [("sglang@0.5.10", "minimax_m2"), ("sglang@0.5.14", "llama")] {
        let f = feed(engine, Some(arch), Some(&[-1, 12, 22]), 26);
        assert!(refused(&f), "{engine} {arch}");
    }
    let f = feed("sglang@0.5.14", Some("llama"), Some(&[1, 12, 25]), 26);
    assert_eq!(fed(&f), [2, 13]);
}

/// sglang 0.5.10 / 0.5.14 turn FlashInfer all-reduce fusion on by default at TP > 1 for
/// GLM-4.5, gpt-oss, GLM-4.7-Flash, Qwen3-VL-MoE (0.5.14) and the DeepSeek family (0.5.10)
/// (`server_args.py`): their model-level capture may hold a partial sum, said as a note; 0.5.23's
/// boundary capture reduces first.
#[test]
fn sglang_tp_fusion_is_a_note_where_the_capture_sums_at_the_model_level() {
    let tp = |f: &Feed| f.notes.iter().any(|n| n.contains("tensor parallelism"));
    for (engine, arch) in [
        ("sglang@0.5.14", "glm4_moe"),
        ("sglang@0.5.14", "gpt_oss"),
        ("sglang@0.5.14", "qwen3_vl_moe"),
        ("sglang@0.5.10", "deepseek_v3"),
        ("sglang@0.5.10", "glm4_moe"),
    ] {
        let f = feed(engine, Some(arch), Some(&[1, 12, 22]), 26);
        assert!(tp(&f), "{engine} {arch}: {:?}", f.notes);
    }
    let f = feed("sglang@0.5.10", Some("glm4_moe"), Some(&[1, 12, 22]), 26);
    assert!(
        f.notes.iter().any(|n| n.contains("CUDA graphs")),
        "{:?}",
        f.notes
    );
    for (engine, arch) in [
        ("sglang@0.5.23", "glm4_moe"),
        ("sglang@0.5.14", "llama"),
        ("sglang@0.5.14", "deepseek_v3"),
    ] {
        assert!(
            !tp(&feed(engine, Some(arch), Some(&[1, 12, 22]), 26)),
            "{engine} {arch}"
        );
    }
    assert!(refused(&feed(
        "sglang@0.5.14",
        Some("glm4_moe"),
        Some(&[-1, 12, 22]),
        26
    )));
}
