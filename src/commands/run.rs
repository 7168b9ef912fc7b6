//! `eagle-check run`: execute the target and the draft on real tokens, capture every boundary
//! and the exact `fc` input an engine would assemble, and judge the layout against the spec.
//! The header-only checks run first, so a run the judge will refuse loads no weight.

use super::{
    DeviceChoice, ModelArgs, Models, TokenArgs, choose_engine, compute_dtype, input_tokens,
    open_device,
};
use crate::config::{DraftConfig, ModelConfig, TargetInfo};
use crate::engine::{EngineSel, Feed};
use crate::error::{CandleContext, Error, Result};
use crate::judge::{self, Dims, StaticInput};
use crate::locate::resolve_model_dir;
use crate::model::draft::{DraftOutput, Eagle3Draft};
use crate::model::source::{SafetensorsSource, Vb, WeightSource};
use crate::model::{
    Capture, CaptureRequest, EmbedRows, LoadedTarget, Progress, Target, TargetOptions,
    assemble_fc_input, open_target_with,
};
use crate::naming::{self, DraftTensor};
use crate::report::{Finding, FindingName, Report};
use crate::spec::Spec;
use crate::weights::WeightIndex;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Everything `run` needs, resolved from the command line.
pub struct RunInput {
    pub target: PathBuf,
    pub draft: Option<PathBuf>,
    pub spec: Option<Spec>,
    pub engine: EngineSel,
    pub tokens: Vec<u32>,
    /// Where the tokens came from, for messages (`--tokens`, a file, `--prompt`).
    pub tokens_origin: String,
    pub device: Device,
    pub dtype: DType,
    pub dump: Option<PathBuf>,
    /// Greedy tokens to generate after the input, to see that the target makes sense.
    pub generate: usize,
    /// `--stream-layers`: run the target one decoder layer at a time even when it fits.
    pub stream_layers: bool,
    /// `--max-memory` in bytes (else the memory available decides whether to stream).
    pub max_memory: Option<u64>,
}

/// `run`'s flags.
pub struct RunOptions {
    pub models: ModelArgs,
    pub engine: Option<String>,
    pub tokens: TokenArgs,
    pub device: DeviceChoice,
    pub dtype: Option<DType>,
    pub dump: Option<PathBuf>,
    pub generate: usize,
    pub stream_layers: bool,
    pub max_memory: Option<u64>,
}

/// `eagle-check run`: the models, engine and tokens the flags (or the bundle) name, then [`run`].
pub fn execute(opts: &RunOptions) -> Result<Report> {
    let models = Models::resolve(&opts.models, "run", None)?;
    let engine = choose_engine(
        opts.engine.as_deref(),
        models.spec.as_ref(),
        "name the engine that assembles the fc input: --engine NAME or `engine:` in the spec",
    )?;
    let (tokens, tokens_origin) =
        input_tokens(&opts.tokens, models.bundle.as_ref(), &models.target)?;
    let device = open_device(opts.device)?;
    run(&RunInput {
        target: models.target,
        draft: models.draft,
        spec: models.spec,
        engine,
        tokens,
        tokens_origin,
        dtype: compute_dtype(opts.dtype, &device),
        device,
        dump: opts.dump.clone(),
        generate: opts.generate,
        stream_layers: opts.stream_layers,
        max_memory: opts.max_memory,
    })
}

/// A model directory's safetensors headers, when it has any (GGUF files have none).
fn headers(path: &Path) -> Result<Option<WeightIndex>> {
    let dir = resolve_model_dir(path)?;
    if !dir.is_dir() {
        return Ok(None);
    }
    let index = WeightIndex::open(&dir)?;
    Ok((!index.is_empty()).then_some(index))
}

