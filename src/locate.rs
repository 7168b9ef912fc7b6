//! Where models are: bundle directories, HF directories, HF cache entries and GGUF files,
//! resolved to the directory or file the loaders read.

use crate::config::{ModelConfig, TargetInfo};
use crate::error::{Error, Result};
use std::path::{Path, PathBuf};

/// The three parts of a bundle directory: `target/`, `draft/`, `spec.yaml`.
#[derive(Debug, Clone)]
pub struct Bundle {
    pub target: PathBuf,
    pub draft: Option<PathBuf>,
    pub spec: Option<PathBuf>,
    /// `tokens.txt` in the bundle, if any: the ids `run` uses when none are given.
    pub tokens: Option<PathBuf>,
}

impl Bundle {
    pub fn open(dir: &Path) -> Result<Bundle> {
        let target = dir.join("target");
        if !target.is_dir() {
            return Err(Error::Usage(format!(
                "{}: not a bundle (expected target/, draft/ and spec.yaml inside)",
                dir.display()
            )));
        }
        let opt = |p: PathBuf| p.exists().then_some(p);
        Ok(Bundle {
            target,
            draft: opt(dir.join("draft")),
            spec: opt(dir.join("spec.yaml")),
            tokens: opt(dir.join("tokens.txt")),
        })
    }
}

/// A model directory: an HF directory, or an HF cache entry `models--org--name` whose
/// `refs/main` names the snapshot to use.
pub fn resolve_model_dir(path: &Path) -> Result<PathBuf> {
    let snapshots = path.join("snapshots");
    if !snapshots.is_dir() {
        return Ok(path.to_path_buf());
    }
    if let Ok(rev) = std::fs::read_to_string(path.join("refs").join("main")) {
        let dir = snapshots.join(rev.trim());
        match std::fs::metadata(&dir) {
            Ok(m) if m.is_dir() => return Ok(dir),
            // A snapshot that refs/main names but that cannot be opened (a symlink loop, no
            // permission) is reported as it is; a missing one falls back to the listing.
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(Error::io(&dir, e));
            }
            _ => {}
        }
    }
    let mut revs: Vec<PathBuf> = std::fs::read_dir(&snapshots)
        .map_err(|e| Error::io(&snapshots, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    match revs.len() {
        1 => Ok(revs.remove(0)),
        0 => Err(Error::config(path, "HF cache entry without snapshots")),
        n => Err(Error::config(
            path,
            format!("{n} snapshots and no refs/main; pass the snapshots/<rev> directory"),
        )),
    }
}

/// A `.gguf` file (llama.cpp's format) rather than an HF directory.
pub fn is_gguf(path: &Path) -> bool {
    path.is_file() && path.extension().is_some_and(|x| x == "gguf")
}

/// The target's config, from `config.json` or from GGUF metadata.
pub fn target_config(path: &Path) -> Result<ModelConfig> {
    let dir = resolve_model_dir(path)?;
    if is_gguf(&dir) {
        Ok(crate::model::gguf::open_gguf(&dir)?.0)
    } else {
        ModelConfig::load(&dir)
    }
}

/// What the static checks need of a target, for any architecture (GGUF metadata included).
pub fn target_info(path: &Path) -> Result<TargetInfo> {
    let dir = resolve_model_dir(path)?;
    if is_gguf(&dir) {
        Ok(TargetInfo::from(&target_config(&dir)?))
    } else {
        TargetInfo::load(&dir)
    }
}

/// The target's tokenizer, when the model ships one (tokenizer.json or GGUF metadata).
pub fn tokenizer_for(target: &Path) -> Option<crate::tokenize::Tokenizer> {
    let dir = resolve_model_dir(target).ok()?;
    crate::tokenize::Tokenizer::open(&dir).ok()
}
