//! The CI integrations shipped in examples/ and .pre-commit-hooks.yaml, run as written.

use crate::support::{eagle_check, root};

const DS_SPEC: &str = "specs/deepseek-v3-specforge.yaml";
const DS_DRAFT: &str = "fixtures/real-configs/draft_eagle3_deepseek-v3-671b__SpecForge.json";

/// The example workflow's gate step, run with its own arguments: the `eagle-check gate` line is
/// read from examples/github-actions.yml and only its `$VARIABLES` are filled in.
#[test]
fn the_example_workflow_gates_a_config_with_its_own_arguments() {
    let text = std::fs::read_to_string(root().join("examples/github-actions.yml")).unwrap();
    let command = text
        .lines()
        .map(str::trim)
        .filter_map(|l| l.strip_prefix("run: ").or(Some(l)))
        .find(|l| l.starts_with("eagle-check gate "))
        .expect("a `eagle-check gate` line in the workflow");
    let run = |vars: &[(&str, &str)]| {
        let args: Vec<String> = command
            .split_whitespace()
            .skip(1)
            .map(|word| {
                let word = word.trim_matches('"');
                match word.strip_prefix('$') {
                    Some(var) => {
                        let var = var.trim_start_matches('{').trim_end_matches('}');
                        vars.iter()
                            .find(|(k, _)| *k == var)
                            .unwrap_or_else(|| panic!("the test does not set ${var}"))
                            .1
                            .to_string()
                    }
                    None => word.to_string(),
                }
            })
            .collect();
        assert!(args.contains(&"--format".to_string()) && args.contains(&"github".to_string()));
        eagle_check(&args)
    };
    let ok = run(&[
        ("EAGLE_CHECK_SPEC", DS_SPEC),
        ("EAGLE_CHECK_DRAFT", DS_DRAFT),
        ("EAGLE_CHECK_ENGINE", "sglang"),
    ]);
    assert_eq!(ok.code, 0, "{}{}", ok.stdout, ok.stderr);
    assert_eq!(
        ok.stdout, "verdict: consistent (0 errors, 0 warnings)\n",
        "{}",
        ok.stdout
    );
    let bad = run(&[
        ("EAGLE_CHECK_SPEC", DS_SPEC),
        ("EAGLE_CHECK_DRAFT", DS_DRAFT),
        ("EAGLE_CHECK_ENGINE", "vllm:v1"),
    ]);
    assert_eq!(bad.code, 1);
    assert!(bad.stdout.starts_with("::error file="), "{}", bad.stdout);
}

/// The pre-commit hook: its entry, with the arguments a user gives it, is a working gate, and
/// pre-commit passes no file names to it (gate takes one spec and one draft).
#[test]
fn the_pre_commit_hook_entry_runs_the_gate() {
    let text = std::fs::read_to_string(root().join(".pre-commit-hooks.yaml")).unwrap();
    let hooks: Vec<serde_json::Value> = serde_norway::from_str(&text).unwrap();
    let hook = hooks
        .iter()
        .find(|h| h["id"] == "eagle-check-gate")
        .expect("the eagle-check-gate hook");
    assert_eq!(hook["language"], "python");
    assert_eq!(hook["pass_filenames"], false);
    let entry: Vec<&str> = hook["entry"].as_str().unwrap().split_whitespace().collect();
    assert_eq!(entry[0], "eagle-check");
    let mut args: Vec<&str> = entry[1..].to_vec();
    args.extend(["--spec", DS_SPEC, "--draft", DS_DRAFT, "--engine", "sglang"]);
    let out = eagle_check(&args);
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
    args.pop();
    args.push("vllm:v1");
    assert_eq!(eagle_check(&args).code, 1);
}
