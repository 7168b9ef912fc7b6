//! `eagle-check plan` against the engines' documented flags: every flag, environment variable,
//! JSON key and source patch it prints must be one the engine defines, as
//! fixtures/engines/plan-flags.json records it (re-read from the sglang 0.5.23 and vLLM 0.33.0
//! wheels by fixtures/engines/plan_flags.py). The files are sglang's
//! srt/arg_groups/fields/{model,parallel,spec,exec_,memory,schedule}.py (CLI flags),
//! srt/debug_utils/dumper.py (DUMPER_* variables, names, filter), srt/layers/aux_hidden_states.py
//! and srt/layers/logits_processor.py (the patched lines), srt/managers/io_struct.py (/generate);
//! vLLM's vllm/engine/arg_utils.py (CLI flags), vllm/config/speculative.py and
//! vllm/config/kv_transfer.py (JSON keys), .../v1/example_hidden_states_connector.py (the
//! connector), vllm/entrypoints/openai/completion/protocol.py (/v1/completions). And the ids
//! plan prints must be the rule table's: re-resolved here, they capture what plan says.

use crate::support::{Output, eagle_check, fixture, p, scratch};
use eagle_check::boundary::Boundary;
use eagle_check::engine::{DraftIds, EngineSel, resolve};
use serde_json::Value;
use std::collections::BTreeSet;