/// Runs target and draft and returns the report (and writes `--dump` if asked).
pub fn run(input: &RunInput) -> Result<Report> {
    // Headers and configs only: milliseconds, whatever the model's size.
    let cfg = super::target_config(&input.target)?;
    check_tokens(&cfg, &input.tokens, &input.tokens_origin)?;
    let draft_cfg = input.draft.as_deref().map(DraftConfig::load).transpose()?;
    let draft_weights = input.draft.as_deref().map(headers).transpose()?.flatten();
    let target_weights = headers(&input.target)?;
    let info = TargetInfo::from(&cfg);
    let (mut report, feed) = match &input.spec {
        Some(spec) => {
            let (report, _, mut feeds) = judge::static_report(
                "run",
                &StaticInput {
                    spec,
                    draft: draft_cfg.as_ref(),
                    draft_weights: draft_weights.as_ref(),
                    target: Some(&info),
                    target_weights: target_weights.as_ref(),
                },
                &[input.engine],
            )?;
            (report, feeds.remove(0))
        }
        None => {
            let mut r = Report::new("run");
            r.fact(
                "target",
                format!("{} ({})", cfg.model_type, input.target.display()),
            );
            let dims = Dims {
                num_layers: cfg.num_layers,
                target_hidden: cfg.hidden_size,
                arch: Some(cfg.family.name.clone()),
            };
            let feed = judge::feeds(draft_cfg.as_ref(), &dims, &[input.engine]).remove(0);
            r.fact(&format!("rule {}", feed.engine_label()), feed.describe());
            (r, feed)
        }
    };
    report.fact("engine", feed.engine_label());
    report.fact("tokens", input.tokens.len().to_string());
    report.fact("device", format!("{:?}, {:?}", input.device, input.dtype));
    report.fact("fed_b", feed.fed_words());
    if input.dump.is_none() && report.findings.iter().any(judge::blocks_forward) {
        report.fact(
            "forward",
            "not run: the header checks already fail (no weight was loaded)",
        );
        return Ok(report.finish());
    }

    let target = open_target_with(
        &input.target,
        &TargetOptions {
            dtype: input.dtype,
            device: input.device.clone(),
            stream_layers: input.stream_layers,
            max_memory: input.max_memory,
        },
    )?;
    let l = target.cfg.num_layers;
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
    target.model.keep_for_later(input.generate > 0);
    let capture = target.model.forward(&input.tokens, &want, &mut progress)?;

    let fc_input = assemble_fc_input(&feed, &capture, l).ok();
    let draft_out = match (&draft_cfg, &input.draft, &fc_input) {
        (Some(draft), Some(dir), Some(fc_input)) => run_draft(
            &target,
            (draft, dir),
            &feed,
            fc_input,
            &capture,
            input,
            &mut report,
        )?,
        _ => None,
    };
    if input.generate > 0 {
        let new = greedy_continuation(target.model.as_ref(), &input.tokens, input.generate)?;
        let text = match super::tokenizer_for(&input.target) {
            Some(tok) => format!("{:?}", tok.decode(&new)?),
            None => format!("{new:?}"),
        };
        report.fact("greedy_continuation", text);
    }
    if let Some(path) = &input.dump {
        write_dump(
            path,
            &input.tokens,
            &capture,
            fc_input.as_ref(),
            draft_out.as_ref(),
            l,
        )?;
        report.fact("dump", path.display().to_string());
    }
    crate::model::report::report_target(&mut report, &target);
    Ok(report.finish())
}

/// Token ids must index the target's vocabulary, and a draft needs two of them (it pairs the
/// state at t with the token at t + 1).
fn check_tokens(cfg: &ModelConfig, tokens: &[u32], origin: &str) -> Result<()> {
    if let Some(&id) = tokens.iter().find(|&&id| id as usize >= cfg.vocab_size) {
        return Err(Error::Tokens {
            origin: origin.to_string(),
            message: format!(
                "token id {id} is outside the target's vocabulary (vocab_size {})",
                cfg.vocab_size
            ),
        });
    }
    if tokens.len() < 2 {
        return Err(Error::Tokens {
            origin: origin.to_string(),
            message: format!("run needs at least 2 tokens, got {}", tokens.len()),
        });
    }
    Ok(())
}

/// The draft's predictions from an `fc` input, aligned as training aligns them: the feature at
/// position t pairs with the embedding of token t + 1 and both predict token t + 2, which the
/// target predicts from position t + 1. Returns the draft output for positions 0..T-1.
pub fn draft_step(
    model: &Eagle3Draft,
    tokens: &[u32],
    fc_input: &Tensor,
    target_embed: &dyn EmbedRows,
) -> Result<DraftOutput> {
    let t = tokens.len();
    let fc_prev = fc_input
        .narrow(0, 0, t - 1)
        .ctx(|| "fc input".to_string())?;
    model.forward(&tokens[1..], &fc_prev, target_embed)
}

/// How often the draft's greedy token (through `d2t`) equals the target's greedy next token,
/// position by position (`draft_next[t]` is compared with `target_greedy[t + 1]`).
pub fn agreement(draft_next: &[i64], target_greedy: &[i64]) -> (usize, usize) {
    let pairs = draft_next.iter().zip(target_greedy.iter().skip(1));
    let total = pairs.clone().count();
    (pairs.filter(|(d, g)| d == g).count(), total)
}

