//! `eagle-check gate`: the static CI gate. Configs, engine rules and safetensors headers
//! against a capture spec, with no forward pass and no weight loaded; every check is the
//! judge's ([`crate::judge::statics`], [`crate::judge::feed`]).

use super::{Wanted, choose_engines, locate_opt, model_weights, target_info};
use crate::config::DraftConfig;
use crate::engine::EngineSel;
use crate::error::Result;
use crate::judge::{StaticInput, static_report};
use crate::locate;
use crate::report::Report;
use crate::spec::Spec;
use std::path::PathBuf;

/// `gate`'s flags.
pub struct GateOptions {
    pub spec: PathBuf,
    pub draft: PathBuf,
    pub target: Option<PathBuf>,
    /// Revision of the HF Hub ids given to target and draft.
    pub revision: Option<String>,
    pub engine: Option<String>,
}

/// `eagle-check gate`: reads the configs and weight headers the flags name and judges them.
pub fn execute(opts: &GateOptions) -> Result<Report> {
    let revision = opts.revision.as_deref();
    let draft = locate::locate_model(&opts.draft, revision)?;
    let target = locate_opt(opts.target.as_deref(), revision)?;
    let spec = Spec::load(&opts.spec)?;
    let engines = choose_engines(opts.engine.as_deref(), Some(&spec), Wanted::Several)?;
    let draft_cfg = DraftConfig::load(&draft)?;
    let target_info = target.as_deref().map(target_info).transpose()?;
    let weights = model_weights(&draft)?;
    let target_weights = target.as_deref().map(model_weights).transpose()?.flatten();
    gate(
        &StaticInput {
            spec: &spec,
            draft: Some(&draft_cfg),
            draft_weights: weights.as_ref(),
            target: target_info.as_ref(),
            target_weights: target_weights.as_ref(),
        },
        &engines,
    )
}

/// Runs every static check for each engine and returns the report.
pub fn gate(input: &StaticInput, engines: &[EngineSel]) -> Result<Report> {
    let (report, _, _) = static_report("gate", input, engines)?;
    Ok(report.finish())
}
