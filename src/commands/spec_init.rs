//! `eagle-check spec init`: the capture spec a trainer's own rule implies for a draft config.
//!
//! The trainers (SpecForge, SafeAILab EAGLE, Model-Optimizer, speculators) are rows of the
//! engine rule table ([`crate::engine::rules`]); the spec is what [`resolve`] says that row
//! captures for the draft's ids, so `gate --engine <trainer>` with the written spec is
//! consistent by construction, and a rule fixed in the table fixes both.

use super::{locate_opt, stem, target_info};
use crate::boundary::{FinalNorm, format_list};
use crate::config::DraftConfig;
use crate::engine::{Engine, EngineSel, IdProblem, resolve};
use crate::error::{Error, Result};
use crate::judge::ids_fact;
use crate::locate;
use crate::spec::{Spec, yaml_scalar};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The engines that train drafters, and the section of `fixtures/engines/FACTS.md` that
/// holds the upstream lines each rule was read from.
pub const TRAINERS: [(Engine, u32); 4] = [
    (Engine::Specforge, 4),
    (Engine::Modelopt, 5),
    (Engine::Speculators, 6),
    (Engine::Eagle, 7),
];

/// What `spec init` knows.
pub struct InitInput<'a> {
    pub draft: &'a DraftConfig,
    pub trainer: EngineSel,
    /// The target's decoder layer count L.
    pub num_layers: usize,
    /// The target's hidden size (`None`: the draft's `target_hidden_size`, else its own).
    pub hidden_size: Option<usize>,
    /// The target's `model_type`, which picks a trainer's per-architecture rule.
    pub model_type: Option<String>,
    /// The spec's `name`.
    pub name: String,
    /// Where the target's dimensions came from, for the header comment.
    pub target_origin: String,
}

/// `spec init`'s flags.
pub struct SpecInitOptions {
    pub draft: PathBuf,
    pub trainer: String,
    pub target: Option<PathBuf>,
    pub num_layers: Option<usize>,
    pub hidden_size: Option<usize>,
    pub model_type: Option<String>,
    pub name: Option<String>,
    pub revision: Option<String>,
}

/// `eagle-check spec init`: the trainer, the draft's config and the target's dimensions (from
/// `--target`, else the flags), then [`init`]'s spec text.
pub fn execute(opts: &SpecInitOptions) -> Result<String> {
    let trainer = trainer(&opts.trainer)?;
    let revision = opts.revision.as_deref();
    let draft = locate::locate_model(&opts.draft, revision)?;
    let target = locate_opt(opts.target.as_deref(), revision)?;
    let draft_cfg = DraftConfig::load(&draft)?;
    let (num_layers, hidden_size, model_type, target_origin) = match &target {
        Some(t) => {
            let info = target_info(t)?;
            (
                info.num_layers,
                Some(info.hidden_size),
                Some(info.family.name),
                format!("target {}", t.display()),
            )
        }
        None => (
            opts.num_layers.ok_or_else(|| {
                Error::Usage("spec init needs --target DIR or --num-layers N".into())
            })?,
            opts.hidden_size,
            opts.model_type.clone(),
            "--num-layers".to_string(),
        ),
    };
    init(&InitInput {
        draft: &draft_cfg,
        trainer,
        num_layers,
        hidden_size,
        model_type,
        name: opts
            .name
            .clone()
            .unwrap_or_else(|| default_name(&draft, &trainer)),
        target_origin,
    })
}

/// Writes the spec to `path`, which must not exist unless `force`.
pub fn write_spec(path: &Path, text: &str, force: bool) -> Result<()> {
    if path.exists() && !force {
        return Err(Error::Usage(format!(
            "{}: exists; pass --force to replace it",
            path.display()
        )));
    }
    std::fs::write(path, text).map_err(|e| Error::io(path, e))
}

