//! The static gate on the real published configs, driven through the real binary.

use crate::support::{eagle_check, fixture, p, root, scratch, synth};

const DS_DRAFT: &str = "real-configs/draft_eagle3_deepseek-v3-671b__SpecForge.json";
const DS_TARGET: &str = "real-configs/target_deepseek-v3-671b__tt-metal_reference_config.json";

fn gate(spec: &str, draft: &str, engine: &str) -> crate::support::Output {
    eagle_check([
        "gate",
        "--spec",
        &p(&root().join(spec)),
        "--draft",
        &p(&fixture(draft)),
        "--engine",
        engine,
        "--format",
        "json",
    ])
}

fn errors(out: &crate::support::Output) -> Vec<String> {
    out.json()["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["severity"] == "error")
        .map(|f| f["name"].as_str().unwrap().to_string())
        .collect()
}

/// SpecForge's DeepSeek-V3 ids [1, 29, 57] (nested, OUT): b = [2, 30, 58] wherever they are
/// read as layer outputs. sglang 0.5.14+ reads them through PR 25454's first-id rule (the first
/// id is 1, so +1); vLLM's default V2 runner never reads the nested key and falls back to its
/// default, which happens to be the same boundaries (a warning, not an error).
#[test]
fn specforge_deepseek_draft_is_consistent_where_ids_are_read_as_outputs() {
    for engine in [
        "sglang-legacy",
        "sglang@0.5.14",
        "sglang",
        "trtllm",
        "specforge",
        "modelopt",
        "eagle",
        "vllm",
    ] {
        let out = gate("specs/deepseek-v3-specforge.yaml", DS_DRAFT, engine);
        assert_eq!(out.code, 0, "{engine}: {}", out.stdout);
        assert_eq!(out.json()["verdict"], "consistent", "{engine}");
        assert!(
            errors(&out).is_empty(),
            "{engine}: {:?}",
            out.finding_names()
        );
    }
    let v2 = gate("specs/deepseek-v3-specforge.yaml", DS_DRAFT, "vllm");
    assert_eq!(v2.finding_names(), vec!["ids-not-read", "default-fallback"]);
}

/// vLLM reads ids raw: the SpecForge config is one off there (vLLM PR 43671) on the V1 runner,
/// which reads the nested key, and on speculators, which passes ids to vLLM as a flag.
#[test]
fn vllm_reads_specforge_ids_one_below_training() {
    for engine in ["vllm:v1", "speculators"] {
        let out = gate("specs/deepseek-v3-specforge.yaml", DS_DRAFT, engine);
        assert_eq!(out.code, 1, "{engine}");
        let json = out.json();
        let f = &json["findings"][0];
        assert_eq!(f["name"], "off-by-one", "{engine}");
        assert!(f["fix"].as_str().unwrap().contains("[2, 30, 58]"), "{f}");
        let fed: Vec<i64> = json["slots"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["fed"].as_i64().unwrap())
            .collect();
        assert_eq!(fed, vec![1, 29, 57]);
    }
}

#[test]
fn a_spec_trained_with_the_embedding_reports_embedding_capture() {
    for engine in ["sglang", "vllm:v1", "trtllm"] {
        let out = gate(
            "fixtures/specs/deepseek-v3-with-embedding.yaml",
            DS_DRAFT,
            engine,
        );
        assert_eq!(out.code, 1);
        assert_eq!(errors(&out), vec!["embedding-capture"], "{engine}");
    }
}

/// The seed incident: a local patch wrote [-1, 2, 30]. Stock sglang 0.5.10 crashes on it
/// (the residual is None before layer 0: FACTS.md 1.3); the patched engine fed
/// [embedding, 3, 31]. Both are said, with the fix that restores the trained ids.
#[test]
fn seed_patched_ids_crash_stock_sglang_and_feed_the_embedding_when_patched() {
    let out = gate(
        "fixtures/specs/seed-trained.yaml",
        "configs/seed-patched-draft.json",
        "sglang-legacy",
    );
    assert_eq!(out.code, 1);
    let json = out.json();
    assert_eq!(out.finding_names(), vec!["refused", "embedding-capture"]);
    let patched = &json["findings"][1];
    assert!(
        patched["message"]
            .as_str()
            .unwrap()
            .contains("fed [0, 3, 31]"),
        "{patched}"
    );
    assert!(patched["fix"].as_str().unwrap().contains("[2, 30, 58]"));
    // Current sglang on DeepSeek: the first id is not 1, so the ids are raw; -1 captures
    // nothing and sglang 0.5.23's packer raises (FACTS.md 1.3).
    let current = gate(
        "fixtures/specs/seed-trained.yaml",
        "configs/seed-patched-draft.json",
        "sglang",
    );
    assert_eq!(current.finding_names(), vec!["refused"]);
    // TensorRT-LLM: -1 is the post-norm final state, sorted into slot 0 (one-model path) or
    // moved last (two-model path).
    let fed = |engine: &str| -> Vec<i64> {
        gate(
            "fixtures/specs/seed-trained.yaml",
            "configs/seed-patched-draft.json",
            engine,
        )
        .json()["slots"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|s| s["fed"].as_i64())
            .collect()
    };
    assert_eq!(fed("trtllm"), vec![61, 3, 31]);
    assert_eq!(fed("trtllm:two-model"), vec![3, 31, 61]);
    // And on vLLM -1 means nothing.
    let vllm = gate(
        "fixtures/specs/seed-trained.yaml",
        "configs/seed-patched-draft.json",
        "vllm:v1",
    );
    assert!(
        vllm.finding_names().contains(&"out-of-range".to_string()),
        "{:?}",
        vllm.finding_names()
    );
}

#[test]
fn configs_without_ids_fall_back_to_defaults_everywhere() {
    for (spec, draft) in [
        (
            "specs/llama3.1-8b-specforge.yaml",
            "real-configs/draft_eagle3_llama3.1-8b__SpecForge.json",
        ),
        (
            "specs/qwen2.5-0.5b-specforge.yaml",
            "real-configs/draft_eagle3_qwen2.5-0.5b__SpecForge.json",
        ),
        (
            "specs/qwen3-8b-specforge.yaml",
            "real-configs/draft_eagle3_qwen3-8b__SpecForge.json",
        ),
    ] {
        let out = gate(spec, draft, "all");
        assert_eq!(out.code, 0, "{spec}: {}", out.stdout);
        let json = out.json();
        let findings = json["findings"].as_array().unwrap();
        // Every engine but the hard-coded EAGLE reference warns that it fell back.
        assert_eq!(findings.len(), 6, "{spec}");
        assert!(
            findings
                .iter()
                .all(|f| f["name"] == "default-fallback" && f["severity"] == "warning")
        );
    }
    // The EAGLE reference's own config says `LlamaForCausalLM`: every engine falls back as
    // above, and sglang, which registers only LlamaForCausalLMEagle3 as an EAGLE-3 draft and
    // renames nothing (FACTS.md section 8), cannot load it at all.
    let out = gate(
        "specs/llama3.1-8b-eagle.yaml",
        "real-configs/draft_eagle3_llama3.1-8b__SafeAILab-EAGLE_traineagle3.json",
        "all",
    );
    assert_eq!(out.code, 1, "{}", out.stdout);
    let json = out.json();
    let findings = json["findings"].as_array().unwrap();
    let (unloadable, rest): (Vec<_>, Vec<_>) = findings
        .iter()
        .partition(|f| f["name"] == "unsupported-draft");
    assert_eq!(unloadable.len(), 1, "{findings:?}");
    assert!(
        unloadable[0]["engine"]
            .as_str()
            .unwrap()
            .starts_with("sglang")
    );
    assert!(
        unloadable[0]["fix"]
            .as_str()
            .unwrap()
            .contains("LlamaForCausalLMEagle3")
    );
    assert_eq!(rest.len(), 6);
    assert!(
        rest.iter()
            .all(|f| f["name"] == "default-fallback" && f["severity"] == "warning")
    );
}

/// vLLM PR 50170: a config without ids fell back to the heuristic while training used others.
#[test]
fn default_fallback_is_an_error_when_training_used_other_layers() {
    let out = gate(
        "specs/deepseek-v3-specforge.yaml",
        "real-configs/draft_eagle3_llama3.1-8b__SpecForge.json",
        "vllm",
    );
    // The Llama draft's config has no ids; against a 61-layer spec vLLM's default is [2, 30, 58] again,
    // so use a spec the default misses.
    assert_eq!(out.code, 0);
    let dir = scratch("fallback-spec");
    let spec = dir.join("spec.yaml");
    std::fs::write(
        &spec,
        "name: x\ntarget: { num_hidden_layers: 32 }\ncapture: { boundaries: [4, 16, 28] }\n",
    )
    .unwrap();
    let out = eagle_check([
        "gate",
        "--spec",
        &p(&spec),
        "--draft",
        &p(&fixture(
            "real-configs/draft_eagle3_llama3.1-8b__SpecForge.json",
        )),
        "--engine",
        "vllm",
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 1);
    let json = out.json();
    assert_eq!(json["findings"][0]["name"], "default-fallback");
    assert_eq!(json["findings"][0]["severity"], "error");
    assert!(
        json["findings"][0]["fix"]
            .as_str()
            .unwrap()
            .contains("[4, 16, 28]")
    );
}

#[test]
fn final_boundary_needs_a_side() {
    let dir = scratch("final-norm");
    let spec = dir.join("spec.yaml");
    std::fs::write(
        &spec,
        "name: x\ntarget: { num_hidden_layers: 61 }\ncapture: { boundaries: [2, 30, 61] }\n",
    )
    .unwrap();
    let draft = dir.join("draft.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture(DS_DRAFT)).unwrap()).unwrap();
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([2, 30, 61]);
    std::fs::write(&draft, cfg.to_string()).unwrap();
    let run = |spec: &std::path::Path| {
        eagle_check([
            "gate",
            "--spec",
            &p(spec),
            "--draft",
            &p(&draft),
            "--engine",
            "vllm:v1",
            "--format",
            "json",
        ])
    };
    let out = run(&spec);
    assert_eq!(out.code, 0, "{}", out.stdout);
    assert_eq!(out.finding_names(), vec!["final-norm"]);
    std::fs::write(&spec, "name: x\ntarget: { num_hidden_layers: 61 }\ncapture: { boundaries: [2, 30, 61], final_norm: post }\n").unwrap();
    let out = run(&spec);
    assert_eq!(out.code, 1);
    assert_eq!(out.finding_names(), vec!["final-norm"]);
    assert_eq!(out.json()["findings"][0]["severity"], "error");
}

#[test]
fn weight_shapes_are_checked_from_headers() {
    let dir = scratch("draft-shapes");
    let good = synth::draft_dir(&dir.join("good"), &fixture(DS_DRAFT), 3 * 7168);
    let four = synth::draft_dir(&dir.join("four"), &fixture(DS_DRAFT), 4 * 7168);
    let odd = synth::draft_dir(&dir.join("odd"), &fixture(DS_DRAFT), 3 * 7168 + 5);
    let run = |d: &std::path::Path| {
        eagle_check([
            "gate",
            "--spec",
            "specs/deepseek-v3-specforge.yaml",
            "--draft",
            &p(d),
            "--engine",
            "sglang",
            "--format",
            "json",
        ])
    };
    assert_eq!(run(&good).code, 0);
    let out = run(&four);
    assert_eq!(out.code, 1);
    assert!(
        out.finding_names().contains(&"count".to_string()),
        "{:?}",
        out.finding_names()
    );
    let out = run(&odd);
    assert!(
        out.finding_names().iter().all(|n| n == "shape"),
        "{:?}",
        out.finding_names()
    );
    assert_eq!(out.code, 1);
}

/// Issue 2's scale target: a DeepSeek-V3-sized directory (163 shards, real shapes) is gated from
/// headers alone. The timing itself is measured by `cargo bench --bench gate`, not asserted here.
#[test]
fn gate_reads_a_671b_directory_from_headers() {
    let dir = scratch("dsv3-671b");
    let target = synth::deepseek_v3_dir(&dir.join("target"), &fixture(DS_TARGET), 163);
    let draft = synth::draft_dir(&dir.join("draft"), &fixture(DS_DRAFT), 3 * 7168);
    let out = eagle_check([
        "gate",
        "--spec",
        "specs/deepseek-v3-specforge.yaml",
        "--draft",
        &p(&draft),
        "--target",
        &p(&target),
        "--engine",
        "sglang",
        "--format",
        "json",
    ]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let tensors: usize = out.json()["subject"]["target_tensors"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(tensors > 90_000, "{tensors}");
    // Drop one layer from the index's shard: the gate must notice.
    let shard = target.join("model-00080-of-00163.safetensors");
    std::fs::remove_file(&shard).unwrap();
    let out = eagle_check([
        "gate",
        "--spec",
        "specs/deepseek-v3-specforge.yaml",
        "--draft",
        &p(&draft),
        "--target",
        &p(&target),
    ]);
    assert_eq!(out.code, 2);
    assert!(
        out.stderr.contains("model-00080-of-00163.safetensors"),
        "{}",
        out.stderr
    );
}

#[test]
fn bad_input_exits_2_with_one_line_naming_the_file() {
    let dir = scratch("bad-input");
    let broken = dir.join("broken.yaml");
    std::fs::write(&broken, "name: x\ncapture:\n  layerz: [1, 2, 3]\n").unwrap();
    let cfg = dir.join("config.json");
    std::fs::write(
        &cfg,
        "{\"architectures\": [\"LlamaForCausalLMEagle3\"], \"hidden_size\": 64",
    )
    .unwrap();
    // A spec without target dims and no --target: the layer count is unknown.
    let no_dims = dir.join("no-dims.yaml");
    std::fs::write(&no_dims, "name: x\ncapture: { boundaries: [2, 30, 58] }\n").unwrap();
    let (spec, draft) = (
        "specs/deepseek-v3-specforge.yaml".to_string(),
        p(&fixture(DS_DRAFT)),
    );
    let cases: Vec<(Vec<String>, Vec<&str>)> = vec![
        (
            vec![p(&broken), draft.clone()],
            vec!["broken.yaml", "line 3", "layerz"],
        ),
        (
            vec![spec.clone(), "no/such/dir".into()],
            vec!["no/such/dir"],
        ),
        (vec![spec.clone(), p(&cfg)], vec!["config.json", "JSON"]),
        (
            vec![spec.clone(), draft.clone(), "--engine".into(), "tgi".into()],
            vec!["unknown engine `tgi`"],
        ),
        (
            vec![p(&no_dims), draft.clone()],
            vec!["no-dims.yaml", "--target"],
        ),
    ];
    for (args, needles) in cases {
        let mut argv = vec![
            "gate".to_string(),
            "--spec".into(),
            args[0].clone(),
            "--draft".into(),
            args[1].clone(),
        ];
        argv.extend(args[2..].iter().cloned());
        eagle_check(&argv).assert_could_not_check(&needles);
    }
}

#[test]
fn table_output_names_the_verdict() {
    let out = eagle_check([
        "gate",
        "--spec",
        "specs/deepseek-v3-specforge.yaml",
        "--draft",
        &p(&fixture(DS_DRAFT)),
        "--engine",
        "vllm:v1",
    ]);
    assert_eq!(out.code, 1);
    assert!(out.stdout.contains("off-by-one"));
    assert!(out.stdout.contains("verdict: MISMATCH"));
}

/// The MLA draft's q/kv down projections read `cat(embedding, fc output)`: 2H wide. A draft
/// whose `q_a_proj` or `kv_a_proj_with_mqa` takes H (a target layer's width) is a shape error
/// naming the tensor.
#[test]
fn mla_draft_down_projections_must_take_2h() {
    const KIMI: &str = "real-configs/draft_eagle3_kimi-k2.5-mla__TorchSpec.json";
    let (h, fc_in) = (7168, 3 * 7168);
    let dir = scratch("mla-draft-shapes");
    let cfg = fixture(KIMI);
    let good = synth::mla_draft_dir(&dir.join("good"), &cfg, fc_in, 2 * h, 2 * h);
    let narrow_q = synth::mla_draft_dir(&dir.join("narrow-q"), &cfg, fc_in, h, 2 * h);
    let narrow_kv = synth::mla_draft_dir(&dir.join("narrow-kv"), &cfg, fc_in, 2 * h, h);
    let run = |d: &std::path::Path| {
        eagle_check([
            "gate",
            "--spec",
            "specs/kimi-k2.5-mla-torchspec.yaml",
            "--draft",
            &p(d),
            "--engine",
            "sglang",
            "--format",
            "json",
        ])
    };
    let out = run(&good);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    for (d, proj) in [(&narrow_q, "q_a_proj"), (&narrow_kv, "kv_a_proj_with_mqa")] {
        let out = run(d);
        assert_eq!(out.code, 1, "{proj}: {}", out.stdout);
        assert_eq!(out.finding_names(), vec!["shape"], "{proj}");
        let msg = out.json()["findings"][0]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            msg.contains(&format!("midlayer.self_attn.{proj}.weight"))
                && msg.contains("2H = 14336"),
            "{msg}"
        );
    }
}

/// The README's engine table is the rule table: `eagle-check engines --markdown` must print
/// exactly what sits between the README's markers.
#[test]
fn readme_engine_table_is_generated_from_the_rules() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let start = "<!-- engine-table:start -->\n";
    let end = "<!-- engine-table:end -->";
    let from = readme
        .find(start)
        .expect("README has the engine-table start marker")
        + start.len();
    let to = readme
        .find(end)
        .expect("README has the engine-table end marker");
    let out = eagle_check(["engines", "--markdown"]);
    assert_eq!(out.code, 0);
    assert_eq!(
        &readme[from..to],
        out.stdout,
        "README.md's engine table differs from the rules: paste `eagle-check engines --markdown` between the markers"
    );
}

/// Each header check of the draft, one broken tensor at a time: the finding names the tensor
/// and both sizes.
#[test]
fn draft_header_checks_name_the_tensor() {
    let dir = scratch("draft-header-checks");
    let h = 7168usize;
    let set =
        |list: &mut Vec<(String, &'static str, Vec<usize>)>, name: &str, shape: Vec<usize>| {
            list.iter_mut().find(|(n, _, _)| n == name).unwrap().2 = shape;
        };
    type Edit = Box<dyn Fn(&mut Vec<(String, &'static str, Vec<usize>)>)>;
    let cases: Vec<(&str, Edit, &str, &str)> = vec![
        (
            "lm-head",
            Box::new(move |l| set(l, "lm_head.weight", vec![16000, h])),
            "lm_head.weight",
            "32000",
        ),
        (
            "d2t",
            Box::new(move |l| set(l, "d2t", vec![16000])),
            "d2t",
            "[32000]",
        ),
        (
            "t2d",
            Box::new(move |l| set(l, "t2d", vec![1000])),
            "t2d",
            "[129280]",
        ),
        (
            "hidden",
            Box::new(move |l| set(l, "midlayer.hidden_norm.weight", vec![4096])),
            "midlayer.hidden_norm.weight",
            "hidden_size = 7168",
        ),
        (
            "no-d2t",
            Box::new(|l| l.retain(|(n, _, _)| n != "d2t")),
            "no d2t",
            "32000 < 129280",
        ),
        (
            "no-head",
            Box::new(|l| l.retain(|(n, _, _)| n != "lm_head.weight")),
            "no lm_head.weight",
            "",
        ),
    ];
    for (label, edit, needle, number) in cases {
        let d = synth::draft_dir_with(&dir.join(label), &fixture(DS_DRAFT), 3 * h, edit);
        let out = eagle_check([
            "gate",
            "--spec",
            "specs/deepseek-v3-specforge.yaml",
            "--draft",
            &p(&d),
            "--engine",
            "sglang",
            "--format",
            "json",
        ]);
        assert_eq!(out.code, 1, "{label}: {}", out.stdout);
        assert_eq!(out.finding_names(), vec!["shape"], "{label}");
        let msg = out.json()["findings"][0]["message"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(
            msg.contains(needle) && msg.contains(number),
            "{label}: {msg}"
        );
    }
}

/// Config-level checks: the draft's target_hidden_size and vocab_size against the target, and a
/// draft vocabulary larger than the vocabulary it maps into.
#[test]
fn draft_config_checks_compare_with_the_target() {
    let dir = scratch("draft-config-checks");
    let base: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture(DS_DRAFT)).unwrap()).unwrap();
    let cases = [
        (
            "target_hidden_size",
            serde_json::json!(4096),
            "target_hidden_size = 4096",
        ),
        (
            "vocab_size",
            serde_json::json!(128256),
            "draft vocab_size 128256",
        ),
        (
            "draft_vocab_size",
            serde_json::json!(200000),
            "draft_vocab_size 200000",
        ),
    ];
    for (key, value, needle) in cases {
        let mut cfg = base.clone();
        cfg[key] = value;
        let path = dir.join(format!("{key}.json"));
        std::fs::write(&path, cfg.to_string()).unwrap();
        let out = eagle_check([
            "gate",
            "--spec",
            "specs/deepseek-v3-specforge.yaml",
            "--draft",
            &p(&path),
            "--target",
            &p(&fixture(DS_TARGET)),
            "--engine",
            "sglang",
            "--format",
            "json",
        ]);
        assert_eq!(out.code, 1, "{key}: {}", out.stdout);
        let messages: Vec<String> = out.json()["findings"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["message"].as_str().unwrap().to_string())
            .collect();
        assert!(
            messages.iter().any(|m| m.contains(needle)),
            "{key}: {messages:?}"
        );
    }
}

/// A target checkpoint whose shards all exist but that lacks one declared layer.
#[test]
fn a_target_checkpoint_missing_a_layer_is_named() {
    let dir = scratch("missing-layer");
    let src = fixture("models/llama");
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let mut weights =
        candle_core::safetensors::load(src.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    weights.retain(|name, _| !name.starts_with("model.layers.3."));
    candle_core::safetensors::save(&weights, dir.join("model.safetensors")).unwrap();
    let out = eagle_check([
        "gate",
        "--spec",
        "fixtures/bundles/tiny-llama/spec.yaml",
        "--draft",
        "fixtures/bundles/tiny-llama/draft",
        "--target",
        &p(&dir),
        "--format",
        "json",
    ]);
    // A checkpoint that cannot be run is bad input (exit 2, one line), not a layout mismatch.
    out.assert_could_not_check(&["first: layer 3", "5 layers"]);
}

/// The spec's `target:` block against the target config: layer count, hidden size and
/// model_type each refuse a target the spec was not written for.
#[test]
fn spec_target_block_is_checked_against_the_target() {
    let dir = scratch("spec-target-block");
    let base = std::fs::read_to_string(fixture("bundles/tiny-llama/spec.yaml")).unwrap();
    let line = "target: { num_hidden_layers: 5, hidden_size: 64 }";
    assert!(base.contains(line));
    for (label, target, needle) in [
        (
            "layers",
            "target: { num_hidden_layers: 6, hidden_size: 64 }",
            "written for a 6-layer target",
        ),
        (
            "hidden",
            "target: { num_hidden_layers: 5, hidden_size: 96 }",
            "written for hidden size 96",
        ),
        (
            "model-type",
            "target: { num_hidden_layers: 5, hidden_size: 64, model_type: mistral }",
            "written for a `mistral` target",
        ),
    ] {
        let spec = dir.join(format!("{label}.yaml"));
        std::fs::write(&spec, base.replace(line, target)).unwrap();
        let out = eagle_check([
            "gate",
            "--spec",
            &p(&spec),
            "--draft",
            &p(&fixture("bundles/tiny-llama/draft")),
            "--target",
            &p(&fixture("models/llama")),
            "--format",
            "json",
        ]);
        assert_eq!(out.code, 1, "{label}: {}", out.stdout);
        let messages: Vec<String> = out.json()["findings"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["name"] == "shape")
            .map(|f| f["message"].as_str().unwrap().to_string())
            .collect();
        assert!(
            messages.iter().any(|m| m.contains(needle)),
            "{label}: {messages:?}"
        );
    }
}

/// A multimodal wrapper as the gate's target: the text model's dims come from `text_config`,
/// the vocabulary size from the wrapper, the weights from `model.language_model.*`. The bundle
/// is consistent against it; a draft with another vocabulary is refused against the wrapper's.
#[test]
fn gate_reads_a_multimodal_target_through_its_text_config() {
    let dir = scratch("gate-multimodal");
    let plain = fixture("models/llama");
    let mut text: serde_json::Value =
        serde_json::from_slice(&std::fs::read(plain.join("config.json")).unwrap()).unwrap();
    let vocab = text.as_object_mut().unwrap().remove("vocab_size").unwrap();
    let cfg = serde_json::json!({
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "vocab_size": vocab,
        "text_config": text,
    });
    let target = dir.join("target");
    std::fs::create_dir_all(&target).unwrap();
    std::fs::write(target.join("config.json"), cfg.to_string()).unwrap();
    let weights =
        candle_core::safetensors::load(plain.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap();
    let renamed: std::collections::HashMap<String, candle_core::Tensor> = weights
        .into_iter()
        .map(|(k, v)| match k.strip_prefix("model.") {
            Some(rest) => (format!("model.language_model.{rest}"), v),
            None => (k, v),
        })
        .collect();
    candle_core::safetensors::save(&renamed, target.join("model.safetensors")).unwrap();
    let draft = fixture("bundles/tiny-llama/draft/config.json");
    let mut other: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&draft).unwrap()).unwrap();
    other["vocab_size"] = serde_json::json!(512);
    let other_path = dir.join("draft-512.json");
    std::fs::write(&other_path, other.to_string()).unwrap();
    let gate = |draft: &std::path::Path| {
        eagle_check([
            "gate",
            "--spec",
            &p(&fixture("bundles/tiny-llama/spec.yaml")),
            "--draft",
            &p(draft),
            "--target",
            &p(&target),
            "--format",
            "json",
        ])
    };
    let out = gate(&draft);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let out = gate(&other_path);
    assert_eq!(out.code, 1, "{}\n{}", out.stdout, out.stderr);
    assert_eq!(out.finding_names(), vec!["shape"]);
    let msg = out.json()["findings"][0]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        msg.contains("draft vocab_size 512 differs from the target's 256"),
        "{msg}"
    );
}
