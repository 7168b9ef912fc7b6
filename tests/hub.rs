//! HF Hub ids (`org/name`) resolved through a synthetic local HF cache: `HF_HUB_CACHE`, then
//! `HF_HOME/hub`; `refs/main`, `--revision` and `org/name@rev`; a clear one-line error when an
//! id is not cached (nothing is downloaded); a path on disk always wins over an id.

use crate::support::{eagle_check_in, fixture, p, root, scratch};
use std::path::{Path, PathBuf};

/// Puts `files` into `cache/models--{org}--{name}` as huggingface_hub does: content in
/// `blobs/`, `snapshots/{commit}/` holding links to the blobs, `refs/{ref}` naming the commit.
fn cache_model(cache: &Path, id: &str, commit: &str, refs: &[&str], files: &Path) -> PathBuf {
    let (org, name) = id.split_once('/').unwrap();
    let entry = cache.join(format!("models--{org}--{name}"));
    let snapshot = entry.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(entry.join("blobs")).unwrap();
    std::fs::create_dir_all(entry.join("refs")).unwrap();
    for file in std::fs::read_dir(files).unwrap() {
        let file = file.unwrap().path();
        let blob = entry.join("blobs").join(format!(
            "{commit}-{}",
            file.file_name().unwrap().to_string_lossy()
        ));
        std::fs::copy(&file, &blob).unwrap();
        let link = snapshot.join(file.file_name().unwrap());
        #[cfg(unix)]
        std::os::unix::fs::symlink(&blob, &link).unwrap();
        #[cfg(not(unix))]
        std::fs::copy(&blob, &link).unwrap();
    }
    for r in refs {
        std::fs::write(entry.join("refs").join(r), commit).unwrap();
    }
    snapshot
}

/// A draft directory holding one of the real configs as config.json.
fn draft_dir(dir: &Path, real_config: &str) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::copy(
        fixture(&format!("real-configs/{real_config}")),
        dir.join("config.json"),
    )
    .unwrap();
    dir.to_path_buf()
}

const DS_SPEC: &str = "specs/deepseek-v3-specforge.yaml";
const DS_CONFIG: &str = "draft_eagle3_deepseek-v3-671b__SpecForge.json";
const LLAMA_CONFIG: &str = "draft_eagle3_llama3.1-8b__SpecForge.json";

/// `run` with target and draft given as Hub ids: the tiny Llama bundle's models, cached.
#[test]
fn run_resolves_hub_ids_through_hf_hub_cache() {
    let dir = scratch("hub-run");
    let cache = dir.join("hub");
    let target = cache_model(
        &cache,
        "test-org/tiny-llama",
        "1111aaaa",
        &["main"],
        &fixture("bundles/tiny-llama/target"),
    );
    cache_model(
        &cache,
        "test-org/tiny-llama-eagle3",
        "2222bbbb",
        &["main"],
        &fixture("bundles/tiny-llama/draft"),
    );
    let out = eagle_check_in(
        &root(),
        &[("HF_HUB_CACHE", Some(&cache))],
        [
            "run",
            "--target",
            "test-org/tiny-llama",
            "--draft",
            "test-org/tiny-llama-eagle3",
            "--spec",
            &p(&fixture("bundles/tiny-llama/spec.yaml")),
            "--format",
            "json",
        ],
    );
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
    let json = out.json();
    assert_eq!(json["verdict"], "consistent");
    assert!(
        json["subject"]["target"]
            .as_str()
            .unwrap()
            .contains(&p(&target)),
        "{}",
        json["subject"]
    );
}

