//! `eagle-check probe`: what each layout costs in acceptance, and which layout a drafter was
//! trained on, from its weights alone. The target runs once per token set and every boundary
//! is kept; then, for each candidate layout, only the draft runs.
//!
//! Per position t of a token set (rows 0..T-2): the draft takes the feature of position t and
//! the embedding of token t + 1 (the training alignment) and its greedy token through `d2t` is
//! compared with the target's greedy token at t + 1 (first-token acceptance). Its cross-entropy
//! against the target's distribution at t + 1 over the draft vocabulary (SpecForge's training
//! target: `specforge/algorithms/eagle3/model.py` `_compute_target_p`, the target softmax over
//! the `t2d` ids) ranks the layouts. A chain of `steps` greedy draft tokens feeds step j the
//! draft's own previous token and its own pre-norm hidden state, with EAGLE-3's training-time
//! test attention (`model::draft`), and counts the leading steps whose token equals the target's
//! greedy token at t + 1 + j: the accepted length. The target side is teacher-forced on the
//! token set's text, as training's figures are.

pub mod layout;
pub mod search;

use super::{
    DeviceChoice, ModelArgs, Models, TokenArgs, Wanted, choose_engines, compute_dtype,
    input_tokens, open_device,
};
use crate::config::{DraftConfig, ModelConfig, TargetInfo};
use crate::engine::{EngineSel, Feed};
use crate::error::{CandleContext, Error, Result};
use crate::judge::{self, Dims, StaticInput, acceptance};
use crate::locate;
use crate::model::draft::{Chain, Eagle3Draft, open_draft};
use crate::model::{
    Capture, CaptureRequest, LoadedTarget, ManyOptions, Produced, Progress, TargetOptions,
    open_target_with,
};
use crate::report::{ProbeRow, Report};
use crate::spec::Spec;
use crate::stats::{Estimate, Resampler};
use crate::tokenize::{Tokenizer, read_prompts};
use crate::weights::WeightIndex;
use candle_core::{D, DType, Device, Tensor};
use layout::{Candidates, Layout, Side, Tap, neighbours};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// `probe`'s flags.
pub struct ProbeOptions {
    pub models: ModelArgs,
    pub engine: Option<String>,
    pub tokens: TokenArgs,
    /// `--prompts`: a JSON-lines file, each line a token set of its own.
    pub prompts: Option<PathBuf>,
    pub steps: usize,
    pub search: bool,
    pub write_spec: Option<PathBuf>,
    pub seed: u64,
    pub stream_layers: bool,
    pub max_memory: Option<u64>,
    pub device: DeviceChoice,
    pub dtype: Option<DType>,
}

const NO_DRAFT: &str = "probe needs a draft: a bundle with draft/, or --draft";

/// `eagle-check probe`: the models, engines and token sets the flags (or the bundle) name,
/// then [`probe`].
pub fn execute(opts: &ProbeOptions) -> Result<Report> {
    if opts.steps == 0 {
        return Err(Error::Usage("--steps must be at least 1".into()));
    }
    let models = Models::resolve(&opts.models, "probe", Some(NO_DRAFT))?;
    let draft = models.draft.ok_or_else(|| Error::Usage(NO_DRAFT.into()))?;
    let engines = choose_engines(
        opts.engine.as_deref(),
        models.spec.as_ref(),
        Wanted::Several,
    )?;
    let token_sets = match &opts.prompts {
        Some(file) => {
            let dir = locate::resolve_model_dir(&models.target)?;
            let tokenizer = Tokenizer::open(&dir).ok();
            read_prompts(file, tokenizer.as_ref())?
                .into_iter()
                .map(|p| TokenSet {
                    origin: p.origin,
                    tokens: p.ids,
                })
                .collect()
        }
        None => {
            let (tokens, origin) =
                input_tokens(&opts.tokens, models.bundle.as_ref(), &models.target)?;
            vec![TokenSet { origin, tokens }]
        }
    };
    let device = open_device(opts.device)?;
    probe(&ProbeInput {
        target: models.target,
        draft,
        spec: models.spec,
        engines,
        token_sets,
        steps: opts.steps,
        search: opts.search,
        write_spec: opts.write_spec.clone(),
        dtype: compute_dtype(opts.dtype, &device),
        device,
        stream_layers: opts.stream_layers,
        max_memory: opts.max_memory,
        seed: opts.seed,
    })
}

/// One sequence of token ids the target runs on.
pub struct TokenSet {
    /// Where it came from, for messages (`tokens.txt`, `prompts.jsonl line 3`).
    pub origin: String,
    pub tokens: Vec<u32>,
}

