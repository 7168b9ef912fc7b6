//! `spec init`: the spec a trainer's rule implies for a real draft config. Gate with that spec
//! and the trainer as the engine is consistent (the two share the rule table), and for the
//! published drafters the trainer's spec is the one shipped in specs/, written by hand from
//! the trainers' code.

use crate::support::{eagle_check, fixture, p, root, scratch};
use eagle_check::spec::Spec;
use std::path::Path;

/// (real config, L, Ht, model_type)
const CONFIGS: &[(&str, usize, usize, &str)] = &[
    (
        "draft_eagle3_deepseek-v3-671b__SpecForge.json",
        61,
        7168,
        "deepseek_v3",
    ),
    (
        "draft_eagle3_kimi-k2.5-mla__TorchSpec.json",
        61,
        7168,
        "kimi_k25",
    ),
    (
        "draft_eagle3_llama3.1-8b__SafeAILab-EAGLE_traineagle3.json",
        32,
        4096,
        "llama",
    ),
    (
        "draft_eagle3_llama3.1-8b__SpecForge.json",
        32,
        4096,
        "llama",
    ),
    (
        "draft_eagle3_qwen2.5-0.5b__SpecForge.json",
        24,
        896,
        "qwen2",
    ),
    ("draft_eagle3_qwen3-8b__SpecForge.json", 36, 4096, "qwen3"),
];

const TRAINERS: &[&str] = &[
    "specforge",
    "specforge:online",
    "eagle",
    "modelopt",
    "speculators",
];

fn init(config: &str, trainer: &str, dims: &[String], out: &Path) -> crate::support::Output {
    let mut args = vec![
        "spec".to_string(),
        "init".to_string(),
        "--draft".to_string(),
        p(&fixture(&format!("real-configs/{config}"))),
        "--trainer".to_string(),
        trainer.to_string(),
        "--out".to_string(),
        p(out),
    ];
    args.extend(dims.iter().cloned());
    eagle_check(&args)
}

fn dims(l: usize, h: usize, m: &str) -> Vec<String> {
    vec![
        "--num-layers".into(),
        l.to_string(),
        "--hidden-size".into(),
        h.to_string(),
        "--model-type".into(),
        m.into(),
    ]
}

#[test]
fn gate_with_the_trainers_spec_and_the_trainer_is_consistent() {
    let dir = scratch("spec-init-gate");
    for &(config, l, h, m) in CONFIGS {
        for &trainer in TRAINERS {
            let out_path = dir.join(format!("{config}-{}.yaml", trainer.replace(':', "-")));
            let out = init(config, trainer, &dims(l, h, m), &out_path);
            assert_eq!(out.code, 0, "{config} {trainer}: {}", out.stderr);
            let spec = Spec::load(&out_path).unwrap();
            assert_eq!(spec.fc_in_features, Some(spec.boundaries.len() * h));
            let text = std::fs::read_to_string(&out_path).unwrap();
            assert!(text.contains("fixtures/engines/FACTS.md section"), "{text}");
            let gate = eagle_check([
                "gate",
                "--spec",
                &p(&out_path),
                "--draft",
                &p(&fixture(&format!("real-configs/{config}"))),
                "--engine",
                trainer,
                "--format",
                "json",
            ]);
            assert_eq!(gate.code, 0, "{config} {trainer}:\n{text}\n{}", gate.stdout);
            let json = gate.json();
            assert!(
                json["findings"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|f| f["severity"] == "warning"),
                "{config} {trainer}: {}",
                json["findings"]
            );
        }
    }
}

