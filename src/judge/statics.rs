//! Static checks: configs and safetensors headers against a capture spec, with no forward pass
//! and no weight loaded. `gate` is nothing but these; `run` calls them before loading anything,
//! so a run that will be refused takes milliseconds.

use crate::boundary::format_list;
use crate::config::family::family_name;
use crate::config::{DraftConfig, DraftKind, TargetInfo};
use crate::error::{Error, Result};
use crate::naming::{self, DraftTensor};
use crate::report::{Finding, FindingName};
use crate::spec::Spec;
use crate::weights::WeightIndex;

/// Everything the static checks read.
#[derive(Clone, Copy)]
pub struct StaticInput<'a> {
    pub spec: &'a Spec,
    pub draft: Option<&'a DraftConfig>,
    /// Header index of the draft's weights, when the draft directory has any.
    pub draft_weights: Option<&'a WeightIndex>,
    pub target: Option<&'a TargetInfo>,
    /// Header index of the target's weights, when the target directory has any.
    pub target_weights: Option<&'a WeightIndex>,
}

/// The target the checks run against, from the target config or else the spec.
#[derive(Debug, Clone)]
pub struct Dims {
    pub num_layers: usize,
    pub target_hidden: usize,
    /// The target's `model_type`, which picks an engine's per-architecture rule.
    pub arch: Option<String>,
}

impl Dims {
    pub fn resolve(
        spec: &Spec,
        draft: Option<&DraftConfig>,
        target: Option<&TargetInfo>,
    ) -> Result<Dims> {
        let expect = spec.target.as_ref();
        let num_layers = target
            .map(|t| t.num_layers)
            .or(expect.and_then(|t| t.num_hidden_layers))
            .ok_or_else(|| Error::Spec {
                path: spec.path.clone(),
                message: "the target's layer count is unknown: pass --target or set \
                          target.num_hidden_layers in the spec"
                    .into(),
            })?;
        let target_hidden = target
            .map(|t| t.hidden_size)
            .or(expect.and_then(|t| t.hidden_size))
            .or_else(|| draft.map(|d| d.target_hidden(None)))
            .ok_or_else(|| Error::Spec {
                path: spec.path.clone(),
                message: "the target's hidden size is unknown: pass --target or set \
                          target.hidden_size in the spec"
                    .into(),
            })?;
        // The family picks the rule: a target config's, else the spec's, else the one the
        // draft config says it was trained for (SpecForge writes `target_model_type`).
        let arch = target
            .map(|t| t.family.name.clone())
            .or(expect.and_then(|t| t.model_type.as_deref().map(family_name)))
            .or(draft.and_then(|d| d.target_model_type.as_deref().map(family_name)));
        Ok(Dims {
            num_layers,
            target_hidden,
            arch,
        })
    }
}

/// Runs every static check that does not depend on an engine. A target checkpoint that
/// contradicts its own config is refused (bad input, not a layout finding).
pub fn check(input: &StaticInput, dims: &Dims) -> Result<Vec<Finding>> {
    let mut out = check_spec_against_target(input.spec, input.target, dims);
    if let Some(draft) = input.draft {
        out.extend(check_draft_config(input.spec, draft, input.target, dims));
        if let Some(weights) = input.draft_weights {
            out.extend(check_draft_weights(input.spec, draft, weights, dims));
        }
    }
    if let (Some(weights), Some(t)) = (input.target_weights, input.target) {
        check_target_weights(t, weights)?;
    }
    Ok(out)
}