/// Parses `--trainer`: one of the trainers, as `NAME[:PATH][@VERSION]`.
pub fn trainer(text: &str) -> Result<EngineSel> {
    let names = || {
        TRAINERS
            .iter()
            .map(|(e, _)| e.name())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let sel = EngineSel::parse(text).map_err(|e| Error::Usage(format!("--trainer: {e}")))?;
    if !TRAINERS.iter().any(|(e, _)| *e == sel.engine) {
        return Err(Error::Usage(format!(
            "--trainer: {} serves drafters, it does not train them (trainers: {})",
            sel.engine,
            names()
        )));
    }
    Ok(sel)
}

/// The spec (YAML, with comments citing the rule) the trainer's rule implies for the draft.
pub fn init(input: &InitInput) -> Result<String> {
    let draft = input.draft;
    let l = input.num_layers;
    let feed = resolve(&input.trainer, input.model_type.as_deref(), &draft.ids, l);
    let label = feed.engine_label();
    if feed.refused() {
        let why: Vec<String> = feed
            .problems
            .iter()
            .filter_map(|p| match p {
                IdProblem::Refused { reason } | IdProblem::Unsupported { reason } => {
                    Some(reason.clone())
                }
                _ => None,
            })
            .collect();
        return Err(Error::Config {
            path: draft.path.clone(),
            message: format!(
                "{label} would not train on this draft config ({}): {}",
                feed.describe(),
                why.join("; ")
            ),
        });
    }
    let boundaries = feed.boundaries();
    let hidden = draft.target_hidden(input.hidden_size);
    let section = TRAINERS
        .iter()
        .find(|(e, _)| *e == input.trainer.engine)
        .map_or(0, |(_, s)| *s);
    let rule = feed.rule;

    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Written by `eagle-check spec init --trainer {}` for {}.",
        input.trainer,
        draft.path.display()
    );
    let _ = writeln!(
        out,
        "# The trainer's rule ({label}, read at {}; eagle-check's engine table, fixtures/engines/FACTS.md section {section}):",
        rule.read
    );
    let _ = writeln!(out, "#   {}", rule.source);
    let _ = writeln!(out, "#   {}", feed.describe());
    let _ = writeln!(
        out,
        "# Draft ids: {} -> b = {} for L = {l} ({}).",
        ids_fact(&draft.ids),
        format_list(&boundaries),
        input.target_origin
    );
    for problem in &feed.problems {
        let line = match problem {
            IdProblem::OutOfRange { id, reason } => {
                format!("layer id {id} captures nothing ({reason}): training had one slot fewer")
            }
            IdProblem::Duplicate { id, collapsed } => format!(
                "layer id {id} repeats a position{}",
                if *collapsed {
                    ": captured once"
                } else {
                    ": the same state in two slots"
                }
            ),
            IdProblem::Unsorted { ids } => {
                format!("ids {ids:?} are not ascending: listed in the order the trainer captures")
            }
            IdProblem::NotRead { read, .. } => {
                format!("assumed: the trainer reads {read}")
            }
            IdProblem::Refused { reason } | IdProblem::Unsupported { reason } => reason.clone(),
        };
        let _ = writeln!(out, "# {line}");
    }
    for note in &feed.notes {
        let _ = writeln!(out, "# note: {note}");
    }
    if let Some(t) = &feed.target {
        let _ = writeln!(
            out,
            "# {label} also stores b = {}{} as the training target; it is not an fc slot.",
            t.boundary,
            t.norm.map_or(String::new(), |n| format!(" ({n})"))
        );
    }
    let _ = writeln!(out, "name: {}", yaml_scalar(&input.name));
    let mut target = format!("num_hidden_layers: {l}, hidden_size: {hidden}");
    if let Some(m) = &input.model_type {
        let _ = write!(target, ", model_type: {}", yaml_scalar(m));
    }
    let _ = writeln!(out, "target: {{ {target} }}");
    let _ = writeln!(out, "capture:");
    let list: Vec<String> = boundaries.iter().map(|b| b.to_string()).collect();
    let _ = writeln!(out, "  boundaries: [{}]", list.join(", "));
    let sides: Vec<FinalNorm> = feed
        .slots
        .iter()
        .filter(|s| s.boundary.0 == l)
        .filter_map(|s| s.norm)
        .collect();
    if let Some(side) = sides.first() {
        let _ = writeln!(out, "  final_norm: {}", side.spec_word());
    }
    let _ = writeln!(out, "fc: {{ in_features: {} }}", boundaries.len() * hidden);

    // What is written must read back as the spec it claims to be.
    let back = Spec::parse(&out, Path::new("<spec init>"))?;
    debug_assert_eq!(back.boundaries, boundaries);
    Ok(out)
}

/// The spec's default name: the draft's directory (or config file stem), then the trainer.
pub fn default_name(draft: &Path, trainer: &EngineSel) -> String {
    format!("{}-{}", stem(draft), trainer.engine)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_trainers_train() {
        assert_eq!(trainer("specforge").unwrap().engine, Engine::Specforge);
        assert_eq!(trainer("modelopt:vllm").unwrap().path, Some("vllm"));
        let err = trainer("sglang").unwrap_err().to_string();
        assert!(err.contains("does not train"), "{err}");
        assert!(
            err.contains("specforge, modelopt, speculators, eagle"),
            "{err}"
        );
    }
}