/// Everything `probe` needs, resolved from the command line.
pub struct ProbeInput {
    pub target: PathBuf,
    pub draft: PathBuf,
    pub spec: Option<Spec>,
    /// The engines whose fed layouts are judged (and tried).
    pub engines: Vec<EngineSel>,
    pub token_sets: Vec<TokenSet>,
    /// Draft tokens per greedy chain (1: first-token figures only).
    pub steps: usize,
    /// Also search every k-slot layout for the one the drafter predicts best from.
    pub search: bool,
    /// With `search`: write the layout found as a capture spec here.
    pub write_spec: Option<PathBuf>,
    pub device: Device,
    pub dtype: DType,
    /// `--stream-layers`: the target one decoder layer at a time.
    pub stream_layers: bool,
    /// `--max-memory` in bytes.
    pub max_memory: Option<u64>,
    /// Seed of the bootstrap draws.
    pub seed: u64,
}

/// What the target gave for one token set, kept for every draft pass.
pub(crate) struct SetData {
    pub tokens: Vec<u32>,
    /// b = 0..=L in HF semantics (b = L after the final norm), [T, Ht], compute dtype.
    pub states: Vec<Tensor>,
    /// [T, Ht]: after the last layer, before the final norm.
    pub pre_norm: Tensor,
    /// [T-1, Vd] f32: the target's distribution at positions 1..T over the draft vocabulary.
    pub target_p: Tensor,
    /// The target's greedy token at every position.
    pub greedy: Vec<i64>,
}

impl SetData {
    /// Draft rows: positions 0..T-2.
    pub fn rows(&self) -> usize {
        self.tokens.len() - 1
    }

    /// The target state a tap names, rows 0..T-2 (the features the draft rows take).
    pub fn tap(&self, tap: Tap) -> Result<Tensor> {
        let t = match tap.norm {
            Some(Side::Pre) => &self.pre_norm,
            _ => &self.states[tap.b],
        };
        t.narrow(0, 0, self.rows()).ctx(|| format!("b = {tap}"))
    }
}

/// Per-position figures of one layout over every token set, flattened in set order (NaN where
/// a position has no value).
#[derive(Debug, Clone, Default)]
pub(crate) struct Series {
    pub accepted: Vec<f64>,
    pub cross_entropy: Vec<f64>,
    pub length: Vec<f64>,
}

impl Series {
    fn extend(&mut self, other: Series) {
        self.accepted.extend(other.accepted);
        self.cross_entropy.extend(other.cross_entropy);
        self.length.extend(other.length);
    }
}

/// The target and draft, loaded, with the captured token sets.
pub(crate) struct Probe {
    pub draft: Eagle3Draft,
    pub target: LoadedTarget,
    pub sets: Vec<SetData>,
    pub k: usize,
    /// Draft passes run so far (one per layout per token set per chain step).
    pub passes: usize,
}

impl Probe {
    /// Runs the draft chain on `fc_out` (per set: [T-1, H], the fc output of a layout's
    /// features, or something shaped like it) and scores every position.
    pub fn score_fc(&mut self, fc_outs: &[Tensor], steps: usize) -> Result<Series> {
        let mut all = Series::default();
        let embed = self.target.model.embeddings();
        for (set, fc_out) in self.sets.iter().zip(fc_outs) {
            let rows = set.rows();
            let mut chain = Chain::default();
            let step0 = self
                .draft
                .step(&set.tokens[1..], fc_out, embed, Some(&mut chain))?;
            self.passes += 1;
            let ce = cross_entropy(&step0.logits, &set.target_p)?;
            let mut preds = vec![step0.next_target_ids];
            let mut hidden = step0.hidden;
            for _ in 1..steps {
                let ids: Vec<u32> = preds[preds.len() - 1]
                    .iter()
                    .map(|&t| t.clamp(0, u32::MAX as i64) as u32)
                    .collect();
                let step = self.draft.step(&ids, &hidden, embed, Some(&mut chain))?;
                self.passes += 1;
                hidden = step.hidden;
                preds.push(step.next_target_ids);
            }
            let accepted = (0..rows)
                .map(|t| f64::from(u8::from(preds[0][t] == set.greedy[t + 1])))
                .collect();
            let length = (0..rows)
                .map(|t| {
                    if t + steps > rows {
                        return f64::NAN;
                    }
                    (0..steps)
                        .take_while(|&j| preds[j][t] == set.greedy[t + 1 + j])
                        .count() as f64
                })
                .collect();
            all.extend(Series {
                accepted,
                cross_entropy: ce,
                length,
            });
        }
        Ok(all)
    }

