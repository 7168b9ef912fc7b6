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
                assert_eq!(n, 4, "{content}");
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

// ------------------------------------------------------------------------------------------
// The printed script as a user runs it: `sh dump.sh` where sh is dash (Debian, Ubuntu), against
// fixtures/engines/stub_engine.py, which answers like the engine (readiness after a delay,
// /health, /generate or /v1/completions, dump files, SIGTERM). The script starts
// `python3 -m sglang.launch_server` and `vllm serve`: the test puts a `sglang` package whose
// launch_server execs the stub first on PYTHONPATH, and a `vllm` that does first on PATH.
// Issue 29 lists the failures each test guards.

/// A scratch folder holding the stub engine's shims, two folders of "weights" and 2 prompts.
struct Cluster {
    dir: std::path::PathBuf,
}

impl Cluster {
    fn new(name: &str) -> Cluster {
        let dir = scratch(name);
        let stub = p(&fixture("engines/stub_engine.py"));
        let pkg = dir.join("py/sglang");
        std::fs::create_dir_all(&pkg).unwrap();
        std::fs::write(pkg.join("__init__.py"), "").unwrap();
        std::fs::write(
            pkg.join("launch_server.py"),
            format!(
                "import os, sys\nos.execvp(sys.executable, [sys.executable, {stub:?}, \"sglang\", *sys.argv[1:]])\n"
            ),
        )
        .unwrap();
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        let vllm = dir.join("bin/vllm");
        std::fs::write(
            &vllm,
            format!("#!/bin/sh\nexec python3 {stub:?} vllm \"$@\"\n"),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&vllm, std::fs::Permissions::from_mode(0o755)).unwrap();
        for weights in ["target-weights", "draft-weights"] {
            std::fs::create_dir_all(dir.join(weights)).unwrap();
            std::fs::write(dir.join(weights).join("model.safetensors"), "").unwrap();
        }
        std::fs::write(
            dir.join("prompts.jsonl"),
            "{\"text\": \"The capital of France is\"}\n\n{\"input_ids\": [1, 23, 187]}\n",
        )
        .unwrap();
        Cluster { dir }
    }

    /// `plan ARGS` (run in the cluster's folder), the script written to dump.sh.
    fn plan(&self, args: &[&str]) -> std::path::PathBuf {
        let out = crate::support::eagle_check_in(&self.dir, &[], [&["plan"], args].concat());
        assert_eq!(out.code, 0, "{}", out.stderr);
        let script = self.dir.join("dump.sh");
        std::fs::write(&script, out.stdout).unwrap();
        script
    }