/// `gate --draft org/name` from `HF_HOME/hub` when `HF_HUB_CACHE` is unset; `--revision` and
/// `@rev` pick another snapshot (here a config whose ids vLLM's V1 runner reads one below).
#[test]
fn gate_reads_a_draft_from_hf_home_at_a_revision() {
    let dir = scratch("hub-gate");
    let home = dir.join("hf-home");
    let cache = home.join("hub");
    let main = cache_model(
        &cache,
        "test-org/drafter",
        "aaaa1111",
        &["main"],
        &draft_dir(&dir.join("llama"), LLAMA_CONFIG),
    );
    let v2 = cache_model(
        &cache,
        "test-org/drafter",
        "bbbb2222",
        &["v2"],
        &draft_dir(&dir.join("ds"), DS_CONFIG),
    );
    let env = [("HF_HUB_CACHE", None), ("HF_HOME", Some(home.as_path()))];
    let gate = |draft: &str, extra: &[&str]| {
        let mut args = vec![
            "gate", "--spec", DS_SPEC, "--draft", draft, "--engine", "vllm:v1", "--format", "json",
        ];
        args.extend(extra);
        eagle_check_in(&root(), &env, args)
    };
    let draft_fact =
        |out: &crate::support::Output| out.json()["subject"]["draft"].as_str().unwrap().to_string();
    // main: no ids, vLLM's default for L = 61 happens to be [2, 30, 58].
    let out = gate("test-org/drafter", &[]);
    assert_eq!(out.code, 0, "{}{}", out.stdout, out.stderr);
    assert!(draft_fact(&out).contains(&p(&main)), "{}", draft_fact(&out));
    for (draft, extra) in [
        ("test-org/drafter", &["--revision", "v2"][..]),
        ("test-org/drafter@v2", &[][..]),
        ("test-org/drafter@bbbb2222", &[][..]),
    ] {
        let out = gate(draft, extra);
        assert_eq!(
            out.code, 1,
            "{draft} {extra:?}: {}{}",
            out.stdout, out.stderr
        );
        assert_eq!(out.finding_names(), vec!["off-by-one"]);
        assert!(draft_fact(&out).contains(&p(&v2)), "{}", draft_fact(&out));
    }
    gate("test-org/drafter@v3", &[]).assert_could_not_check(&[
        "test-org/drafter",
        "revision `v3` is not cached",
        "cached refs: main, v2",
    ]);
}

#[test]
fn an_id_not_in_the_cache_is_one_line_naming_what_is_missing() {
    let dir = scratch("hub-missing");
    let cache = dir.join("hub");
    std::fs::create_dir_all(&cache).unwrap();
    let out = eagle_check_in(
        &root(),
        &[("HF_HUB_CACHE", Some(&cache))],
        [
            "gate",
            "--spec",
            DS_SPEC,
            "--draft",
            "nobody/no-such-drafter",
        ],
    );
    out.assert_could_not_check(&[
        "nobody/no-such-drafter",
        &p(&cache.join("models--nobody--no-such-drafter")),
        "never downloads",
    ]);
}

/// A directory `org/name` under the working directory is used, whatever the cache holds.
#[test]
fn a_path_on_disk_wins_over_a_hub_id() {
    let dir = scratch("hub-path-wins");
    let cache = dir.join("hub");
    cache_model(
        &cache,
        "test-org/drafter",
        "aaaa1111",
        &["main"],
        &draft_dir(&dir.join("llama"), LLAMA_CONFIG),
    );
    draft_dir(&dir.join("test-org").join("drafter"), DS_CONFIG);
    let out = eagle_check_in(
        &dir,
        &[("HF_HUB_CACHE", Some(&cache))],
        [
            "gate",
            "--spec",
            &p(&root().join(DS_SPEC)),
            "--draft",
            "test-org/drafter",
            "--engine",
            "vllm:v1",
            "--format",
            "json",
        ],
    );
    // The local directory holds the DeepSeek config (ids read one below on vLLM V1); the
    // cached one has no ids and would pass.
    assert_eq!(out.code, 1, "{}{}", out.stdout, out.stderr);
    let draft = out.json()["subject"]["draft"].as_str().unwrap().to_string();
    assert!(draft.contains("(test-org/drafter"), "{draft}");
}