    /// The fc outputs of `layout` per set, `rotate`d by half of each set's rows for the control.
    pub fn fc_outs(&self, layout: &Layout, rotate: bool) -> Result<Vec<Tensor>> {
        self.sets
            .iter()
            .map(|set| {
                let parts = layout
                    .0
                    .iter()
                    .map(|&tap| set.tap(tap))
                    .collect::<Result<Vec<_>>>()?;
                let mut x = Tensor::cat(&parts, 1).ctx(|| format!("features of {layout}"))?;
                if rotate {
                    let rows = set.rows();
                    let half = rows / 2;
                    x = x
                        .narrow(0, half, rows - half)
                        .and_then(|a| Tensor::cat(&[a, x.narrow(0, 0, half)?], 0))
                        .ctx(|| "the control's features".to_string())?;
                }
                self.draft.fc_forward(&x)
            })
            .collect()
    }

    pub fn score(&mut self, layout: &Layout, steps: usize) -> Result<Series> {
        let fc = self.fc_outs(layout, false)?;
        self.score_fc(&fc, steps)
    }
}

/// `-sum(p log softmax(logits))` per row, in f32. `logits`, `p`: [rows, Vd].
fn cross_entropy(logits: &Tensor, p: &Tensor) -> Result<Vec<f64>> {
    let run = || -> candle_core::Result<Vec<f32>> {
        let lg = logits.to_dtype(DType::F32)?;
        let z = lg.broadcast_sub(&lg.max_keepdim(D::Minus1)?)?;
        let lse = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
        let logq = z.broadcast_sub(&lse)?;
        (p * logq)?.sum(D::Minus1)?.neg()?.to_vec1::<f32>()
    };
    Ok(run()
        .ctx(|| "draft cross-entropy".to_string())?
        .into_iter()
        .map(f64::from)
        .collect())
}

/// Runs the target over every token set at once (layer by layer: a streamed target reads
/// each layer once for all of them) and keeps what every draft pass needs.
fn capture_sets(
    target: &LoadedTarget,
    vocab_targets: &Tensor,
    sets: &[TokenSet],
) -> Result<Vec<SetData>> {
    let ids: Vec<&[u32]> = sets.iter().map(|s| s.tokens.as_slice()).collect();
    let mut captures: Vec<Capture> = (0..sets.len()).map(|_| Capture::default()).collect();
    let mut progress = Progress::new("target forward");
    let l = target.cfg.num_layers;
    let want = CaptureRequest::all();
    let opts = ManyOptions::for_device(target.model.device());
    target
        .model
        .forward_many(&ids, &want, &opts, &mut |s, what, t| {
            let c = &mut captures[s];
            match what {
                Produced::Boundary(b) => {
                    c.hidden.insert(b, t.clone());
                    progress.tick(b, l);
                }
                Produced::FinalPreNorm => c.final_pre_norm = Some(t.clone()),
                Produced::Logits => c.logits = Some(t.clone()),
                Produced::LayerOutput(_) => {}
            }
            Ok(())
        })?;
    progress.finish();
    captures
        .into_iter()
        .zip(sets)
        .map(|(capture, set)| set_data(target, vocab_targets, set, capture))
        .collect()
}

/// What every draft pass needs of one token set's capture.
fn set_data(
    target: &LoadedTarget,
    vocab_targets: &Tensor,
    set: &TokenSet,
    capture: Capture,
) -> Result<SetData> {
    let l = target.cfg.num_layers;
    let missing = || Error::Capture {
        path: target.cfg.path.clone(),
        message: "the target forward did not return every boundary".into(),
    };
    let states = (0..=l)
        .map(|b| capture.hidden.get(&b).cloned().ok_or_else(missing))
        .collect::<Result<Vec<_>>>()?;
    let pre_norm = capture.final_pre_norm.clone().ok_or_else(missing)?;
    let logits = capture.logits.as_ref().ok_or_else(missing)?;
    let t = set.tokens.len();
    let run = || -> candle_core::Result<(Tensor, Vec<i64>)> {
        let lg = logits.to_dtype(DType::F32)?;
        let greedy = lg
            .argmax(D::Minus1)?
            .to_dtype(DType::I64)?
            .to_vec1::<i64>()?;
        let restricted = lg.narrow(0, 1, t - 1)?.index_select(vocab_targets, 1)?;
        Ok((crate::model::nn::softmax_last(&restricted)?, greedy))
    };
    let (target_p, greedy) = run().ctx(|| format!("{}: target distribution", set.origin))?;
    Ok(SetData {
        tokens: set.tokens.clone(),
        states,
        pre_norm,
        target_p,
        greedy,
    })
}

