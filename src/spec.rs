//! Capture specs (YAML in `specs/`): what a drafter's training data held, in canonical boundaries.
//!
//! Two spellings resolve to the same thing: `boundaries: [2, 30, 58]` (canonical b, fc order),
//! or the trainer's own words `layers: [1, 29, 57], convention: out, embedding: false`
//! (`out`: b = k + 1; `in`: b = k; `embedding: true` puts b = 0 first).

use crate::boundary::{Boundary, Convention, FinalNorm};
use crate::config::MAX_LAYERS;
use crate::engine::EngineSel;
use crate::error::{Error, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpecFile {
    name: String,
    #[serde(default)]
    engine: Option<String>,
    #[serde(default)]
    target: Option<TargetExpect>,
    capture: CaptureRaw,
    #[serde(default)]
    fc: Option<FcExpect>,
}

/// The target a spec was written for; checked when a target is given. `model_type` also picks
/// an engine's per-architecture rule when no target config is at hand.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetExpect {
    pub num_hidden_layers: Option<usize>,
    pub hidden_size: Option<usize>,
    pub model_type: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FcExpect {
    pub in_features: usize,
}

#[derive(Debug)]
struct CaptureFile {
    boundaries: Vec<Boundary>,
    final_norm: Option<FinalNorm>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CaptureRaw {
    boundaries: Option<Vec<i64>>,
    layers: Option<Vec<i64>>,
    convention: Option<Convention>,
    embedding: Option<bool>,
    final_norm: Option<FinalNorm>,
}

impl TryFrom<CaptureRaw> for CaptureFile {
    /// (the field at fault, the message)
    type Error = (&'static str, String);

    fn try_from(raw: CaptureRaw) -> std::result::Result<Self, Self::Error> {
        Self::validate(raw)
    }
}

impl CaptureFile {
    fn validate(raw: CaptureRaw) -> std::result::Result<Self, (&'static str, String)> {
        let to_boundary = |b: i64, field: &'static str, what: &str| match usize::try_from(b) {
            Err(_) => Err((
                field,
                format!(
                    "capture.{field}: {what} {b} is negative (boundaries start at 0, the embedding output)"
                ),
            )),
            Ok(b) if b > MAX_LAYERS => Err((
                field,
                format!(
                    "capture.{field}: {what} {b} is past any model's layers (eagle-check accepts up to {MAX_LAYERS})"
                ),
            )),
            Ok(b) => Ok(Boundary(b)),
        };
        let mut boundaries = match (raw.boundaries, raw.layers) {
            (Some(_), Some(_)) => {
                return Err((
                    "layers",
                    "capture: give either `boundaries` or `layers`, not both".into(),
                ));
            }
            (None, None) => {
                return Err((
                    "capture",
                    "capture: needs `boundaries` (canonical b) or `layers` + `convention`".into(),
                ));
            }
            (Some(bs), None) => {
                if raw.convention.is_some() {
                    return Err((
                        "convention",
                        "capture.convention applies to `layers`, not to `boundaries`".into(),
                    ));
                }
                bs.into_iter()
                    .map(|b| to_boundary(b, "boundaries", "boundary"))
                    .collect::<std::result::Result<Vec<_>, _>>()?
            }
            (None, Some(layers)) => {
                let convention = raw.convention.ok_or((
                    "layers",
                    "capture.layers needs `convention: out` (b = k + 1) or `convention: in` (b = k)".to_string(),
                ))?;
                layers
                    .into_iter()
                    .map(|k| match convention {
                        Convention::Out => {
                            to_boundary(k.saturating_add(1), "layers", "layer id + 1 =")
                        }
                        Convention::In => to_boundary(k, "layers", "layer id"),
                    })
                    .collect::<std::result::Result<Vec<_>, _>>()?
            }
        };
        if raw.embedding == Some(true) {
            if boundaries.contains(&Boundary::EMBEDDING) {
                return Err((
                    "embedding",
                    "capture.embedding is true but b = 0 is already listed".into(),
                ));
            }
            boundaries.insert(0, Boundary::EMBEDDING);
        }
        if boundaries.is_empty() {
            return Err(("capture", "capture: no boundaries".into()));
        }
        Ok(CaptureFile {
            boundaries,
            final_norm: raw.final_norm,
        })
    }
}

/// A resolved capture spec.
#[derive(Debug, Clone)]
pub struct Spec {
    pub path: PathBuf,
    pub name: String,
    /// The engine the spec is checked against when the command line names none.
    pub engine: Option<EngineSel>,
    pub target: Option<TargetExpect>,
    /// Canonical boundaries in `fc` order.
    pub boundaries: Vec<Boundary>,
    /// Which side of the final norm a `b = L` entry means, when the spec says.
    pub final_norm: Option<FinalNorm>,
    pub fc_in_features: Option<usize>,
}

impl Spec {
    pub fn load(path: &Path) -> Result<Spec> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Spec::parse(&text, path)
    }

    pub fn parse(text: &str, path: &Path) -> Result<Spec> {
        let spec_err = |message: String| Error::Spec {
            path: path.to_path_buf(),
            message,
        };
        let raw: SpecFile = serde_norway::from_str(text).map_err(|e| spec_err(yaml_message(&e)))?;
        if let Some(t) = &raw.target {
            for (key, value) in [
                ("num_hidden_layers", t.num_hidden_layers),
                ("hidden_size", t.hidden_size),
            ] {
                if let Some(v) = value {
                    crate::config::within(v, path, key).map_err(|_| {
                        spec_err(format!(
                            "line {}: target.{key} is {v}, more than eagle-check accepts",
                            first_line_with(text, key)
                        ))
                    })?;
                }
            }
        }
        if let Some(fc) = &raw.fc {
            crate::config::within(fc.in_features, path, "in_features").map_err(|_| {
                spec_err(format!(
                    "line {}: fc.in_features is {}, more than eagle-check accepts",
                    first_line_with(text, "in_features"),
                    fc.in_features
                ))
            })?;
        }
        let capture = CaptureFile::try_from(raw.capture).map_err(|(field, message)| {
            spec_err(format!("line {}: {message}", key_line(text, field)))
        })?;
        let engine = match raw.engine.as_deref() {
            None => None,
            Some(name) => Some(EngineSel::parse(name).map_err(|e| {
                spec_err(format!("line {}: engine: {e}", key_line(text, "engine")))
            })?),
        };
        Ok(Spec {
            path: path.to_path_buf(),
            name: raw.name,
            engine,
            target: raw.target,
            boundaries: capture.boundaries,
            final_norm: capture.final_norm,
            fc_in_features: raw.fc.map(|fc| fc.in_features),
        })
    }
}

/// The 1-based line where `key` is written inside the `capture` block (or at top level),
/// for semantic errors found after parsing, which serde cannot place.
fn key_line(text: &str, key: &str) -> usize {
    let is_key = |line: &str, key: &str| {
        let t = line.trim_start().trim_start_matches(['{', '-', ' ']);
        t.starts_with(key) && t[key.len()..].trim_start().starts_with(':')
    };
    let capture = text.lines().position(|l| is_key(l, "capture")).unwrap_or(0);
    for (i, line) in text.lines().enumerate().skip(capture) {
        if is_key(line, key) || line.contains(&format!("{key}:")) && i == capture {
            return i + 1;
        }
    }
    text.lines()
        .position(|l| is_key(l, key))
        .map_or(capture + 1, |i| i + 1)
}

/// The 1-based line where `key:` is first written, anywhere (flow mappings included).
fn first_line_with(text: &str, key: &str) -> usize {
    let needle = format!("{key}:");
    text.lines()
        .position(|l| l.contains(&needle))
        .map_or(1, |i| i + 1)
}

/// One line: "line 4, column 3: capture: unknown field `layer`, expected ...".
fn yaml_message(e: &serde_norway::Error) -> String {
    let text = e.to_string();
    // serde_norway appends " at line L column C"; put the position first.
    match (e.location(), text.rfind(" at line ")) {
        (Some(loc), Some(cut)) => format!(
            "line {}, column {}: {}",
            loc.line(),
            loc.column(),
            &text[..cut]
        ),
        (Some(loc), None) => format!("line {}, column {}: {}", loc.line(), loc.column(), text),
        _ => text,
    }
}

/// A YAML plain scalar, quoted when it could read as something else.
pub(crate) fn yaml_scalar(text: &str) -> String {
    let plain = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        && !text.starts_with(['-', '.'])
        && text.parse::<f64>().is_err()
        && !["true", "false", "null", "yes", "no", "on", "off", "~"]
            .contains(&text.to_ascii_lowercase().as_str());
    if plain {
        text.to_string()
    } else {
        format!("{text:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_are_quoted_when_yaml_would_misread_them() {
        assert_eq!(
            yaml_scalar("llama3.1-8b-specforge"),
            "llama3.1-8b-specforge"
        );
        assert_eq!(yaml_scalar("yes"), "\"yes\"");
        assert_eq!(yaml_scalar("1.0"), "\"1.0\"");
        assert_eq!(yaml_scalar("a b: c"), "\"a b: c\"");
    }

    fn parse(text: &str) -> Result<Spec> {
        Spec::parse(text, Path::new("t.yaml"))
    }

    #[test]
    fn both_spellings_resolve_alike() {
        let canonical = parse("name: a\ncapture:\n  boundaries: [2, 30, 58]\n").unwrap();
        let out =
            parse("name: a\ncapture: { layers: [1, 29, 57], convention: out, embedding: false }\n")
                .unwrap();
        let inn = parse("name: a\ncapture: { layers: [2, 30, 58], convention: in }\n").unwrap();
        assert_eq!(canonical.boundaries, out.boundaries);
        assert_eq!(canonical.boundaries, inn.boundaries);
        let emb =
            parse("name: a\ncapture: { layers: [1, 29, 57], convention: out, embedding: true }\n")
                .unwrap();
        assert_eq!(
            emb.boundaries,
            vec![Boundary(0), Boundary(2), Boundary(30), Boundary(58)]
        );
    }

    #[test]
    fn errors_name_line_and_field() {
        let err = parse("name: a\ncapture:\n  layer: [1, 2]\n")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("t.yaml: line 3"), "{err}");
        assert!(err.contains("layer"), "{err}");
        let err = parse("name: a\ncapture: { layers: [1, 2] }\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("convention"), "{err}");
        assert!(err.contains("line 2"), "{err}");
        let err = parse("name: a\nengine: tgi\ncapture: { boundaries: [1] }\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unknown engine `tgi`"), "{err}");
        let err = parse("name: a\ncapture: { boundaries: [-1] }\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("negative"), "{err}");
        let err = parse("capture: { boundaries: [1] }\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("name"), "{err}");
    }
}
