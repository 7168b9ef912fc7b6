//! The static CI gate: configs, engine rules and weight shapes against a capture spec,
//! with no forward pass and no weight loading (safetensors headers only).

use crate::boundary::{Boundary, FinalNorm, format_list};
use crate::config::{DraftConfig, DraftKind, IdsSource, ModelConfig};
use crate::engine::{Engine, Feed, IdProblem, Rule, ids_for, resolve};
use crate::error::{Error, Result};
use crate::report::{Finding, FindingName, Report, SlotRow};
use crate::spec::Spec;
use crate::weights::WeightIndex;

/// Everything the gate reads.
pub struct GateInput<'a> {
    pub spec: &'a Spec,
    pub draft: &'a DraftConfig,
    /// Header index of the draft's weights, when the draft directory has any.
    pub draft_weights: Option<&'a WeightIndex>,
    pub target: Option<&'a ModelConfig>,
    /// Header index of the target's weights, when the target directory has any.
    pub target_weights: Option<&'a WeightIndex>,
    pub engines: &'a [Engine],
}

/// The target dimensions the checks run against, from the target config or the spec.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    pub num_layers: usize,
    pub target_hidden: usize,
}

impl Dims {
    pub fn resolve(spec: &Spec, draft: &DraftConfig, target: Option<&ModelConfig>) -> Result<Dims> {
        let num_layers = target
            .map(|t| t.num_layers)
            .or(spec.target.and_then(|t| t.num_hidden_layers))
            .ok_or_else(|| {
                Error::Usage(format!(
                    "{}: the target's layer count is unknown: pass --target or set target.num_hidden_layers in the spec",
                    spec.path.display()
                ))
            })?;
        let target_hidden = target
            .map(|t| t.hidden_size)
            .or(spec.target.and_then(|t| t.hidden_size))
            .unwrap_or_else(|| draft.target_hidden(None));
        Ok(Dims {
            num_layers,
            target_hidden,
        })
    }
}

/// Runs every static check and returns the report.
pub fn gate(input: &GateInput) -> Result<Report> {
    let GateInput {
        spec,
        draft,
        target,
        ..
    } = *input;
    let dims = Dims::resolve(spec, draft, target)?;
    let mut report = Report::new("gate");
    report.fact("spec", format!("{} ({})", spec.name, spec.path.display()));
    report.fact(
        "draft",
        format!("{} ({})", draft.architecture, draft.path.display()),
    );
    if let Some(t) = target {
        report.fact("target", format!("{} ({})", t.model_type, t.path.display()));
    }
    report.fact(
        "target_dims",
        format!(
            "L = {} layers, Ht = {}",
            dims.num_layers, dims.target_hidden
        ),
    );
    report.fact("draft_ids", ids_fact(draft));
    report.fact("spec_b", format_list(&spec.boundaries));

    report
        .findings
        .extend(check_spec_against_target(spec, target, dims));
    report
        .findings
        .extend(check_draft_config(spec, draft, target, dims));
    if let (Some(weights), Some(t)) = (input.target_weights, target) {
        report.fact("target_tensors", weights.tensors.len().to_string());
        report.findings.extend(check_target_weights(t, weights));
    }
    if let Some(weights) = input.draft_weights {
        report
            .findings
            .extend(check_draft_weights(spec, draft, weights, dims));
    }
    for &engine in input.engines {
        let feed = resolve(engine, draft.aux_layer_ids.as_deref(), dims.num_layers);
        let (rows, findings) = check_feed(&feed, spec, dims.num_layers);
        report.slots.extend(rows);
        report.findings.extend(findings);
    }
    Ok(report.finish())
}

fn ids_fact(draft: &DraftConfig) -> String {
    match (&draft.aux_layer_ids, draft.ids_source) {
        (Some(ids), IdsSource::EagleConfig) => format!("{ids:?} (eagle_config)"),
        (Some(ids), _) => format!("{ids:?} (top level)"),
        (None, _) => "none (engines use their defaults)".into(),
    }
}