/// A model directory's safetensors headers, when it has any.
fn headers(path: &Path) -> Result<Option<WeightIndex>> {
    let dir = locate::resolve_model_dir(path)?;
    if !dir.is_dir() {
        return Ok(None);
    }
    let index = WeightIndex::open(&dir)?;
    Ok((!index.is_empty()).then_some(index))
}

/// One evaluated layout.
struct Scored {
    layout: Layout,
    labels: Vec<String>,
    series: Series,
}

/// Runs the probe and returns its report (and writes `--write-spec` when asked). The phases:
/// the header checks ([`header_checks`]), the forwards ([`load`]), the layouts to try
/// ([`candidates`]), the draft passes ([`score_layouts`], [`search_layouts`]), the ranking
/// ([`rank`]) and the verdicts ([`verdicts`], [`report_search`]).
pub fn probe(input: &ProbeInput) -> Result<Report> {
    let started = Instant::now();
    // Headers and configs first: a probe that cannot run loads no weight.
    let cfg = super::target_config(&input.target)?;
    let draft_cfg = DraftConfig::load(&input.draft)?;
    check_token_sets(&input.token_sets, cfg.vocab_size, input.steps)?;
    let (mut report, dims, feeds) = header_checks(input, &cfg, &draft_cfg)?;
    if report.findings.iter().any(judge::blocks_forward) {
        report.fact(
            "probe",
            "not run: the header checks already fail (no weight was loaded)",
        );
        return Ok(report.finish());
    }

    let (mut probe, steps, resampler) = load(input, &cfg, &draft_cfg, &mut report)?;
    let l = cfg.num_layers;
    let layouts = candidates(input, &draft_cfg, &dims, &feeds, probe.k, l, &mut report)?;
    let (mut scored, control) = score_layouts(&mut probe, &layouts, steps)?;
    let searched = if input.search {
        Some(search_layouts(&mut probe, &layouts, &mut scored, l, steps)?)
    } else {
        None
    };

    let best = rank(
        &mut report,
        &scored,
        &control,
        &layouts.reference,
        &resampler,
        steps,
    );
    crate::model::report::report_target(&mut report, &probe.target);
    report.fact(
        "probe_passes",
        format!(
            "{} draft passes, {:.1} s in all",
            probe.passes,
            started.elapsed().as_secs_f64()
        ),
    );
    let ranked = Ranked {
        scored: &scored,
        best,
        resampler: &resampler,
    };
    let best_series = &scored[best].series;
    let evidence = acceptance::SignalEvidence {
        acceptance_gain: resampler.diff(&best_series.accepted, &control.accepted),
        cross_entropy_gain: resampler.diff(&control.cross_entropy, &best_series.cross_entropy),
    };
    if !acceptance::has_signal(&evidence) {
        let finding = acceptance::no_signal(&evidence, &ranked.best_words());
        if input.search {
            return Err(Error::NoSignal {
                path: input.draft.clone(),
                message: format!("probe --search: {}", finding.message),
            });
        }
        report.findings.push(finding);
        return Ok(report.finish());
    }
    verdicts(&mut report, &cfg, &layouts, &ranked);
    if let Some(found) = &searched {
        report_search(&mut report, input, &cfg, found, &ranked)?;
    }
    Ok(report.finish())
}

/// The header-only part: the judge's static report when there is a spec, else the facts and
/// the feeds of the engines asked for.
fn header_checks(
    input: &ProbeInput,
    cfg: &ModelConfig,
    draft_cfg: &DraftConfig,
) -> Result<(Report, Dims, Vec<Feed>)> {
    let info = TargetInfo::from(cfg);
    if let Some(spec) = &input.spec {
        return judge::static_report(
            "probe",
            &StaticInput {
                spec,
                draft: Some(draft_cfg),
                draft_weights: headers(&input.draft)?.as_ref(),
                target: Some(&info),
                target_weights: headers(&input.target)?.as_ref(),
            },
            &input.engines,
        );
    }
    let mut r = Report::new("probe");
    r.fact(
        "target",
        format!("{} ({})", cfg.model_type, input.target.display()),
    );
    r.fact(
        "draft",
        format!("{} ({})", draft_cfg.architecture, draft_cfg.path.display()),
    );
    r.fact("draft_ids", judge::ids_fact(&draft_cfg.ids));
    let dims = Dims {
        num_layers: cfg.num_layers,
        target_hidden: cfg.hidden_size,
        arch: Some(cfg.family.name.clone()),
    };
    let feeds = judge::feeds(Some(draft_cfg), &dims, &input.engines);
    for feed in &feeds {
        r.fact(&format!("rule {}", feed.engine_label()), feed.describe());
    }
    Ok((r, dims, feeds))
}

