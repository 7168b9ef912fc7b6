//! `eagle-check run`: execute the target and the draft on real tokens, capture every boundary
//! and the exact `fc` input an engine would assemble, and judge the layout against the spec.

use crate::boundary::{FinalNorm, format_list};
use crate::config::{DraftConfig, ModelConfig};
use crate::engine::{Engine, Feed, resolve};
use crate::error::{CandleContext, Error, Result};
use crate::gate::{GateInput, check_feed, gate};
use crate::model::draft::Eagle3Draft;
use crate::model::source::{SafetensorsSource, Vb, WeightSource};
use crate::model::{Capture, CaptureRequest, Progress, Target, load_target};
use crate::report::{Finding, FindingName, Report};
use crate::spec::Spec;
use crate::weights::WeightIndex;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
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
        if dir.is_dir() {
            return Ok(dir);
        }
    }
    let mut revs: Vec<PathBuf> = std::fs::read_dir(&snapshots)
        .map_err(|e| Error::io(&snapshots, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    match revs.len() {
        1 => Ok(revs.remove(0)),
        0 => Err(Error::Usage(format!(
            "{}: HF cache entry without snapshots",
            path.display()
        ))),
        n => Err(Error::Usage(format!(
            "{}: {n} snapshots and no refs/main; pass the snapshots/<rev> directory",
            path.display()
        ))),
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

/// A loaded target with its config.
pub struct LoadedTarget {
    pub cfg: ModelConfig,
    pub model: Box<dyn Target>,
}

/// Loads a target from an HF directory, an HF cache entry, or a GGUF file.
pub fn open_target(path: &Path, dtype: DType, device: &Device) -> Result<LoadedTarget> {
    let mut progress = Progress::new("loading target");
    let dir = resolve_model_dir(path)?;
    let (cfg, src): (ModelConfig, Box<dyn WeightSource>) = if is_gguf(&dir) {
        let (cfg, src) = crate::model::gguf::open_gguf(&dir)?;
        (cfg, Box::new(src))
    } else {
        (
            ModelConfig::load(&dir)?,
            Box::new(SafetensorsSource::open(&dir)?),
        )
    };
    let model = load_target(&cfg, src.as_ref(), dtype, device)?;
    progress.finish();
    Ok(LoadedTarget { cfg, model })
}

/// Everything `run` needs, resolved from the command line.
pub struct RunInput {
    pub target: PathBuf,
    pub draft: Option<PathBuf>,
    pub spec: Option<Spec>,
    pub engine: Engine,
    pub tokens: Vec<u32>,
    pub device: Device,
    pub dtype: DType,
    pub dump: Option<PathBuf>,
    /// Greedy tokens to generate after the input, to see that the target makes sense.
    pub generate: usize,
}

/// The `fc` input `feed` assembles from a capture: [T, k*H], slots in feed order. `b = L` is
/// taken on the side of the final norm the engine captures.
pub fn assemble_fc_input(feed: &Feed, capture: &Capture, num_layers: usize) -> Result<Tensor> {
    let mut parts = Vec::with_capacity(feed.slots.len());
    for slot in &feed.slots {
        let b = slot.boundary.index();
        let t = if b == num_layers && feed.engine.final_norm() == FinalNorm::Pre {
            capture.final_pre_norm.as_ref()
        } else {
            capture.hidden.get(&b)
        };
        parts.push(t.ok_or_else(|| Error::Usage(format!("boundary {b} was not captured")))?);
    }
    if parts.is_empty() {
        return Err(Error::Usage(format!(
            "{} feeds no slots to fc",
            feed.engine
        )));
    }
    Tensor::cat(&parts, 1).ctx(|| "assembling the fc input".to_string())
}

/// Runs target and draft and returns the report (and writes `--dump` if asked).
pub fn run(input: &RunInput) -> Result<Report> {
    let target = open_target(&input.target, input.dtype, &input.device)?;
    let cfg = &target.cfg;
    let l = cfg.num_layers;
    for &id in &input.tokens {
        if id as usize >= cfg.vocab_size {
            return Err(Error::Usage(format!(
                "token id {id} is outside the target's vocabulary (vocab_size {})",
                cfg.vocab_size
            )));
        }
    }
    if input.tokens.len() < 2 {
        return Err(Error::Usage("run needs at least 2 tokens".into()));
    }
    let draft_cfg = input.draft.as_deref().map(DraftConfig::load).transpose()?;

    let mut report = match (&input.spec, &draft_cfg) {
        // The static checks come first: same findings as `gate`, with the real target.
        (Some(spec), Some(draft)) => {
            let weights = match &input.draft {
                Some(d) if d.is_dir() => Some(WeightIndex::open(d)?).filter(|w| !w.is_empty()),
                _ => None,
            };
            let mut r = gate(&GateInput {
                spec,
                draft,
                draft_weights: weights.as_ref(),
                target: Some(cfg),
                target_weights: None,
                engines: &[input.engine],
            })?;
            r.command = "run".into();
            r
        }
        _ => {
            let mut r = Report::new("run");
            r.fact(
                "target",
                format!("{} ({})", cfg.model_type, input.target.display()),
            );
            r
        }
    };
    report.fact("engine", input.engine.to_string());
    report.fact("tokens", input.tokens.len().to_string());
    report.fact("device", format!("{:?}, {:?}", input.device, input.dtype));

    let ids_for_feed = draft_cfg.as_ref().and_then(|d| d.aux_layer_ids.clone());
    let feed = resolve(input.engine, ids_for_feed.as_deref(), l);
    let want = CaptureRequest {
        boundaries: if input.dump.is_some() {
            None
        } else {
            Some(feed.boundaries().iter().map(|b| b.index()).collect())
        },
        final_pre_norm: true,
        logits: true,
        layer_outputs: false,
    };
    let mut progress = Progress::new("target forward");
    let capture = target.model.forward(&input.tokens, &want, &mut progress)?;
    report.fact("fed_b", format_list(&feed.boundaries()));
    // A spec without a draft: judge what the engine feeds when no draft config names ids.
    if let (Some(spec), None) = (&input.spec, &draft_cfg) {
        let (rows, findings) = check_feed(&feed, spec, l);
        report.slots.extend(rows);
        report.findings.extend(findings);
    }

    let fc_input = assemble_fc_input(&feed, &capture, l).ok();
    if let (Some(draft), Some(dir), Some(fc_input)) = (&draft_cfg, &input.draft, &fc_input) {
        run_draft(
            &target,
            (draft, dir),
            &feed,
            fc_input,
            &capture,
            input,
            &mut report,
        )?;
    }
    if input.generate > 0 {
        let new = greedy_continuation(target.model.as_ref(), &input.tokens, input.generate)?;
        let text = match tokenizer_for(&input.target) {
            Some(tok) => format!("{:?}", tok.decode(&new)?),
            None => format!("{new:?}"),
        };
        report.fact("greedy_continuation", text);
    }
    if let Some(path) = &input.dump {
        write_dump(path, &input.tokens, &capture, fc_input.as_ref(), l)?;
        report.fact("dump", path.display().to_string());
    }
    Ok(report.finish())
}

/// Runs the draft on the fc input the engine assembled and records how often its greedy token
/// equals the target's: an offline glimpse of first-token acceptance.
fn run_draft(
    target: &LoadedTarget,
    (draft, dir): (&DraftConfig, &Path),
    feed: &Feed,
    fc_input: &Tensor,
    capture: &Capture,
    input: &RunInput,
    report: &mut Report,
) -> Result<()> {
    let target_hidden = draft.target_hidden(Some(target.cfg.hidden_size));
    let src = SafetensorsSource::open(dir)?;
    let fc_shape = ["fc.weight", "model.fc.weight"]
        .iter()
        .find_map(|n| src.shape(n));
    let slots = feed.slots.len();
    if let Some(shape) = &fc_shape
        && shape.get(1) != Some(&(slots * target_hidden))
    {
        report.findings.push(
            Finding::error(
                FindingName::Count,
                format!(
                    "{} assembles {slots} x {target_hidden} = {} features, but fc.weight is {shape:?}: \
                     the draft cannot run on it",
                    feed.engine,
                    slots * target_hidden
                ),
            )
            .with_engine(feed.engine),
        );
        return Ok(());
    }
    let vb = Vb::new(&src, input.dtype, &input.device);
    let model = Eagle3Draft::load(draft, &vb, target_hidden, slots)?;
    let tokens = &input.tokens;
    let t = tokens.len();
    // Training alignment: the feature at t pairs with the embedding of token t+1, and both
    // predict token t+2, which the target predicts from position t+1.
    let fc_prev = fc_input
        .narrow(0, 0, t - 1)
        .ctx(|| "fc input".to_string())?;
    let out = model.forward(&tokens[1..], &fc_prev, target.model.embed_tokens())?;
    if let Some(logits) = &capture.logits {
        let greedy: Vec<i64> = logits
            .argmax(1)
            .and_then(|a| a.to_dtype(DType::I64))
            .and_then(|a| a.to_vec1::<i64>())
            .ctx(|| "target argmax".to_string())?;
        let agree = out
            .next_target_ids
            .iter()
            .zip(&greedy[1..])
            .filter(|(d, g)| d == g)
            .count();
        report.fact(
            "draft_top1",
            format!(
                "{agree}/{} positions agree with the target's greedy token",
                t - 1
            ),
        );
    }
    Ok(())
}

/// The target's tokenizer, when the model ships one (tokenizer.json or GGUF metadata).
pub fn tokenizer_for(target: &Path) -> Option<crate::tokenize::Tokenizer> {
    let dir = resolve_model_dir(target).ok()?;
    crate::tokenize::Tokenizer::open(&dir).ok()
}

/// `n` greedy tokens after `tokens` (a full forward per token: this is a sanity check, not a
/// generator).
pub fn greedy_continuation(model: &dyn Target, tokens: &[u32], n: usize) -> Result<Vec<u32>> {
    let want = CaptureRequest {
        boundaries: Some(Vec::new()),
        final_pre_norm: false,
        logits: true,
        layer_outputs: false,
    };
    let mut seq = tokens.to_vec();
    for _ in 0..n {
        let cap = model.forward(&seq, &want, &mut Progress::hidden())?;
        let logits = cap
            .logits
            .ok_or_else(|| Error::Usage("the target returned no logits".into()))?;
        let last = logits
            .get(seq.len() - 1)
            .and_then(|row| row.argmax(0))
            .and_then(|a| a.to_dtype(DType::U32))
            .and_then(|a| a.to_scalar::<u32>())
            .ctx(|| "greedy token".to_string())?;
        seq.push(last);
    }
    Ok(seq[tokens.len()..].to_vec())
}

/// Writes the `--dump` safetensors: `input_ids` i64 [T], `hidden_states.{b}` f32 [T, H] for
/// b = 0..=L (HF semantics), `final_pre_norm` f32 [T, H], `fc_input` f32 [T, k*Ht].
/// Written to a temporary name and renamed, so a failure never leaves half a file.
pub fn write_dump(
    path: &Path,
    tokens: &[u32],
    capture: &Capture,
    fc_input: Option<&Tensor>,
    l: usize,
) -> Result<()> {
    let device = Device::Cpu;
    let mut out: HashMap<String, Tensor> = HashMap::new();
    let ids: Vec<i64> = tokens.iter().map(|&x| x as i64).collect();
    out.insert(
        "input_ids".into(),
        Tensor::new(ids.as_slice(), &device).ctx(|| "dump".into())?,
    );
    let f32_cpu = |t: &Tensor| {
        t.to_dtype(DType::F32)
            .and_then(|t| t.to_device(&Device::Cpu))
    };
    for b in 0..=l {
        let t = capture
            .hidden
            .get(&b)
            .ok_or_else(|| Error::Usage(format!("boundary {b} missing from the capture")))?;
        out.insert(
            format!("hidden_states.{b}"),
            f32_cpu(t).ctx(|| "dump".into())?,
        );
    }
    if let Some(t) = &capture.final_pre_norm {
        out.insert("final_pre_norm".into(), f32_cpu(t).ctx(|| "dump".into())?);
    }
    if let Some(t) = fc_input {
        out.insert("fc_input".into(), f32_cpu(t).ctx(|| "dump".into())?);
    }
    let tmp = path.with_extension("safetensors.partial");
    candle_core::safetensors::save(&out, &tmp).ctx(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
    Ok(())
}