fn documented() -> Value {
    let text = std::fs::read_to_string(fixture("engines/plan-flags.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn run_plan(args: &[&str]) -> Output {
    let mut all = vec!["plan"];
    all.extend_from_slice(args);
    eagle_check(all)
}

fn plan_json(args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.extend(["--format", "json"]);
    let out = run_plan(&all);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    out.json()
}

/// The engine's command lines of a plan (not the eagle-check diff line, not the helpers).
fn engine_commands(plan: &Value) -> Vec<String> {
    plan["steps"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["commands"].as_array().unwrap().iter())
        .map(|c| c.as_str().unwrap().to_string())
        .filter(|c| c.contains("sglang.launch_server") || c.contains("vllm serve"))
        .collect()
}

/// `--flag` words of a command (JSON values are single-quoted words of their own).
fn flags(command: &str) -> BTreeSet<String> {
    command
        .split_whitespace()
        .filter(|w| w.starts_with("--"))
        .map(str::to_string)
        .collect()
}

/// The single-quoted JSON after `flag` in a command.
fn json_arg(command: &str, flag: &str) -> Option<Value> {
    let rest = command.split(&format!("{flag} '")).nth(1)?;
    serde_json::from_str(rest.split('\'').next()?).ok()
}

fn check_documented(plan: &Value, engine: &str) {
    let docs = documented();
    let docs = &docs[engine];
    let commands = engine_commands(plan);
    assert!(!commands.is_empty(), "{plan}");
    for command in &commands {
        for flag in flags(command) {
            let source = docs["flags"][&flag].as_str();
            assert!(
                source.is_some(),
                "{engine}: plan prints {flag}, which plan-flags.json does not record as defined \
                 (re-run fixtures/engines/plan_flags.py after reading the engine's source)"
            );
        }
        for word in command.split_whitespace() {
            if let Some((var, _)) = word
                .split_once('=')
                .filter(|(v, _)| v.starts_with("DUMPER_"))
            {
                assert!(
                    docs["env"][var].is_string(),
                    "{engine}: {var} is not a field of srt/debug_utils/dumper.py DumperConfig"
                );
            }
        }
        if let Some(spec) = json_arg(command, "--speculative-config") {
            for key in spec.as_object().unwrap().keys() {
                assert!(
                    docs["json_keys"][format!("speculative_config.{key}")].is_string(),
                    "{key}"
                );
            }
            assert_eq!(spec["method"], "extract_hidden_states");
            assert!(docs["names"]["method extract_hidden_states"].is_string());
            assert!(docs["names"]["draft_model_config.hf_config"].is_string());
            assert!(docs["names"]["hf_config.eagle_aux_hidden_state_layer_ids"].is_string());
            assert_eq!(spec["num_speculative_tokens"], 1);
            assert!(docs["names"]["num_speculative_tokens 1"].is_string());
            let ids = &spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"];
            assert!(ids.is_array(), "{spec}");
        }
        if let Some(kv) = json_arg(command, "--kv-transfer-config") {
            for key in kv.as_object().unwrap().keys() {
                assert!(
                    docs["json_keys"][format!("kv_transfer_config.{key}")].is_string(),
                    "{key}"
                );
            }
            assert_eq!(kv["kv_connector"], "ExampleHiddenStatesConnector");
            assert!(docs["names"]["kv_connector ExampleHiddenStatesConnector"].is_string());
            assert_eq!(kv["kv_role"], "kv_producer");
            assert!(docs["names"]["kv_role kv_producer"].is_string());
            assert!(kv["kv_connector_extra_config"]["shared_storage_path"].is_string());
            assert!(docs["names"]["kv_connector_extra_config.shared_storage_path"].is_string());
        }
        if command.contains("sglang.launch_server") {
            assert!(docs["names"]["python -m sglang.launch_server"].is_string());
        } else {
            assert!(docs["names"]["vllm serve"].is_string());
        }
    }
    // The files plan writes: the source patch (sglang) and the prompt sender.
    for step in plan["steps"].as_array().unwrap() {
        for file in step["files"].as_array().unwrap() {
            let content = file["content"].as_str().unwrap();
            if file["path"]
                .as_str()
                .unwrap()
                .ends_with("sglang-patch.yaml")
            {
                let mut target = "";
                let mut n = 0;
                for line in content.lines().map(str::trim) {
                    if let Some(t) = line.strip_prefix("- target: ") {
                        target = t;
                    } else if let Some(m) = line.strip_prefix("- match: ") {
                        let key = format!("{target} :: {}", m.trim_matches('"'));
                        assert!(
                            docs["patches"][&key].is_string(),
                            "sglang 0.5.23 has no single `{key}` (plan-flags.json patches)"
                        );
                        n += 1;
                    }
                }
                assert_eq!(n, 3, "{content}");
            } else {
                let keys: &[&str] = if engine.starts_with("sglang") {
                    &[
                        "generate.text",
                        "generate.input_ids",
                        "generate.sampling_params",
                        "sampling_params.max_new_tokens",
                        "sampling_params.temperature",
                    ]
                } else {
                    &[
                        "completions.model",
                        "completions.prompt",
                        "completions.max_tokens",
                        "completions.temperature",
                    ]
                };
                for key in keys {
                    let field = key.rsplit('.').next().unwrap();
                    assert!(
                        content.contains(&format!("\"{field}\"")) || content.contains(field),
                        "{key}"
                    );
                    assert!(docs["json_keys"][*key].is_string(), "{key}");
                }
            }
        }
    }
}

/// The ids plan gives the capture, re-resolved through the rule table on the capture path plan
/// uses, must capture exactly the boundaries plan says.
fn check_ids(plan: &Value, sel: &str, arch: &str, l: usize, ids_flag: bool) {
    let ids: Vec<i64> = plan["coverage"]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_i64().unwrap())
        .collect();
    let captured: Vec<usize> = plan["coverage"]["captured"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let sel = EngineSel::parse(sel).unwrap();
    let draft = if sel.path == Some("extract") {
        DraftIds {
            top: Some(ids.clone()),
            nested: None,
        }
    } else {
        DraftIds::nested(&ids)
    };
    let feed = resolve(&sel, Some(arch), &draft, l);
    assert_eq!(
        feed.boundaries(),
        captured.iter().map(|&b| Boundary(b)).collect::<Vec<_>>(),
        "{sel} on {arch}: ids {ids:?}"
    );
    let commands = engine_commands(plan).join("\n");
    let written = ids.iter().map(i64::to_string).collect::<Vec<_>>();
    if ids_flag {
        assert!(
            commands.contains(&format!(
                "--return-aux-hidden-state-layer-ids {}",
                written.join(" ")
            )),
            "{commands}"
        );
    } else {
        assert!(
            commands.contains(&format!(
                "\"eagle_aux_hidden_state_layer_ids\":[{}]",
                written.join(",")
            )),
            "{commands}"
        );
    }
}

#[test]
fn plan_sglang_llama_prints_documented_flags_and_rule_table_ids() {
    let plan = plan_json(&[
        "--target",
        &p(&fixture("models/llama")),
        "--engine",
        "sglang",
        "--tp",
        "2",
        "--draft",
        &p(&fixture("models/llama-draft")),
    ]);
    check_documented(&plan, "sglang@0.5.23");
    // Llama-family: sglang adds 1 to every id, and the capture-only flag takes no -1: b = 1..4
    // from ids 0..3; b = 0 and b = 5 from the embedding and the final norm.
    check_ids(&plan, "sglang@0.5.23", "llama", 5, true);
    assert_eq!(plan["coverage"]["ids"], serde_json::json!([0, 1, 2, 3]));
    assert!(engine_commands(&plan).join(" ").contains("--tp-size 2"));
}

#[test]
fn plan_sglang_deepseek_uses_the_first_id_rule() {
    let target = fixture("real-configs/target_deepseek-v3-671b__tt-metal_reference_config.json");
    let plan = plan_json(&[
        "--target",
        &p(&target),
        "--engine",
        "sglang",
        "--tp",
        "8",
        "--ep",
        "8",
        "--draft",
        &p(&fixture(
            "real-configs/draft_eagle3_deepseek-v3-671b__SpecForge.json",
        )),
    ]);
    check_documented(&plan, "sglang@0.5.23");
    // deepseek_v2.py: the first id is 0, so every id is raw: ids 0..60 capture b = 0..60.
    check_ids(&plan, "sglang@0.5.23", "deepseek_v3", 61, true);
    assert_eq!(plan["coverage"]["captured"].as_array().unwrap().len(), 61);
    assert_eq!(plan["coverage"]["ids"][0], 0);
    let commands = engine_commands(&plan).join(" ");
    assert!(
        commands.contains("--tp-size 8") && commands.contains("--ep-size 8"),
        "{commands}"
    );
    // Junctions of the served draft: what sglang feeds it.
    let junctions = plan["steps"][1].to_string();
    assert!(junctions.contains("b = [2, 30, 58]"), "{junctions}");
}

#[test]
fn plan_vllm_llama_uses_ids_raw() {
    let target = fixture(
        "real-configs/target_llama-3.1-8b__TensorRT-LLM_test_modeling_llama_LLAMA_3_1_8B_CONFIG.json",
    );
    let plan = plan_json(&[
        "--target",
        &p(&target),
        "--engine",
        "vllm",
        "--tp",
        "4",
        "--draft",
        &p(&fixture(
            "real-configs/draft_eagle3_llama3.1-8b__SpecForge.json",
        )),
    ]);
    check_documented(&plan, "vllm@0.33.0");
    // vLLM reads ids raw: 0..=32 capture b = 0..=32 (32 = the pre-norm final state).
    check_ids(&plan, "vllm:extract@0.33.0", "llama", 32, false);
    assert_eq!(plan["coverage"]["ids"].as_array().unwrap().len(), 33);
    assert_eq!(plan["coverage"]["ids"][0], 0);
}

#[test]
fn plan_vllm_deepseek_skips_the_embedding_and_sets_expert_parallel() {
    let target = fixture("real-configs/target_deepseek-v3-671b__tt-metal_reference_config.json");
    let plan = plan_json(&[
        "--target",
        &p(&target),
        "--engine",
        "vllm",
        "--tp",
        "8",
        "--ep",
        "16",
        "--draft",
        &p(&fixture(
            "real-configs/draft_eagle3_deepseek-v3-671b__SpecForge.json",
        )),
    ]);
    check_documented(&plan, "vllm@0.33.0");
    // vLLM's deepseek_v2 backbone crashes on id 0: ids 1..=61.
    check_ids(&plan, "vllm:extract@0.33.0", "deepseek_v3", 61, false);
    assert_eq!(plan["coverage"]["ids"][0], 1);
    let commands = engine_commands(&plan).join(" ");
    assert!(commands.contains("--enable-expert-parallel"), "{commands}");
    assert!(commands.contains("--data-parallel-size 2"), "{commands}");
    // The served draft's nested ids are not read by the V2 runner: its default.
    let junctions = plan["steps"][1].to_string();
    assert!(
        junctions.contains("\\\"eagle_aux_hidden_state_layer_ids\\\":[2,30,58]"),
        "{junctions}"
    );
}

#[test]
fn plan_text_and_json_hold_the_same_content() {
    let args = [
        "--target",
        &p(&fixture("models/llama")),
        "--engine",
        "sglang",
        "--draft",
        &p(&fixture("models/llama-draft")),
    ];
    let json = plan_json(&args);
    let text = run_plan(&args);
    assert_eq!(text.code, 0);
    for step in json["steps"].as_array().unwrap() {
        for key in ["commands", "notes"] {
            for line in step[key].as_array().unwrap() {
                assert!(
                    text.stdout.contains(line.as_str().unwrap()),
                    "{line} not in the text"
                );
            }
        }
        for file in step["files"].as_array().unwrap() {
            assert!(text.stdout.contains(file["content"].as_str().unwrap()));
        }
    }
    assert!(text.stdout.starts_with("#!/bin/sh\n"));
}

#[test]
fn plan_checks_the_prompts_file() {
    let dir = scratch("plan-prompts");
    let good = dir.join("good.jsonl");
    std::fs::write(
        &good,
        "{\"text\": \"The capital of France is\"}\n{\"input_ids\": [1, 23, 187]}\n",
    )
    .unwrap();
    let plan = plan_json(&[
        "--target",
        &p(&fixture("models/llama")),
        "--engine",
        "vllm",
        "--prompts",
        &p(&good),
    ]);
    assert!(
        plan["prompts"].as_str().unwrap().contains("(2 prompts)"),
        "{plan}"
    );
    let bad = dir.join("bad.jsonl");
    std::fs::write(&bad, "{\"text\": \"ok\"}\n{\"input_ids\": []}\n").unwrap();
    run_plan(&[
        "--target",
        &p(&fixture("models/llama")),
        "--engine",
        "vllm",
        "--prompts",
        &p(&bad),
    ])
    .assert_could_not_check(&["bad.jsonl:2", "input_ids"]);
}

#[test]
fn plan_refuses_what_it_cannot_plan() {
    let llama = p(&fixture("models/llama"));
    run_plan(&["--target", &llama, "--engine", "sglang@0.5.14"])
        .assert_could_not_check(&["sglang 0.5.23", "0.5.14 was not read"]);
    run_plan(&["--target", &llama, "--engine", "trtllm"]).assert_could_not_check(&["sglang, vllm"]);
    run_plan(&[
        "--target", &llama, "--engine", "sglang", "--tp", "2", "--ep", "4",
    ])
    .assert_could_not_check(&["--ep must divide --tp"]);
    run_plan(&[
        "--target", &llama, "--engine", "vllm", "--tp", "4", "--ep", "6",
    ])
    .assert_could_not_check(&["multiple of --tp"]);
    run_plan(&["--target", &p(&fixture("models/nope")), "--engine", "vllm"])
        .assert_could_not_check(&["nope"]);
}
