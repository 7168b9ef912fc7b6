//! Shared test helpers: run the binary, find fixtures, make scratch directories.

pub mod families;
pub mod parity;
pub mod synth;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository: `EAGLE_CHECK_ROOT` when set (a test binary carried to another machine, such
/// as the GPU one, runs against a copy of the repository elsewhere), else where it was built.
pub fn root() -> PathBuf {
    std::env::var_os("EAGLE_CHECK_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

pub fn fixture(rel: &str) -> PathBuf {
    root().join("fixtures").join(rel)
}

/// The capture corpus's entries (fixtures/captures/corpus/manifest.json).
pub fn corpus() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(fixture("captures/corpus/manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Corpus `entry`'s captures diffed against its target opened as `opts` says, batched or one
/// forward per sample (`per_sample`), with a pass budget of `budget` bytes.
pub fn diff_entry(
    entry: &serde_json::Value,
    opts: &eagle_check::model::TargetOptions,
    per_sample: bool,
    budget: Option<u64>,
) -> (
    eagle_check::report::Report,
    eagle_check::diff::DiffStats,
    eagle_check::diff::reference::RunnerReference,
) {
    use eagle_check::diff::{Batching, DiffInput, diff};
    let arch = entry["arch"].as_str().unwrap();
    let target = fixture(&format!("models/{arch}"));
    let mut reference = eagle_check::diff::reference::RunnerReference::open(&target, opts).unwrap();
    let spec =
        eagle_check::spec::Spec::load(&root().join(entry["spec"].as_str().unwrap())).unwrap();
    let captures = vec![root().join(entry["path"].as_str().unwrap())];
    let (report, stats) = diff(
        &DiffInput {
            spec: &spec,
            captures: &captures,
            feed: None,
            arch: None,
            batching: Batching { per_sample, budget },
        },
        &mut reference,
    )
    .unwrap();
    (report, stats, reference)
}

pub struct Output {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| {
            panic!(
                "stdout is not JSON ({e}):\n{}\nstderr: {}",
                self.stdout, self.stderr
            )
        })
    }

    /// Finding names in the JSON report.
    pub fn finding_names(&self) -> Vec<String> {
        self.json()["findings"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|f| f["name"].as_str().unwrap_or("").to_string())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Output {
    /// "Could not check": exit 2, nothing on stdout, one line on stderr holding every needle.
    pub fn assert_could_not_check(&self, needles: &[&str]) {
        assert_eq!(
            self.code, 2,
            "stdout: {}\nstderr: {}",
            self.stdout, self.stderr
        );
        assert!(self.stdout.is_empty(), "{}", self.stdout);
        assert_eq!(self.stderr.lines().count(), 1, "{}", self.stderr);
        for needle in needles {
            assert!(
                self.stderr.contains(needle),
                "`{needle}` not in {}",
                self.stderr
            );
        }
    }
}

/// The eagle-check binary: `EAGLE_CHECK_BIN` (the binary beside a carried test binary, see
/// `root`), else the one cargo built.
pub fn bin() -> PathBuf {
    std::env::var_os("EAGLE_CHECK_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_eagle-check")))
}

pub fn eagle_check<I, S>(args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    eagle_check_in(&root(), &[], args)
}

/// [`eagle_check`] in directory `dir`, with environment variables set (`Some`) or removed
/// (`None`).
pub fn eagle_check_in<I, S>(dir: &Path, env: &[(&str, Option<&Path>)], args: I) -> Output
where
    I: IntoIterator<Item = S>,
    S: AsRef<std::ffi::OsStr>,
{
    let mut command = Command::new(bin());
    command.args(args).current_dir(dir);
    for (key, value) in env {
        match value {
            Some(v) => command.env(key, v),
            None => command.env_remove(key),
        };
    }
    output(command.output().expect("the eagle-check binary runs"))
}

/// The exit code and both streams of a finished process.
pub fn output(out: std::process::Output) -> Output {
    Output {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A fresh scratch directory under the target dir, removed first if it exists.
pub fn scratch(name: &str) -> PathBuf {
    let dir = root().join("target").join("test-scratch").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// `gate --spec SPEC --draft DRAFT [--target TARGET] --engine ENGINE --format json`.
pub fn gate_json(spec: &Path, draft: &Path, target: Option<&Path>, engine: &str) -> Output {
    let mut args = vec![
        "gate".to_string(),
        "--spec".into(),
        p(spec),
        "--draft".into(),
        p(draft),
    ];
    if let Some(t) = target {
        args.extend(["--target".into(), p(t)]);
    }
    args.extend([
        "--engine".into(),
        engine.into(),
        "--format".into(),
        "json".into(),
    ]);
    eagle_check(args)
}

pub fn p(path: &Path) -> String {
    path.to_string_lossy().into_owned()
}