fn check_spec_against_target(
    spec: &Spec,
    target: Option<&ModelConfig>,
    dims: Dims,
) -> Vec<Finding> {
    let mut out = Vec::new();
    if let (Some(expect), Some(t)) = (spec.target, target) {
        if let Some(l) = expect.num_hidden_layers.filter(|&l| l != t.num_layers) {
            out.push(Finding::error(
                FindingName::Shape,
                format!(
                    "the spec was written for a {l}-layer target; {} has {} layers",
                    t.path.display(),
                    t.num_layers
                ),
            ));
        }
        if let Some(h) = expect.hidden_size.filter(|&h| h != t.hidden_size) {
            out.push(Finding::error(
                FindingName::Shape,
                format!(
                    "the spec was written for hidden size {h}; {} has {}",
                    t.path.display(),
                    t.hidden_size
                ),
            ));
        }
    }
    for (slot, b) in spec.boundaries.iter().enumerate() {
        if b.0 > dims.num_layers {
            out.push(
                Finding::error(
                    FindingName::OutOfRange,
                    format!(
                        "the spec names b = {b}, but a {}-layer target has boundaries 0..={}",
                        dims.num_layers, dims.num_layers
                    ),
                )
                .with_slot(slot),
            );
        }
    }
    if let Some(fc_in) = spec.fc_in_features {
        let want = spec.boundaries.len() * dims.target_hidden;
        if fc_in != want {
            out.push(Finding::error(
                FindingName::Shape,
                format!(
                    "spec fc.in_features = {fc_in}, but {} boundaries x Ht {} = {want}",
                    spec.boundaries.len(),
                    dims.target_hidden
                ),
            ));
        }
    }
    out
}

fn check_draft_config(
    spec: &Spec,
    draft: &DraftConfig,
    target: Option<&ModelConfig>,
    dims: Dims,
) -> Vec<Finding> {
    let mut out = Vec::new();
    if let Some(n) = draft
        .num_aux_hidden_states
        .filter(|&n| n != spec.boundaries.len())
    {
        out.push(Finding::error(
            FindingName::Count,
            format!(
                "the draft config says num_aux_hidden_states = {n}; the spec lists {} boundaries",
                spec.boundaries.len()
            ),
        ));
    }
    if let Some(ht) = draft
        .target_hidden_size
        .filter(|&h| h != dims.target_hidden)
    {
        out.push(Finding::error(
            FindingName::Shape,
            format!(
                "the draft config says target_hidden_size = {ht}; the target's hidden size is {}",
                dims.target_hidden
            ),
        ));
    }
    if let Some(t) = target
        && draft.vocab_size != t.vocab_size
    {
        out.push(Finding::error(
            FindingName::Shape,
            format!(
                "draft vocab_size {} differs from the target's {}",
                draft.vocab_size, t.vocab_size
            ),
        ));
    }
    out
}

/// The target checkpoint must hold every decoder layer the config declares, at its hidden size.
/// (Extra layers are fine: DeepSeek-V3 ships its MTP layer as `model.layers.61`.)
fn check_target_weights(target: &ModelConfig, weights: &WeightIndex) -> Vec<Finding> {
    let mut out = Vec::new();
    let h = target.hidden_size;
    let prefix = ["model.", "model.language_model.", "language_model.model."]
        .into_iter()
        .find(|p| weights.get(&format!("{p}embed_tokens.weight")).is_some());
    let Some(prefix) = prefix else {
        out.push(Finding::error(
            FindingName::Shape,
            format!(
                "no embed_tokens.weight in {}: not a supported checkpoint layout",
                weights.dir.display()
            ),
        ));
        return out;
    };
    if let Some(info) = weights.get(&format!("{prefix}embed_tokens.weight"))
        && info.shape != [target.vocab_size, h]
    {
        out.push(Finding::error(
            FindingName::Shape,
            format!(
                "{prefix}embed_tokens.weight is {:?}, config says [{}, {h}]",
                info.shape, target.vocab_size
            ),
        ));
    }
    let missing: Vec<usize> = (0..target.num_layers)
        .filter(|i| {
            weights
                .get(&format!("{prefix}layers.{i}.input_layernorm.weight"))
                .is_none_or(|info| info.shape != [h])
        })
        .collect();
    if !missing.is_empty() {
        out.push(Finding::error(
            FindingName::Shape,
            format!(
                "the config declares {} layers, but {} of them have no [{h}] input_layernorm in the checkpoint (first: layer {})",
                target.num_layers,
                missing.len(),
                missing[0]
            ),
        ));
    }
    out
}