/// The specs in specs/ were written by hand from each trainer's code; `spec init` with the
/// trainer that made each drafter must agree with every one of them (target dims from a real
/// target config where the repository has one).
#[test]
fn the_trainers_spec_is_the_shipped_spec_for_the_published_drafters() {
    let dir = scratch("spec-init-shipped");
    let cases: &[(&str, &str, &str, Vec<String>)] = &[
        (
            "draft_eagle3_deepseek-v3-671b__SpecForge.json",
            "specforge",
            "specs/deepseek-v3-specforge.yaml",
            vec![
                "--target".into(),
                p(&fixture(
                    "real-configs/target_deepseek-v3-671b__tt-metal_reference_config.json",
                )),
            ],
        ),
        (
            "draft_eagle3_llama3.1-8b__SpecForge.json",
            "specforge",
            "specs/llama3.1-8b-specforge.yaml",
            vec![
                "--target".into(),
                p(&fixture(
                    "real-configs/target_llama-3.1-8b__TensorRT-LLM_test_modeling_llama_LLAMA_3_1_8B_CONFIG.json",
                )),
            ],
        ),
        (
            "draft_eagle3_llama3.1-8b__SafeAILab-EAGLE_traineagle3.json",
            "eagle",
            "specs/llama3.1-8b-eagle.yaml",
            dims(32, 4096, "llama"),
        ),
        (
            "draft_eagle3_qwen2.5-0.5b__SpecForge.json",
            "specforge",
            "specs/qwen2.5-0.5b-specforge.yaml",
            dims(24, 896, "qwen2"),
        ),
        (
            "draft_eagle3_qwen3-8b__SpecForge.json",
            "specforge",
            "specs/qwen3-8b-specforge.yaml",
            dims(36, 4096, "qwen3"),
        ),
        (
            "draft_eagle3_kimi-k2.5-mla__TorchSpec.json",
            "specforge:online",
            "specs/kimi-k2.5-mla-torchspec.yaml",
            dims(61, 7168, "kimi_k25"),
        ),
    ];
    for (config, trainer, shipped, dims) in cases {
        let out_path = dir.join(format!("{config}.yaml"));
        let out = init(config, trainer, dims, &out_path);
        assert_eq!(out.code, 0, "{config}: {}", out.stderr);
        let made = Spec::load(&out_path).unwrap();
        let shipped = Spec::load(&root().join(shipped)).unwrap();
        assert_eq!(made.boundaries, shipped.boundaries, "{config}");
        assert_eq!(made.fc_in_features, shipped.fc_in_features, "{config}");
        assert_eq!(made.target, shipped.target, "{config}");
    }
}

/// The seed incident's patched ids [-1, 2, 30]: SpecForge checks its ids (three distinct, in
/// 0..L) and refuses them, so there is no spec to write; nothing is written.
#[test]
fn a_config_the_trainer_refuses_writes_no_spec() {
    let dir = scratch("spec-init-refused");
    let out_path = dir.join("seed.yaml");
    let out = eagle_check([
        "spec",
        "init",
        "--draft",
        &p(&fixture("configs/seed-patched-draft.json")),
        "--trainer",
        "specforge",
        "--num-layers",
        "61",
        "--out",
        &p(&out_path),
    ]);
    out.assert_could_not_check(&["specforge:offline would not train", "0..L"]);
    assert!(!out_path.exists());
    // An existing --out is kept unless --force.
    std::fs::write(&out_path, "keep").unwrap();
    let out = init(
        "draft_eagle3_qwen3-8b__SpecForge.json",
        "specforge",
        &dims(36, 4096, "qwen3"),
        &out_path,
    );
    out.assert_could_not_check(&["exists", "--force"]);
    assert_eq!(std::fs::read_to_string(&out_path).unwrap(), "keep");
    // Serving engines are not trainers.
    eagle_check([
        "spec",
        "init",
        "--draft",
        &p(&fixture("configs/seed-patched-draft.json")),
        "--trainer",
        "vllm",
        "--num-layers",
        "61",
    ])
    .assert_could_not_check(&["vllm serves drafters"]);
}

/// A trainer whose layout takes b = L (Model-Optimizer's HF dump: id L-1 is HF's post-norm
/// last state) once got `final_norm: post-norm` written, which the spec reader refused: the
/// command could not read its own file. The spec's own word is written and reads back.
#[test]
fn a_trainer_layout_taking_b_l_writes_a_spec_that_reads_back() {
    let dir = scratch("spec-init-final-norm");
    let src = fixture("real-configs/draft_eagle3_llama3.1-8b__SpecForge.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src).unwrap()).unwrap();
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = serde_json::json!([1, 15, 31]);
    let draft = dir.join("draft-last-layer.json");
    std::fs::write(&draft, cfg.to_string()).unwrap();
    let out_path = dir.join("modelopt.yaml");
    let out = eagle_check([
        "spec",
        "init",
        "--draft",
        &p(&draft),
        "--trainer",
        "modelopt",
        "--out",
        &p(&out_path),
        "--num-layers",
        "32",
        "--hidden-size",
        "4096",
        "--model-type",
        "llama",
    ]);
    assert_eq!(out.code, 0, "{}", out.stderr);
    let text = std::fs::read_to_string(&out_path).unwrap();
    assert!(text.contains("  final_norm: post\n"), "{text}");
    let spec = Spec::load(&out_path).unwrap();
    assert_eq!(
        spec.final_norm,
        Some(eagle_check::boundary::FinalNorm::Post)
    );
    assert_eq!(spec.boundaries.last().map(|b| b.0), Some(32));
}