/// Loads target and draft and runs the target on every token set: the probe, the chain length
/// the draft runs, and the block resampler over the positions (refused when too few).
fn load(
    input: &ProbeInput,
    cfg: &ModelConfig,
    draft_cfg: &DraftConfig,
    report: &mut Report,
) -> Result<(Probe, usize, Resampler)> {
    let target = open_target_with(
        &input.target,
        &TargetOptions {
            stream_layers: input.stream_layers,
            max_memory: input.max_memory,
            ..TargetOptions::new(input.dtype, &input.device)
        },
    )?;
    let target_hidden = draft_cfg.target_hidden(Some(cfg.hidden_size));
    let (draft, k) = open_draft(
        draft_cfg,
        &input.draft,
        target_hidden,
        input.dtype,
        &input.device,
    )?;
    let steps = if draft.chains() { input.steps } else { 1 };
    if steps < input.steps {
        report.fact(
            "steps",
            format!("1 (an MLA draft runs one step here; {} asked)", input.steps),
        );
    }
    let vocab_targets: Vec<u32> = draft
        .draft_vocab_targets()
        .iter()
        .map(|&t| t as u32)
        .collect();
    let vocab_targets = Tensor::new(vocab_targets.as_slice(), &input.device)
        .ctx(|| "draft vocabulary".to_string())?;
    let sets = capture_sets(&target, &vocab_targets, &input.token_sets)?;
    let rows: Vec<usize> = sets.iter().map(SetData::rows).collect();
    let resampler = Resampler::new(&rows, input.seed);
    if resampler.blocks() < crate::stats::MIN_BLOCKS {
        return Err(Error::Tokens {
            origin: summarise_origins(&input.token_sets),
            message: format!(
                "{} draft positions in {} blocks of {}: the probe's intervals need at least {} blocks \
                 (about {} tokens); give more text (--prompts FILE.jsonl, --token-file)",
                resampler.positions(),
                resampler.blocks(),
                crate::stats::BLOCK,
                crate::stats::MIN_BLOCKS,
                crate::stats::MIN_BLOCKS * crate::stats::BLOCK + 1
            ),
        });
    }
    report.fact(
        "tokens",
        format!(
            "{} positions in {} token set(s) ({})",
            resampler.positions(),
            sets.len(),
            summarise_origins(&input.token_sets)
        ),
    );
    let probe = Probe {
        draft,
        target,
        sets,
        k,
        passes: 0,
    };
    Ok((probe, steps, resampler))
}

/// The layouts the probe tries.
struct Layouts<'f> {
    cands: Candidates,
    /// Each judged engine's feed, with the index of its layout in `cands`.
    fed: Vec<(usize, &'f Feed)>,
    /// The spec's layout (both sides of the final norm when it names none).
    spec: Vec<Layout>,
    /// The layout the control and the neighbours are built around.
    reference: Layout,
}

/// The candidates: each engine's feed, the spec's layout, and the usual mistakes around the
/// reference (the spec's layout, else the first fed one).
fn candidates<'f>(
    input: &ProbeInput,
    draft_cfg: &DraftConfig,
    dims: &Dims,
    feeds: &'f [Feed],
    k: usize,
    l: usize,
    report: &mut Report,
) -> Result<Layouts<'f>> {
    let mut cands = Candidates::default();
    let mut fed: Vec<(usize, &Feed)> = Vec::new();
    for feed in feeds {
        let slots = feed.fed_slots();
        if slots.is_empty() {
            report.fact(
                &format!("probe {}", feed.engine_label()),
                "feeds nothing (it refuses these ids)",
            );
            continue;
        }
        if slots.len() != k {
            report.fact(
                &format!("probe {}", feed.engine_label()),
                format!(
                    "feeds {} slots, but fc takes {k}: the draft cannot run on it",
                    slots.len()
                ),
            );
            continue;
        }
        let layout = Layout::from_fed(slots, l);
        cands.add(layout.clone(), format!("fed by {}", feed.engine_label()));
        fed.push((cands.position(&layout).unwrap_or(0), feed));
    }
    // What the other engines (newest versions) would feed: tried too, not judged.
    let others = crate::engine::Engine::ALL.map(EngineSel::newest);
    for feed in judge::feeds(Some(draft_cfg), dims, &others) {
        let slots = feed.fed_slots();
        if slots.len() == k
            && !feeds
                .iter()
                .any(|f| f.engine_label() == feed.engine_label())
        {
            cands.add(
                Layout::from_fed(slots, l),
                format!("fed by {}", feed.engine_label()),
            );
        }
    }
    let spec_layouts: Vec<Layout> = match &input.spec {
        Some(spec) if spec.boundaries.len() == k => match spec.final_norm {
            Some(side) => vec![Layout::from_boundaries(&spec.boundaries, l, Some(side))],
            // At b = L without a side: both are what the spec could mean.
            None => vec![
                Layout::from_boundaries(
                    &spec.boundaries,
                    l,
                    Some(crate::boundary::FinalNorm::Post),
                ),
                Layout::from_boundaries(&spec.boundaries, l, Some(crate::boundary::FinalNorm::Pre)),
            ],
        },
        _ => Vec::new(),
    };
    for x in &spec_layouts {
        cands.add(x.clone(), "spec");
    }
    let reference = spec_layouts
        .first()
        .cloned()
        .or_else(|| cands.0.first().map(|c| c.layout.clone()));
    let Some(reference) = reference else {
        return Err(Error::Capture {
            path: input.draft.clone(),
            message: format!(
                "no layout to probe: no engine feeds the draft's {k} fc slots and no spec names {k} boundaries"
            ),
        });
    };
    neighbours(&reference, l, &mut cands);
    Ok(Layouts {
        cands,
        fed,
        spec: spec_layouts,
        reference,
    })
}