/// Names a draft weight may carry: SpecForge `midlayer.`, vLLM `layers.0.`, with or without `model.`.
fn draft_names(suffix: &str) -> Vec<String> {
    let mut names = Vec::new();
    for prefix in ["", "model."] {
        if let Some(rest) = suffix.strip_prefix("midlayer.") {
            names.push(format!("{prefix}midlayer.{rest}"));
            names.push(format!("{prefix}layers.0.{rest}"));
        } else {
            names.push(format!("{prefix}{suffix}"));
        }
    }
    names
}

fn find<'w>(weights: &'w WeightIndex, suffix: &str) -> Option<(&'w str, &'w [usize])> {
    let names = draft_names(suffix);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    weights
        .find(&refs)
        .map(|(n, info)| (n, info.shape.as_slice()))
}

fn check_draft_weights(
    spec: &Spec,
    draft: &DraftConfig,
    weights: &WeightIndex,
    dims: Dims,
) -> Vec<Finding> {
    let mut out = Vec::new();
    let h = draft.hidden_size;
    let ht = dims.target_hidden;
    let k = spec.boundaries.len();
    let shape_err =
        |name: &str, msg: String| Finding::error(FindingName::Shape, format!("{name}: {msg}"));
    match find(weights, "fc.weight") {
        None => out.push(Finding::error(
            FindingName::Shape,
            format!(
                "no fc.weight in {}: not an EAGLE-3 draft checkpoint",
                weights.dir.display()
            ),
        )),
        Some((name, shape)) => {
            if shape.len() != 2 || shape[0] != h {
                out.push(shape_err(
                    name,
                    format!("expected [{h}, {}], found {shape:?}", k * ht),
                ));
            } else if shape[1] != k * ht {
                if shape[1] % ht == 0 {
                    out.push(Finding::error(
                        FindingName::Count,
                        format!(
                            "{name} is {shape:?}: fc takes {} slots of Ht = {ht}, the spec lists {k}",
                            shape[1] / ht
                        ),
                    ));
                } else {
                    out.push(shape_err(
                        name,
                        format!("input width {} is not a multiple of the target hidden size {ht} (expected {k} x {ht} = {})", shape[1], k * ht),
                    ));
                }
            }
            if let Some(fc_in) = spec
                .fc_in_features
                .filter(|&f| shape.len() == 2 && shape[1] != f)
            {
                out.push(shape_err(
                    name,
                    format!(
                        "spec fc.in_features = {fc_in}, the weight takes {}",
                        shape[1]
                    ),
                ));
            }
        }
    }
    // The projections that read the draft layer's `cat(embedding, fc output)` input. MLA: the
    // query path's first projection (`q_a_proj`, or `q_proj` when q_lora_rank is null) and
    // `kv_a_proj_with_mqa` (TorchSpec torchspec/models/draft/deepseek_eagle.py
    // `DeepSeekMLAAttention`: `input_dim = hidden_size * 2`).
    let wide: &[&str] = if draft.kind == DraftKind::Eagle3Mla {
        &["q_a_proj", "q_proj", "kv_a_proj_with_mqa"]
    } else {
        &["q_proj", "k_proj", "v_proj"]
    };
    for proj in wide {
        if let Some((name, shape)) = find(weights, &format!("midlayer.self_attn.{proj}.weight"))
            && shape.get(1) != Some(&(2 * h))
        {
            out.push(shape_err(
                name,
                format!(
                    "input width {:?} should be 2H = {} (cat of embedding and fc output)",
                    shape.get(1),
                    2 * h
                ),
            ));
        }
    }
    let dv = draft.draft_vocab_size;
    if let Some((name, shape)) = find(weights, "lm_head.weight")
        && shape.first() != Some(&dv)
    {
        out.push(shape_err(
            name,
            format!("{:?} rows, but draft_vocab_size = {dv}", shape.first()),
        ));
    }
    let d2t = find(weights, "d2t").or_else(|| find(weights, "draft_id_to_target_id"));
    if let Some((name, shape)) = d2t
        && shape != [dv]
    {
        out.push(shape_err(
            name,
            format!("shape {shape:?}, expected [{dv}] (one entry per draft token)"),
        ));
    }
    if let Some((name, shape)) = find(weights, "t2d")
        && shape != [draft.vocab_size]
    {
        out.push(shape_err(
            name,
            format!(
                "shape {shape:?}, expected [{}] (one flag per target token)",
                draft.vocab_size
            ),
        ));
    }
    out
}

