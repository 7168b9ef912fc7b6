//! `eagle-check diff`: what each slot of captured tensors really is, against reference states
//! from the target run here or from a dump of every layer. Every refusal that needs no weight
//! (a spec for another layer count, a missing capture folder, no engine for the three-way
//! table) comes before the target's first weight is read.

use super::{DeviceChoice, choose_engine, compute_dtype, locate_opt, open_device, target_info};
use crate::config::{DraftConfig, TargetInfo};
use crate::diff::dump_ref::DumpReference;
use crate::diff::names::NameMap;
use crate::diff::reference::{Counted, ReferenceOptions, ReferenceSource, RunnerReference};
use crate::diff::{Batching, DiffInput, check_captures, check_spec_layers, diff};
use crate::engine::{EngineSel, Feed, resolve};
use crate::error::{Error, Result};
use crate::model::TargetOptions;
use crate::progress;
use crate::report::Report;
use crate::spec::Spec;
use crate::tokenize::read_token_file;
use candle_core::DType;
use std::path::PathBuf;

/// `diff`'s flags.
pub struct DiffOptions {
    pub spec: PathBuf,
    pub target: Option<PathBuf>,
    pub captures: Vec<PathBuf>,
    pub reference: Option<PathBuf>,
    /// `--reference-map` lines (`REGEX=QUANTITY`, or files of them).
    pub reference_map: Vec<String>,
    pub reference_tokens: Option<PathBuf>,
    pub draft: Option<PathBuf>,
    pub revision: Option<String>,
    pub engine: Option<String>,
    pub device: DeviceChoice,
    pub dtype: Option<DType>,
    pub stream_layers: bool,
    pub max_memory: Option<u64>,
}

/// What the set-up read and decided, before any reference state exists.
struct Setup {
    spec: Spec,
    target: Option<PathBuf>,
    target_shape: Option<TargetInfo>,
    /// The target's architecture: its config's family, else the spec's `target.model_type`.
    arch: Option<String>,
    /// The draft's config and the engine that feeds it (`--draft`: the three-way table).
    draft: Option<(DraftConfig, EngineSel)>,
}

/// Set-up, reference, comparison: the three phases of `diff`.
pub fn execute(opts: &DiffOptions) -> Result<Report> {
    let setup = set_up(opts)?;
    let mut source = open_reference(opts, &setup)?;
    progress::trace(|| "diff: reference open".into());
    let report = compare(opts, &setup, source.as_mut());
    progress::trace(|| "diff: compared; dropping the reference".into());
    drop(source);
    progress::trace(|| "diff: reference dropped".into());
    report
}

/// Configs, spec and capture listing only: milliseconds, whatever the target's size.
fn set_up(opts: &DiffOptions) -> Result<Setup> {
    let revision = opts.revision.as_deref();
    let target = locate_opt(opts.target.as_deref(), revision)?;
    let draft = locate_opt(opts.draft.as_deref(), revision)?;
    let spec = Spec::load(&opts.spec)?;
    let target_shape = target.as_deref().map(target_info).transpose()?;
    if let Some(shape) = &target_shape {
        check_spec_layers(&spec, shape.num_layers)?;
    }
    check_captures(&opts.captures)?;
    let arch = target_shape
        .as_ref()
        .map(|t| t.family.name.clone())
        .or_else(|| spec.target.as_ref().and_then(|t| t.model_type.clone()));
    let draft = match &draft {
        Some(d) => {
            let draft_cfg = DraftConfig::load(d)?;
            let sel = choose_engine(
                opts.engine.as_deref(),
                Some(&spec),
                "--draft needs an engine: --engine NAME or `engine:` in the spec",
            )?;
            Some((draft_cfg, sel))
        }
        None => None,
    };
    Ok(Setup {
        spec,
        target,
        target_shape,
        arch,
        draft,
    })
}

/// The reference states: a dump of every layer (`--reference`), else the target, loaded.
fn open_reference(opts: &DiffOptions, setup: &Setup) -> Result<Box<dyn ReferenceSource>> {
    let spec_target = setup.spec.target.as_ref();
    match (&opts.reference, &setup.target) {
        (Some(path), _) => {
            let map = if opts.reference_map.is_empty() {
                None
            } else {
                Some(NameMap::parse(&opts.reference_map).map_err(Error::Usage)?)
            };
            let tokens = opts
                .reference_tokens
                .as_ref()
                .map(|p| -> Result<_> {
                    let ids = read_token_file(p)?;
                    Ok((ids.into_iter().map(i64::from).collect(), p.clone()))
                })
                .transpose()?;
            let shape = setup.target_shape.as_ref();
            let reference = ReferenceOptions {
                map,
                tokens,
                num_layers: shape
                    .map(|t| t.num_layers)
                    .or_else(|| spec_target.and_then(|t| t.num_hidden_layers)),
                hidden_size: shape
                    .map(|t| t.hidden_size)
                    .or_else(|| spec_target.and_then(|t| t.hidden_size)),
            };
            Ok(Box::new(DumpReference::open_with(path, &reference)?))
        }
        (None, Some(path)) => {
            let dev = open_device(opts.device)?;
            let target = TargetOptions {
                stream_layers: opts.stream_layers,
                max_memory: opts.max_memory,
                ..TargetOptions::new(compute_dtype(opts.dtype, &dev), &dev)
            };
            Ok(Box::new(RunnerReference::open(path, &target)?))
        }
        (None, None) => Err(Error::Usage("diff needs --target or --reference".into())),
    }
}

/// The engine's feed for the draft's ids, over the reference's layer count.
fn feed(setup: &Setup, num_layers: usize) -> Option<Feed> {
    let (draft_cfg, sel) = setup.draft.as_ref()?;
    Some(resolve(
        sel,
        setup.arch.as_deref(),
        &draft_cfg.ids,
        num_layers,
    ))
}

/// Every capture against the reference, counted on a spinner; the report names the spec.
fn compare(opts: &DiffOptions, setup: &Setup, source: &mut dyn ReferenceSource) -> Result<Report> {
    let feed = feed(setup, source.num_layers());
    let held = source.held_bytes();
    let mut counted = Counted::new(source, "samples compared");
    let (mut report, _) = diff(
        &DiffInput {
            spec: &setup.spec,
            captures: &opts.captures,
            feed: feed.as_ref(),
            arch: setup.arch.as_deref(),
            // --max-memory bounds the runner's weights, its forward and the pass's samples
            // together: of what the weights leave, half for the samples (their
            // identification), half for the forward's activations.
            batching: Batching {
                per_sample: false,
                budget: opts.max_memory.map(|b| b.saturating_sub(held) / 2),
            },
        },
        &mut counted,
    )?;
    counted.finish();
    report.sources.spec = Some(setup.spec.path.clone());
    Ok(report)
}