/// A draft pass per candidate, then the control: the reference layout on features of other
/// positions (each set's rows rotated by half), where a drafter that uses its features at all
/// does much worse.
fn score_layouts(
    probe: &mut Probe,
    layouts: &Layouts,
    steps: usize,
) -> Result<(Vec<Scored>, Series)> {
    let cands = &layouts.cands;
    let mut progress = Progress::new("draft passes");
    let total = cands.0.len() + 1;
    let mut scored: Vec<Scored> = Vec::with_capacity(cands.0.len());
    for (i, c) in cands.0.iter().enumerate() {
        scored.push(Scored {
            layout: c.layout.clone(),
            labels: c.labels.clone(),
            series: probe.score(&c.layout, steps)?,
        });
        progress.tick(i + 1, total);
    }
    let control_fc = probe.fc_outs(&layouts.reference, true)?;
    let control = probe.score_fc(&control_fc, 1)?;
    progress.tick(total, total);
    progress.finish();
    Ok((scored, control))
}

/// `--search`: every k-slot layout searched; the best two labelled (and scored, if new).
fn search_layouts(
    probe: &mut Probe,
    layouts: &Layouts,
    scored: &mut Vec<Scored>,
    l: usize,
    steps: usize,
) -> Result<search::Found> {
    let fed = fed_layouts(&layouts.fed, &layouts.cands);
    let found = search::search(probe, &fed, &layouts.reference, l)?;
    for (rank, layout) in found.top.iter().enumerate() {
        let label = if rank == 0 {
            "search: best".to_string()
        } else {
            "search: runner-up".to_string()
        };
        match scored.iter_mut().find(|s| &s.layout == layout) {
            Some(s) => s.labels.push(label),
            None => scored.push(Scored {
                layout: layout.clone(),
                labels: vec![label],
                series: probe.score(layout, steps)?,
            }),
        }
    }
    Ok(found)
}

/// Ranks the layouts by cross-entropy, best first, into the report's rows, the control last;
/// returns the best one's index in `scored`.
fn rank(
    report: &mut Report,
    scored: &[Scored],
    control: &Series,
    reference: &Layout,
    resampler: &Resampler,
    steps: usize,
) -> usize {
    let ce: Vec<Estimate> = scored
        .iter()
        .map(|s| resampler.mean(&s.series.cross_entropy))
        .collect();
    let mut order: Vec<usize> = (0..scored.len()).collect();
    order.sort_by(|&a, &b| ce[a].value.total_cmp(&ce[b].value));
    let best = order[0];
    let best_series = &scored[best].series;
    for (rank, &i) in order.iter().enumerate() {
        let s = &scored[i];
        report.probe.push(ProbeRow {
            rank: rank + 1,
            layout: s.layout.to_string(),
            boundaries: s.layout.boundaries(),
            final_norm: s.layout.final_norm(),
            labels: compact_labels(&s.labels),
            acceptance: resampler.mean(&s.series.accepted),
            accepted_length: (steps > 1).then(|| resampler.mean(&s.series.length)),
            cross_entropy: ce[i],
            above_best: (i != best)
                .then(|| resampler.diff(&s.series.cross_entropy, &best_series.cross_entropy)),
            below_best: (i != best)
                .then(|| resampler.diff(&best_series.accepted, &s.series.accepted)),
        });
    }
    report.probe.push(ProbeRow {
        rank: 0,
        layout: format!("{} on other positions", reference),
        boundaries: reference.boundaries(),
        final_norm: reference.final_norm(),
        labels: vec!["control".into()],
        acceptance: resampler.mean(&control.accepted),
        accepted_length: None,
        cross_entropy: resampler.mean(&control.cross_entropy),
        above_best: Some(resampler.diff(&control.cross_entropy, &best_series.cross_entropy)),
        below_best: Some(resampler.diff(&best_series.accepted, &control.accepted)),
    });
    best
}