/// How a fed layout differs from the expected one, as one finding name and a sentence.
pub fn classify_layout(fed: &[Boundary], want: &[Boundary]) -> Option<(FindingName, String)> {
    classify_layout_as(fed, want, ("fed", "trained on"))
}

/// [`classify_layout`] with the two sides named in the message, e.g. `("captured", "spec")`.
pub fn classify_layout_as(
    got: &[Boundary],
    want: &[Boundary],
    words: (&str, &str),
) -> Option<(FindingName, String)> {
    if got == want {
        return None;
    }
    let both = format!(
        "{} {}, {} {}",
        words.0,
        format_list(got),
        words.1,
        format_list(want)
    );
    let got_emb = got.contains(&Boundary::EMBEDDING);
    let want_emb = want.contains(&Boundary::EMBEDDING);
    if got_emb != want_emb {
        let msg = if got_emb {
            format!(
                "the embedding output (b = 0) takes an fc slot that training never gave it: {both}"
            )
        } else {
            format!("training held the embedding output (b = 0), which is missing here: {both}")
        };
        return Some((FindingName::EmbeddingCapture, msg));
    }
    if got.len() != want.len() {
        return Some((
            FindingName::Count,
            format!(
                "{} slots where {} are expected: {both}",
                got.len(),
                want.len()
            ),
        ));
    }
    let mut got_sorted = got.to_vec();
    let mut want_sorted = want.to_vec();
    got_sorted.sort();
    want_sorted.sort();
    if got_sorted == want_sorted {
        return Some((
            FindingName::Order,
            format!("the same boundaries in another order: {both}"),
        ));
    }
    let deltas: Vec<i64> = got
        .iter()
        .zip(want)
        .map(|(a, b)| a.0 as i64 - b.0 as i64)
        .collect();
    if deltas.iter().all(|&d| d == deltas[0]) && deltas[0].abs() == 1 {
        let side = if deltas[0] > 0 { "above" } else { "below" };
        return Some((
            FindingName::OffByOne,
            format!("every slot is one boundary {side} the expected one: {both}"),
        ));
    }
    Some((FindingName::WrongLayer, both))
}

