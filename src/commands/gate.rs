//! `eagle-check gate`: the static CI gate. Configs, engine rules and safetensors headers
//! against a capture spec, with no forward pass and no weight loaded; every check is the
//! judge's ([`crate::judge::statics`], [`crate::judge::feed`]).

use crate::engine::EngineSel;
use crate::error::Result;
use crate::judge::{StaticInput, static_report};
use crate::report::Report;

/// Runs every static check for each engine and returns the report.
pub fn gate(input: &StaticInput, engines: &[EngineSel]) -> Result<Report> {
    let (report, _, _) = static_report("gate", input, engines)?;
    Ok(report.finish())
}