/// The scored layouts and the best of them, for the verdicts.
struct Ranked<'a> {
    scored: &'a [Scored],
    best: usize,
    resampler: &'a Resampler,
}

impl Ranked<'_> {
    fn best_words(&self) -> String {
        self.scored[self.best].layout.to_string()
    }

    /// Layout `i` against the best: (acceptance lost, cross-entropy excess).
    fn behind_best(&self, i: usize) -> (Estimate, Estimate) {
        let (best, other) = (&self.scored[self.best].series, &self.scored[i].series);
        (
            self.resampler.diff(&best.accepted, &other.accepted),
            self.resampler
                .diff(&other.cross_entropy, &best.cross_entropy),
        )
    }
}

/// A finding for every fed layout, and every spec layout, that does measurably worse than the
/// best (with the fix for an engine that feeds it).
fn verdicts(report: &mut Report, cfg: &ModelConfig, layouts: &Layouts, ranked: &Ranked) {
    let (scored, best, l) = (ranked.scored, ranked.best, cfg.num_layers);
    let best_words = ranked.best_words();
    let arch = Some(cfg.family.name.as_str());
    for &(i, feed) in &layouts.fed {
        if i == best {
            continue;
        }
        let (acceptance_lost, cross_entropy_excess) = ranked.behind_best(i);
        let engine = feed.engine_label();
        let who = format!("{engine} feeds");
        let want = want_of(&scored[best].layout, l);
        let fix = crate::engine::ids_for(&feed.engine, arch, &want, l)
            .map(|(ids, setting)| format!("set {setting} to {ids:?} for {engine}"));
        let layout_words = scored[i].layout.to_string();
        if let Some(f) = acceptance::compare(&acceptance::Comparison {
            who: &who,
            engine: Some(&engine),
            layout: &layout_words,
            best: &best_words,
            acceptance_lost,
            cross_entropy_excess,
            fix,
            fed: true,
        }) {
            report.findings.push(f);
        }
    }
    for x in &layouts.spec {
        let Some(i) = scored.iter().position(|s| &s.layout == x) else {
            continue;
        };
        if i == best || layouts.fed.iter().any(|&(f, _)| f == i) {
            continue;
        }
        let (acceptance_lost, cross_entropy_excess) = ranked.behind_best(i);
        let layout_words = x.to_string();
        if let Some(f) = acceptance::compare(&acceptance::Comparison {
            who: "the spec names",
            engine: None,
            layout: &layout_words,
            best: &best_words,
            acceptance_lost,
            cross_entropy_excess,
            fix: None,
            fed: false,
        }) {
            report.findings.push(f);
        }
    }
}

/// What `--search` found, against its runner-up, and the spec it writes (`--write-spec`).
fn report_search(
    report: &mut Report,
    input: &ProbeInput,
    cfg: &ModelConfig,
    found: &search::Found,
    ranked: &Ranked,
) -> Result<()> {
    let (scored, best) = (ranked.scored, ranked.best);
    let best_words = ranked.best_words();
    let runner_up = found.top.get(1);
    let margin = runner_up.and_then(|r| scored.iter().position(|s| &s.layout == r));
    let words = match margin {
        Some(i) => {
            let (acc, ce) = ranked.behind_best(i);
            format!(
                "{best_words}; runner-up {}, {} nats of cross-entropy behind (first-token \
                 acceptance: best minus runner-up {}){}",
                scored[i].layout,
                ce.words(3),
                acc.words(3),
                if ce.above_zero() {
                    ""
                } else {
                    "; the margin is within its interval: the runner-up is as likely, \
                     probe more text to tell them apart"
                }
            )
        }
        None => best_words.clone(),
    };
    report.fact("search_best", words);
    report.fact(
        "search",
        format!(
            "{} layouts scored ({}), {} draft passes, {:.1} s",
            found.evaluated, found.method, found.passes, found.seconds
        ),
    );
    if let Some(path) = &input.write_spec {
        let text = spec_text(
            &scored[best].layout,
            cfg.num_layers,
            cfg.hidden_size,
            &cfg.model_type,
            &input.draft,
        )?;
        std::fs::write(path, text).map_err(|e| Error::io(path, e))?;
        report.fact("wrote_spec", path.display().to_string());
    }
    Ok(())
}

