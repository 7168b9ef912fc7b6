//! Where models are: bundle directories, HF directories, HF cache entries, HF Hub ids found in
//! the local HF cache, and GGUF files, resolved to the directory or file the loaders read.

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
    resolve_model_dir_at(path, None)
}

/// [`resolve_model_dir`] at a revision: for an HF cache entry, the snapshot `refs/<revision>`
/// names, or `snapshots/<revision>` for a commit hash (`None`: `refs/main`, else the only
/// snapshot). A plain directory or file is returned as it is, whatever the revision.
pub fn resolve_model_dir_at(path: &Path, revision: Option<&str>) -> Result<PathBuf> {
    let snapshots = path.join("snapshots");
    if !snapshots.is_dir() {
        return Ok(path.to_path_buf());
    }
    let want = revision.unwrap_or("main");
    if let Ok(rev) = std::fs::read_to_string(path.join("refs").join(want)) {
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
        return Err(Error::config(
            path,
            format!(
                "refs/{want} names snapshot {} but snapshots/{} is not in the cache",
                rev.trim(),
                rev.trim()
            ),
        ));
    }
    if let Some(rev) = revision {
        let dir = snapshots.join(rev);
        if dir.is_dir() && !rev.contains(['/', '\\']) && rev != ".." {
            return Ok(dir);
        }
        return Err(Error::config(
            path,
            format!(
                "revision `{rev}` is not cached (no refs/{rev}, no snapshots/{rev}; cached refs: {})",
                cached_refs(path)
            ),
        ));
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

/// The refs an HF cache entry holds, for messages (`none` when it has none).
fn cached_refs(entry: &Path) -> String {
    let mut refs: Vec<String> = std::fs::read_dir(entry.join("refs"))
        .map(|dir| {
            dir.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().to_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    refs.sort();
    if refs.is_empty() {
        "none".to_string()
    } else {
        refs.join(", ")
    }
}

/// The HF Hub cache directory, as huggingface_hub finds it: `HF_HUB_CACHE`, else
/// `HF_HOME/hub`, else `XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
pub fn hf_hub_cache() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("HF_HUB_CACHE")
        .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface").join("hub")))
        .or_else(|| var("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))
}

/// An HF Hub id `org/name`, optionally `org/name@revision`: (org, name, revision). Anything
/// else (absolute or dotted paths, more than one `/`, characters the Hub refuses) is not one.
pub fn hub_id(text: &str) -> Option<(&str, &str, Option<&str>)> {
    let (id, revision) = match text.split_once('@') {
        Some((id, rev)) if !rev.is_empty() => (id, Some(rev)),
        Some(_) => return None,
        None => (text, None),
    };
    let (org, name) = id.split_once('/')?;
    let part = |p: &str| {
        !p.is_empty()
            && !p.starts_with(['.', '-'])
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    (part(org) && part(name)).then_some((org, name, revision))
}

/// A model argument as the command line gives it: a path that exists is used as it is (an HF
/// cache entry at `revision`); otherwise an HF Hub id `org/name[@revision]` is looked up in
/// the local HF cache ([`hf_hub_cache`]) and resolved to its snapshot directory. Never
/// downloads: an id that is not cached is an error naming the directory that is missing.
pub fn locate_model(arg: &Path, revision: Option<&str>) -> Result<PathBuf> {
    if arg.exists() {
        return resolve_model_dir_at(arg, revision);
    }
    let Some((org, name, at)) = arg.to_str().and_then(hub_id) else {
        return Ok(arg.to_path_buf());
    };
    let id = format!("{org}/{name}");
    let hub_err = |message: String| Error::Hub {
        id: id.clone(),
        message,
    };
    let cache = hf_hub_cache().ok_or_else(|| {
        hub_err(
            "no such path, and no HF cache to look in (set HF_HUB_CACHE or HF_HOME)".to_string(),
        )
    })?;
    let entry = cache.join(format!("models--{org}--{name}"));
    if !entry.is_dir() {
        return Err(hub_err(format!(
            "no such path, and not in the HF cache ({} is missing; eagle-check never downloads: \
             `huggingface-cli download {id}` first)",
            entry.display()
        )));
    }
    let revision = at.or(revision);
    resolve_model_dir_at(&entry, Some(revision.unwrap_or("main"))).map_err(|e| {
        hub_err(match e {
            Error::Config { message, .. } => format!("{}: {message}", entry.display()),
            other => other.to_string(),
        })
    })
}

/// A `.gguf` file (llama.cpp's format) rather than an HF directory.
pub fn is_gguf(path: &Path) -> bool {
    path.is_file() && path.extension().is_some_and(|x| x == "gguf")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_are_org_slash_name() {
        assert_eq!(
            hub_id("meta-llama/Llama-3.1-8B"),
            Some(("meta-llama", "Llama-3.1-8B", None))
        );
        assert_eq!(hub_id("org/name@v1.0"), Some(("org", "name", Some("v1.0"))));
        for not in [
            "name",
            "/abs/path",
            "./org/name",
            "../org/name",
            "org/name/extra",
            "org/",
            "org/name@",
            "org/na me",
        ] {
            assert_eq!(hub_id(not), None, "{not}");
        }
    }
}