/// Runs the draft on the fc input the engine assembled and records how often its greedy token
/// equals the target's: an offline glimpse of first-token acceptance. `None` when the draft
/// cannot run on what the engine assembles (the finding says why).
fn run_draft(
    target: &LoadedTarget,
    (draft, dir): (&DraftConfig, &Path),
    feed: &Feed,
    fc_input: &Tensor,
    capture: &Capture,
    input: &RunInput,
    report: &mut Report,
) -> Result<Option<DraftOutput>> {
    let target_hidden = draft.target_hidden(Some(target.cfg.hidden_size));
    let src = SafetensorsSource::open(dir)?;
    let fc_shape = naming::find_draft(DraftTensor::Top("fc.weight"), &|n| src.shape(n).is_some())
        .and_then(|n| src.shape(&n));
    let slots = feed.fed_slots().len();
    if let Some(shape) = &fc_shape
        && shape.get(1) != Some(&(slots * target_hidden))
    {
        report.findings.push(
            Finding::error(
                FindingName::Count,
                format!(
                    "{} assembles {slots} x {target_hidden} = {} features, but fc.weight is {shape:?}: \
                     the draft cannot run on it",
                    feed.engine_label(),
                    slots * target_hidden
                ),
            )
            .with_engine(&feed.engine_label()),
        );
        return Ok(None);
    }
    let vb = Vb::new(&src, input.dtype, &input.device);
    let model = Eagle3Draft::load(draft, &vb, target_hidden, slots)?;
    let out = draft_step(&model, &input.tokens, fc_input, target.model.embeddings())?;
    if let Some(logits) = &capture.logits {
        let greedy: Vec<i64> = logits
            .argmax(1)
            .and_then(|a| a.to_dtype(DType::I64))
            .and_then(|a| a.to_vec1::<i64>())
            .ctx(|| "target argmax".to_string())?;
        let (agree, total) = agreement(&out.next_target_ids, &greedy);
        report.fact(
            "draft_top1",
            format!("{agree}/{total} positions agree with the target's greedy token"),
        );
    }
    Ok(Some(out))
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
    for i in 0..n {
        model.keep_for_later(i + 1 < n);
        let cap = model.forward(&seq, &want, &mut Progress::hidden())?;
        let logits = cap.logits.ok_or_else(|| Error::Capture {
            path: model.config().path.clone(),
            message: "the target returned no logits".into(),
        })?;
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
/// b = 0..=L (HF semantics), `final_pre_norm` f32 [T, H], `fc_input` f32 [T, k*Ht], and when the
/// draft ran, `draft_logits` f32 [T-1, Vd] and `draft_next_target_ids` i64 [T-1] (row t: the
/// feature at t with the embedding of token t + 1, predicting token t + 2).
/// Written to a temporary name and renamed, so a failure never leaves half a file.
pub fn write_dump(
    path: &Path,
    tokens: &[u32],
    capture: &Capture,
    fc_input: Option<&Tensor>,
    draft: Option<&DraftOutput>,
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
        let t = capture.hidden.get(&b).ok_or_else(|| Error::Capture {
            path: path.to_path_buf(),
            message: format!("boundary {b} missing from the capture"),
        })?;
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
    if let Some(d) = draft {
        out.insert(
            "draft_logits".into(),
            f32_cpu(&d.logits).ctx(|| "dump".into())?,
        );
        out.insert(
            "draft_next_target_ids".into(),
            Tensor::new(d.next_target_ids.as_slice(), &device).ctx(|| "dump".into())?,
        );
    }
    let tmp = path.with_extension("safetensors.partial");
    candle_core::safetensors::save(&out, &tmp).ctx(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io(path, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Draft row t (feature t, embedding of token t + 1) predicts token t + 2, which the target
    /// predicts from position t + 1.
    #[test]
    fn agreement_pairs_draft_row_t_with_the_target_at_t_plus_1() {
        let greedy = [5, 6, 7, 8, 9];
        assert_eq!(agreement(&[6, 7, 8, 9], &greedy), (4, 4));
        assert_eq!(agreement(&[5, 6, 7, 8], &greedy), (0, 4));
        assert_eq!(agreement(&[7, 8, 9, 0], &greedy), (0, 4));
    }
}