/// The fed layouts, for the search's starting points.
fn fed_layouts(fed: &[(usize, &Feed)], cands: &Candidates) -> Vec<Layout> {
    fed.iter()
        .filter_map(|&(i, _)| cands.0.get(i).map(|c| c.layout.clone()))
        .collect()
}

/// A layout as the slots a fix must produce.
fn want_of(layout: &Layout, l: usize) -> Vec<crate::engine::Want> {
    layout
        .0
        .iter()
        .map(|t| {
            (
                crate::boundary::Boundary(t.b),
                (t.b == l).then(|| t.norm.map(Into::into)).flatten(),
            )
        })
        .collect()
}

/// The capture spec of a layout the search found, read back before it is returned.
fn spec_text(
    layout: &Layout,
    l: usize,
    hidden: usize,
    model_type: &str,
    draft: &Path,
) -> Result<String> {
    let list: Vec<String> = layout.boundaries().iter().map(|b| b.to_string()).collect();
    let mut out = format!(
        "# Written by `eagle-check probe --search` for {}: the layout its drafter predicts the\n\
         # target best from (lowest cross-entropy over the probed positions; see the report).\n\
         name: {}\n\
         target: {{ num_hidden_layers: {l}, hidden_size: {hidden}, model_type: {} }}\n\
         capture:\n  boundaries: [{}]\n",
        draft.display(),
        crate::spec::yaml_scalar(&format!("{}-probed", crate::commands::stem(draft))),
        crate::spec::yaml_scalar(model_type),
        list.join(", ")
    );
    if let Some(side) = layout.final_norm() {
        out.push_str(&format!("  final_norm: {}\n", side.spec_word()));
    }
    out.push_str(&format!(
        "fc: {{ in_features: {} }}\n",
        layout.0.len() * hidden
    ));
    Spec::parse(&out, Path::new("<probe --search>"))?;
    Ok(out)
}

/// Every token set must index the vocabulary and hold a draft row for every chain step.
fn check_token_sets(sets: &[TokenSet], vocab: usize, steps: usize) -> Result<()> {
    if sets.is_empty() {
        return Err(Error::Usage("probe needs tokens".into()));
    }
    for set in sets {
        if let Some(&id) = set.tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::Tokens {
                origin: set.origin.clone(),
                message: format!(
                    "token id {id} is outside the target's vocabulary (vocab_size {vocab})"
                ),
            });
        }
        if set.tokens.len() < steps + 2 {
            return Err(Error::Tokens {
                origin: set.origin.clone(),
                message: format!(
                    "{} tokens: a {steps}-step chain needs at least {}",
                    set.tokens.len(),
                    steps + 2
                ),
            });
        }
    }
    Ok(())
}

/// Labels with every `fed by X` folded into one `fed by X, Y, ...`, where the first one was.
fn compact_labels(labels: &[String]) -> Vec<String> {
    const FED: &str = "fed by ";
    let engines: Vec<&str> = labels.iter().filter_map(|l| l.strip_prefix(FED)).collect();
    let mut out = Vec::with_capacity(labels.len());
    for l in labels {
        match l.strip_prefix(FED) {
            Some(e) if e == engines[0] => out.push(format!("{FED}{}", engines.join(", "))),
            Some(_) => {}
            None => out.push(l.clone()),
        }
    }
    out
}

fn summarise_origins(sets: &[TokenSet]) -> String {
    match sets {
        [one] => one.origin.clone(),
        [first, .., last] => format!("{} .. {}", first.origin, last.origin),
        [] => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::boundary::FinalNorm;

    /// `probe --search --write-spec` once wrote `final_norm: pre-norm` (the report's word) for a
    /// layout taking b = L, a value the spec reader did not take: the command refused its own
    /// file. The spec's own word is written, and the text reads back as the layout.
    #[test]
    fn a_searched_layout_with_b_l_writes_a_spec_that_reads_back() {
        for side in [Side::Pre, Side::Post] {
            let layout = Layout(vec![
                Tap::new(2, 8, None),
                Tap::new(4, 8, None),
                Tap::new(8, 8, Some(side)),
            ]);
            let text = spec_text(&layout, 8, 16, "llama", Path::new("draft/config.json")).unwrap();
            let want = FinalNorm::from(side);
            assert!(
                text.contains(&format!("  final_norm: {}\n", want.spec_word())),
                "{text}"
            );
            let spec = Spec::parse(&text, Path::new("probed.yaml")).unwrap();
            assert_eq!(spec.final_norm, Some(want));
            assert_eq!(spec.boundaries.len(), 3);
        }
    }
}