/// Compares one engine's feed with the spec: slot rows for the table, and findings.
pub fn check_feed(feed: &Feed, spec: &Spec, num_layers: usize) -> (Vec<SlotRow>, Vec<Finding>) {
    let engine = feed.engine;
    let fed = feed.boundaries();
    let want = &spec.boundaries;
    let rows = (0..fed.len().max(want.len()))
        .map(|slot| {
            let f = fed.get(slot).copied();
            let w = want.get(slot).copied();
            SlotRow {
                engine,
                slot,
                id: feed.slots.get(slot).and_then(|s| s.id),
                fed: f.map(|b| b.0),
                expected: w.map(|b| b.0),
                ok: f.is_some() && f == w,
            }
        })
        .collect();

    let mut out = Vec::new();
    for problem in &feed.problems {
        let finding = match problem {
            IdProblem::OutOfRange { id, reason } => Finding::error(
                FindingName::OutOfRange,
                format!(
                    "layer id {id} means nothing to {engine} on a {num_layers}-layer target: {reason}; it is dropped"
                ),
            ),
            IdProblem::Duplicate { id, collapsed } => Finding::error(
                FindingName::Duplicate,
                if *collapsed {
                    format!(
                        "layer id {id} appears twice; {engine} captures it once, so fc gets one slot fewer"
                    )
                } else {
                    format!(
                        "layer id {id} appears twice; {engine} feeds the same state into two slots"
                    )
                },
            ),
            IdProblem::Unsorted { ids } => Finding::warning(
                FindingName::Order,
                format!(
                    "layer ids {ids:?} are not ascending: layer-loop engines concatenate in ascending order, \
                     list-order pipelines (SpecForge HF backend, ModelOpt) do not"
                ),
            ),
            IdProblem::Refused { reason } => Finding::error(FindingName::Refused, reason.clone()),
            // Judged by the layout comparison below (an embedding may be what the spec wants).
            IdProblem::Embedding { .. } => continue,
        };
        out.push(finding.with_engine(engine));
    }

    let fix = || match ids_for(engine, want, num_layers) {
        Some(ids) => {
            format!("set eagle_config.eagle_aux_hidden_state_layer_ids to {ids:?} for {engine}")
        }
        None if feed.rule == Rule::HardCoded => {
            format!(
                "{engine} hard-codes b = {}; no config change can feed the spec's layout",
                format_list(&fed)
            )
        }
        None => format!(
            "no layer-id list makes {engine} feed {} in this order",
            format_list(want)
        ),
    };
    if feed.rule != Rule::Refused
        && let Some((name, message)) = classify_layout(&fed, want)
    {
        let first_bad = fed.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
        let (name, message) = if feed.rule == Rule::DefaultFallback {
            (
                FindingName::DefaultFallback,
                format!(
                    "the draft config names no layer ids, so {engine} falls back to its default: {message}"
                ),
            )
        } else {
            (
                name,
                format!("{engine} ({}): {message}", feed.rule.describe()),
            )
        };
        out.push(
            Finding::error(name, message)
                .with_fix(fix())
                .with_engine(engine)
                .with_slot(first_bad),
        );
    } else if feed.rule == Rule::DefaultFallback {
        out.push(
            Finding::warning(
                FindingName::DefaultFallback,
                format!(
                    "the draft config names no layer ids; {engine}'s default happens to match the spec, \
                     but any engine or default change moves it silently (vLLM PR 50170)"
                ),
            )
            .with_fix(fix())
            .with_engine(engine),
        );
    }

    if fed
        .iter()
        .chain(want.iter())
        .any(|b| b.is_final(num_layers))
    {
        let side = engine.final_norm();
        match spec.final_norm {
            Some(want_side) if want_side != side && fed.iter().any(|b| b.is_final(num_layers)) => out.push(
                Finding::error(
                    FindingName::FinalNorm,
                    format!("b = {num_layers} is trained {want_side}, but {engine} captures it {side}"),
                )
                .with_engine(engine),
            ),
            Some(_) => {}
            None => out.push(
                Finding::warning(
                    FindingName::FinalNorm,
                    format!(
                        "b = {num_layers} (after the last layer) is ambiguous: {engine} captures it {side}, HF returns it {}; \
                         state `final_norm: pre|post` in the spec",
                        FinalNorm::Post
                    ),
                )
                .with_engine(engine),
            ),
        }
    }
    (rows, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bs(v: &[usize]) -> Vec<Boundary> {
        v.iter().map(|&b| Boundary(b)).collect()
    }

    #[test]
    fn layouts_are_classified() {
        let c = |f: &[usize], w: &[usize]| classify_layout(&bs(f), &bs(w)).map(|x| x.0);
        assert_eq!(c(&[2, 30, 58], &[2, 30, 58]), None);
        assert_eq!(
            c(&[0, 3, 31], &[3, 31, 59]),
            Some(FindingName::EmbeddingCapture)
        );
        assert_eq!(
            c(&[2, 30, 58], &[0, 2, 30, 58]),
            Some(FindingName::EmbeddingCapture)
        );
        assert_eq!(c(&[1, 29, 57], &[2, 30, 58]), Some(FindingName::OffByOne));
        assert_eq!(c(&[3, 31, 59], &[2, 30, 58]), Some(FindingName::OffByOne));
        assert_eq!(c(&[30, 2, 58], &[2, 30, 58]), Some(FindingName::Order));
        assert_eq!(c(&[2, 30], &[2, 30, 58]), Some(FindingName::Count));
        assert_eq!(c(&[2, 31, 58], &[2, 30, 58]), Some(FindingName::WrongLayer));
    }
}