    /// `dash dump.sh` against the stub, on a free port, killed after a minute.
    fn run(&self, script: &std::path::Path, env: &[(&str, &str)]) -> Output {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
            .to_string();
        let path = format!(
            "{}:{}",
            p(&self.dir.join("bin")),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut command = std::process::Command::new("dash");
        command
            .arg(script)
            .current_dir(&self.dir)
            .env("PATH", path)
            .env("PYTHONPATH", self.dir.join("py"))
            .env("EAGLE_CHECK_PORT", port)
            .env("EAGLE_CHECK_READY_TIMEOUT", "30")
            .env("EAGLE_CHECK_SETTLE_TIMEOUT", "20")
            .env("STUB_ENGINE_LOG", self.dir.join("engine.jsonl"))
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        for (k, v) in env {
            command.env(k, v);
        }
        let mut child = command.spawn().expect("dash runs (apt-get install dash)");
        let start = std::time::Instant::now();
        while child.try_wait().unwrap().is_none() {
            if start.elapsed() > std::time::Duration::from_secs(60) {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        crate::support::output(child.wait_with_output().unwrap())
    }

    /// The stub's events, one JSON object each.
    fn events(&self) -> Vec<Value> {
        std::fs::read_to_string(self.dir.join("engine.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Files of a dump folder.
    fn files(&self, rel: &str) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(self.dir.join(rel))
            .map(|d| {
                d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }
}

/// Every server the script started was ready before it got a prompt, stopped by SIGTERM before
/// the next one started, and is gone.
fn assert_servers_taken_in_turn(events: &[Value], servers: usize) {
    let mut started = Vec::new();
    for e in events {
        let pid = e["pid"].as_i64().unwrap();
        match e["event"].as_str().unwrap() {
            "started" => {
                if let Some(last) = started.last() {
                    assert!(
                        events
                            .iter()
                            .any(|s| s["event"] == "stopped" && s["pid"] == *last),
                        "a server started while the one before (PID {last}) still ran: {events:?}"
                    );
                }
                started.push(pid);
            }
            "POST" => assert_eq!(e["healthy"], true, "a prompt before the server was up: {e}"),
            "died" => panic!("the stub engine died: {e}"),
            _ => {}
        }
    }
    assert_eq!(started.len(), servers, "{events:?}");
    for pid in started {
        assert!(
            events
                .iter()
                .any(|e| e["event"] == "stopped" && e["pid"] == pid && e["signal"] == 15),
            "server {pid} was not stopped by SIGTERM: {events:?}"
        );
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "server {pid} still runs"
        );
    }
}

fn sglang_args(c: &Cluster) -> Vec<String> {
    vec![
        "--target".into(),
        p(&fixture("models/llama/config.json")),
        "--target-path".into(),
        "target-weights".into(),
        "--engine".into(),
        "sglang".into(),
        "--tp".into(),
        "2".into(),
        "--draft".into(),
        p(&fixture("models/llama-draft")),
        "--draft-path".into(),
        "draft-weights".into(),
        "--prompts".into(),
        p(&c.dir.join("prompts.jsonl")),
    ]
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// Issue 29: the patch YAML was written before its folder existed, the prompts were posted to a
/// server not yet up, `kill %1` left the first server holding the port under dash, the warm-up
/// request and /health's generation were dumped as sequences, and the model paths were a config
/// file's folder.
#[test]
fn plan_sglang_script_runs_under_dash_against_a_stub_engine() {
    let c = Cluster::new("plan-sglang-dash");
    let script = c.plan(&strs(&sglang_args(&c)));
    let out = c.run(&script, &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert_servers_taken_in_turn(&c.events(), 2);
    // 2 prompts: 2 sequences in each dump, none from a warm-up or a health check.
    for rel in [
        "eagle-check-dumps/sglang-reference/reference",
        "eagle-check-dumps/sglang-junctions/junctions",
    ] {
        assert_eq!(c.files(rel).len(), 2, "{rel}: {:?}", c.files(rel));
    }
    let listening: Vec<Value> = c
        .events()
        .into_iter()
        .filter(|e| e["event"] == "listening")
        .collect();
    let args = listening[1]["args"].to_string();
    assert!(
        args.contains("\"--model-path\",\"target-weights\"")
            && args.contains("\"--speculative-draft-model-path\",\"draft-weights\""),
        "{args}"
    );
}

#[test]
fn plan_vllm_script_runs_under_dash_and_waits_for_the_last_file() {
    let c = Cluster::new("plan-vllm-dash");
    let script = c.plan(&[
        "--target",
        &p(&fixture("models/llama")),
        "--target-path",
        "target-weights",
        "--engine",
        "vllm",
        "--draft",
        &p(&fixture("models/llama-draft")),
        "--draft-path",
        "draft-weights",
        "--prompts",
        &p(&c.dir.join("prompts.jsonl")),
    ]);
    let out = c.run(&script, &[]);
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    assert_servers_taken_in_turn(&c.events(), 2);
    // The connector writes each file after the response: every one must be there, whole.
    for rel in [
        "eagle-check-dumps/vllm-reference",
        "eagle-check-dumps/vllm-junctions",
    ] {
        let files: Vec<String> = c
            .files(rel)
            .into_iter()
            .filter(|f| f.ends_with(".safetensors"))
            .collect();
        assert_eq!(files.len(), 2, "{rel}: {:?}", c.files(rel));
        for f in files {
            let text = std::fs::read_to_string(c.dir.join(rel).join(&f)).unwrap();
            assert!(text.contains("\"max_tokens\": 1"), "{rel}/{f}: {text:?}");
        }
    }
}

/// A config file names neither the weights nor where they are: the script asks for them before
/// it starts anything (the old one passed the config file's folder as --model-path).
#[test]
fn plan_script_asks_for_the_weights_a_config_file_does_not_name() {
    let c = Cluster::new("plan-weights");
    let mut args = sglang_args(&c);
    args.drain(2..4); // no --target-path
    let script = c.plan(&strs(&args));
    let out = c.run(&script, &[]);
    assert_ne!(out.code, 0, "{}", out.stderr);
    assert!(
        out.stderr.contains("EAGLE_CHECK_TARGET") && out.stderr.contains("--target-path"),
        "{}",
        out.stderr
    );
    assert!(c.events().is_empty(), "{:?}", c.events());
    let out = c.run(&script, &[("EAGLE_CHECK_TARGET", "target-weights")]);
    assert_eq!(out.code, 0, "{}", out.stderr);
}

/// The server dying at start-up, or never answering, stops the script with a message, and no
/// prompt is sent.
#[test]
fn plan_script_stops_when_the_server_dies_or_never_answers() {
    let c = Cluster::new("plan-dies");
    let mut args = sglang_args(&c);
    args[3] = "no-such-weights".into();
    let script = c.plan(&strs(&args));
    let out = c.run(&script, &[]);
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr.contains("the server exited (status 1)")
            && out.stderr.contains("not a folder of weights"),
        "{}",
        out.stderr
    );
    let c = Cluster::new("plan-never-ready");
    let script = c.plan(&strs(&sglang_args(&c)));
    let out = c.run(
        &script,
        &[
            ("EAGLE_CHECK_READY_TIMEOUT", "3"),
            ("STUB_ENGINE_UNHEALTHY", "60"),
        ],
    );
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(
        out.stderr.contains("did not answer within 3 s"),
        "{}",
        out.stderr
    );
    let events = c.events();
    assert!(events.iter().all(|e| e["event"] != "POST"), "{events:?}");
    for e in events.iter().filter(|e| e["event"] == "started") {
        let pid = e["pid"].as_i64().unwrap();
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "server {pid} still runs after the script stopped"
        );
    }
}

#[test]
fn plan_scripts_parse_under_dash() {
    let deepseek = fixture("real-configs/target_deepseek-v3-671b__tt-metal_reference_config.json");
    let deepseek_draft = fixture("real-configs/draft_eagle3_deepseek-v3-671b__SpecForge.json");
    let llama = fixture("models/llama");
    let llama_draft = fixture("models/llama-draft");
    for engine in ["sglang", "vllm"] {
        for (target, draft) in [
            (&llama, None),
            (&llama, Some(&llama_draft)),
            (&deepseek, Some(&deepseek_draft)),
        ] {
            let mut args = vec![
                "--target".to_string(),
                p(target),
                "--engine".into(),
                engine.into(),
                "--tp".into(),
                "8".into(),
            ];
            if let Some(d) = draft {
                args.extend(["--draft".into(), p(d)]);
            }
            let out = run_plan(&strs(&args));
            assert_eq!(out.code, 0, "{}", out.stderr);
            let dir = scratch("plan-dash-n");
            let script = dir.join("dump.sh");
            std::fs::write(&script, &out.stdout).unwrap();
            let check = std::process::Command::new("dash")
                .arg("-n")
                .arg(&script)
                .output()
                .unwrap();
            assert!(
                check.status.success(),
                "{engine} {args:?}: {}",
                String::from_utf8_lossy(&check.stderr)
            );
            assert!(out.stdout.contains("\nset -eu\n"), "{}", out.stdout);
        }
    }
}

/// With a draft loaded, sglang applies the patch file a second time in the same process (the
/// draft's ModelRunner) and the real patcher fails on it (issue 29; proven with the wheel's
/// code by fixtures/engines/patch_twice.py): the file's first patch must turn later
/// applications into no-ops, on the line plan-flags.json records.
#[test]
fn plan_sglang_patch_applies_once_per_process() {
    let plan = plan_json(&[
        "--target",
        &p(&fixture("models/llama")),
        "--engine",
        "sglang",
        "--draft",
        &p(&fixture("models/llama-draft")),
    ]);
    let patch = plan["steps"][0]["files"][0]["content"].as_str().unwrap();
    let first = patch
        .lines()
        .map(str::trim)
        .skip_while(|l| !l.starts_with("- target:"))
        .take(4)
        .collect::<Vec<_>>();
    assert_eq!(
        first,
        [
            "- target: sglang.srt.debug_utils.dumper._Dumper.apply_source_patches",
            "edits:",
            "- match: \"config_path = self._config.source_patcher_config\"",
            "replacement: \"config_path = None\"",
        ],
        "{patch}"
    );
}

/// vLLM's reference reserves its stored states for --max-model-len tokens on every GPU: plan sets
/// it from the prompts and says what it costs (issue 29: 133 GiB per GPU at DeepSeek-V3's
/// default 163,840).
#[test]
fn plan_vllm_sets_max_model_len_and_tells_the_cost() {
    let dir = scratch("plan-cost");
    let prompts = dir.join("p.jsonl");
    let ids: Vec<String> = (0..300).map(|i| i.to_string()).collect();
    std::fs::write(
        &prompts,
        format!(
            "{{\"input_ids\": [{}]}}\n{{\"input_ids\": [1, 2]}}\n",
            ids.join(", ")
        ),
    )
    .unwrap();
    let args = [
        "--target",
        &p(&fixture(
            "real-configs/target_deepseek-v3-671b__tt-metal_reference_config.json",
        )),
        "--engine",
        "vllm",
        "--tp",
        "8",
        "--prompts",
        &p(&prompts),
    ];
    let plan = plan_json(&args);
    // 300 tokens and the generated one, rounded up to 256.
    assert_eq!(plan["max_model_len"], 512);
    assert!(engine_commands(&plan)[0].contains("--max-model-len 512"));
    let cost = &plan["steps"][0]["cost"];
    assert_eq!(cost["bytes_per_token"], 61 * 7168 * 2 + 8);
    assert_eq!(cost["dump_bytes"], 302 * (61 * 7168 * 2 + 8));
    assert_eq!(cost["device_bytes_per_gpu"], 512 * 61 * 7168 * 2);
    let text = run_plan(&args).stdout;
    assert!(
        text.contains("# cost: device memory: 447,741,952 bytes (427.0 MiB) on each of the 8 GPUs")
            && text.contains("# --max-model-len: 512"),
        "{text}"
    );
}