fn check_spec_against_target(
    spec: &Spec,
    target: Option<&TargetInfo>,
    dims: &Dims,
) -> Vec<Finding> {
    let mut out = Vec::new();
    if let (Some(expect), Some(t)) = (&spec.target, target) {
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
        // The spec may name the family (`gemma3`, `kimi_k25`) or the text model's own
        // `model_type` (`gemma3_text`, a wrapper's `kimi_k2`): both are this target.
        if let Some(m) = expect.model_type.as_deref().filter(|&m| {
            let named = family_name(m);
            named != t.family.name && named != family_name(&t.model_type)
        }) {
            out.push(Finding::error(
                FindingName::Shape,
                format!(
                    "the spec was written for a `{m}` target; {} is `{}`",
                    t.path.display(),
                    t.model_type
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
                    "spec fc.in_features = {fc_in}, but {} boundaries {} x Ht {} = {want}",
                    spec.boundaries.len(),
                    format_list(&spec.boundaries),
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
    target: Option<&TargetInfo>,
    dims: &Dims,
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
    if let Some(v) = target
        .and_then(|t| t.vocab_size)
        .filter(|&v| v != draft.vocab_size)
    {
        out.push(Finding::error(
            FindingName::Shape,
            format!(
                "draft vocab_size {} differs from the target's {v}",
                draft.vocab_size
            ),
        ));
    }
    if draft.draft_vocab_size > draft.vocab_size {
        out.push(Finding::error(
            FindingName::Shape,
            format!(
                "draft_vocab_size {} is larger than the vocabulary it maps into ({})",
                draft.draft_vocab_size, draft.vocab_size
            ),
        ));
    }
    out
}

/// The target checkpoint must hold every decoder layer the config declares, at its hidden size.
/// (Extra layers are fine: DeepSeek-V3 ships its MTP layer as `model.layers.61`.) A checkpoint
/// that fails this cannot be run or matched against anything: it is bad input (exit 2), not a
/// layout mismatch (exit 1), and the error names the checkpoint and the contradiction.
fn check_target_weights(target: &TargetInfo, weights: &WeightIndex) -> Result<()> {
    let h = target.hidden_size;
    let has = |n: &str| weights.get(n).is_some();
    let refuse = |message: String| Err(Error::weights(&weights.dir, message));
    let Some(prefix) = naming::decoder_prefix(&has) else {
        return refuse(format!(
            "no embed_tokens.weight under any known prefix ({}): not a checkpoint layout \
             eagle-check can read",
            naming::DECODER_PREFIXES.join(", "),
        ));
    };
    if let Some(info) = weights.get(&format!("{prefix}.embed_tokens.weight")) {
        let vocab_ok = target
            .vocab_size
            .is_none_or(|v| info.shape.first() == Some(&v));
        if info.shape.len() != 2 || info.shape[1] != h || !vocab_ok {
            return refuse(format!(
                "{prefix}.embed_tokens.weight is {:?}, but {} says [{}, {h}]",
                info.shape,
                target.path.display(),
                target
                    .vocab_size
                    .map_or("vocab_size".to_string(), |v| v.to_string())
            ));
        }
    }
    let missing: Vec<usize> = (0..target.num_layers)
        .filter(|i| {
            weights
                .get(&format!("{prefix}.layers.{i}.input_layernorm.weight"))
                .is_none_or(|info| info.shape != [h])
        })
        .collect();
    if let Some(first) = missing.first() {
        return refuse(format!(
            "{} declares {} layers, but {} of them have no [{h}] input_layernorm in the checkpoint \
             (first: layer {first})",
            target.path.display(),
            target.num_layers,
            missing.len(),
        ));
    }
    Ok(())
}

fn check_draft_weights(
    spec: &Spec,
    draft: &DraftConfig,
    weights: &WeightIndex,
    dims: &Dims,
) -> Vec<Finding> {
    let mut out = Vec::new();
    let has = |n: &str| weights.get(n).is_some();
    let find = |t: DraftTensor| -> Option<(String, Vec<usize>)> {
        naming::find_draft(t, &has).map(|n| {
            let shape = weights.get(&n).map(|i| i.shape.clone()).unwrap_or_default();
            (n, shape)
        })
    };
    let h = draft.hidden_size;
    let ht = dims.target_hidden;
    let k = spec.boundaries.len();
    let shape_err =
        |name: &str, msg: String| Finding::error(FindingName::Shape, format!("{name}: {msg}"));
    match find(DraftTensor::Top("fc.weight")) {
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
                    &name,
                    format!(
                        "expected [{h}, {}] (the draft's hidden size {h} rows), found {shape:?}",
                        k * ht
                    ),
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
                        &name,
                        format!(
                            "input width {} is not a multiple of the target hidden size {ht} (expected {k} x {ht} = {})",
                            shape[1],
                            k * ht
                        ),
                    ));
                }
            }
            if let Some(fc_in) = spec
                .fc_in_features
                .filter(|&f| shape.len() == 2 && shape[1] != f)
            {
                out.push(shape_err(
                    &name,
                    format!(
                        "spec fc.in_features = {fc_in}, the weight takes {}",
                        shape[1]
                    ),
                ));
            }
        }
    }
    // The draft's hidden size, as its norms carry it.
    for norm in ["hidden_norm.weight", "input_layernorm.weight"] {
        if let Some((name, shape)) = find(DraftTensor::Layer(norm))
            && shape != [h]
        {
            out.push(shape_err(
                &name,
                format!("{shape:?}, but the draft config says hidden_size = {h}"),
            ));
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
        if let Some((name, shape)) = find(DraftTensor::Layer(&format!("self_attn.{proj}.weight")))
            && shape.get(1) != Some(&(2 * h))
        {
            out.push(shape_err(
                &name,
                format!(
                    "input width {:?} should be 2H = {} (cat of embedding and fc output)",
                    shape.get(1),
                    2 * h
                ),
            ));
        }
    }
    let dv = draft.draft_vocab_size;
    match find(DraftTensor::Top("lm_head.weight")) {
        Some((name, shape)) if shape != [dv, h] => out.push(shape_err(
            &name,
            format!(
                "{shape:?}, but draft_vocab_size = {dv} and hidden_size = {h} make [{dv}, {h}]"
            ),
        )),
        Some(_) => {}
        None => out.push(Finding::error(
            FindingName::Shape,
            format!(
                "no lm_head.weight in {}: the draft cannot predict",
                weights.dir.display()
            ),
        )),
    }
    let d2t = naming::DRAFT_D2T
        .iter()
        .find_map(|n| find(DraftTensor::Top(n)));
    match d2t {
        Some((name, shape)) if shape != [dv] => out.push(shape_err(
            &name,
            format!("shape {shape:?}, expected [{dv}] (one entry per draft token)"),
        )),
        Some(_) => {}
        None if dv != draft.vocab_size => out.push(Finding::error(
            FindingName::Shape,
            format!(
                "no d2t in {}: a draft vocabulary of {dv} < {} needs the draft-to-target map",
                weights.dir.display(),
                draft.vocab_size
            ),
        )),
        None => {}
    }
    if let Some((name, shape)) = find(DraftTensor::Top("t2d"))
        && shape != [draft.vocab_size]
    {
        out.push(shape_err(
            &name,
            format!(
                "shape {shape:?}, expected [{}] (one flag per target token)",
                draft.vocab_size
            ),
        ));
    }
    out
}
