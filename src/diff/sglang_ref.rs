//! sglang dumps (its dumper's files and its debug-tensor-dump pass files) read two ways: as
//! reference states of whole sequences (every boundary the names say they hold, see
//! [`super::names`]), and as the three junctions `eagle-check plan` asks a live server to dump
//! (each captured aux state, the concatenation the logits processor stores, the draft's `fc`
//! input), regrouped into capture samples for `diff --captures`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::names::{Holds, MapSource, NameMap, holds, implied_layers};
use super::reference::{RefStates, ReferenceOptions};
use crate::error::{Error, Result};
use crate::readers::sglang::{DumpLayout, DumpPass, DumpTensor, read_sglang_passes, sequences};
use crate::readers::{DType, Format, HostTensor, Sample};
use crate::tolerance::CaptureTolerance;

/// Reference sequences read from sglang dumps, and what the report should say about them.
pub struct SglangRead {
    pub entries: Vec<RefStates>,
    pub facts: Vec<(String, String)>,
}

/// Where a state lands in [`RefStates`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Slot {
    B(usize),
    Pre,
}

impl Slot {
    fn describe(self) -> String {
        match self {
            Slot::B(b) => format!("b = {b}"),
            Slot::Pre => "the pre-norm final state".into(),
        }
    }
}

/// `[T, W]` (or `[1, T, W]`) as (rows, width).
fn rows_width(t: &HostTensor) -> Option<(usize, usize)> {
    match t.dims() {
        [r, w] => Some((*r, *w)),
        [1, r, w] => Some((*r, *w)),
        _ => None,
    }
}

/// `||a - b|| / ||b||`.
fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let d = f64::from(*x) - f64::from(*y);
        num += d * d;
        den += f64::from(*y) * f64::from(*y);
    }
    if den == 0.0 {
        if num == 0.0 { 0.0 } else { f64::INFINITY }
    } else {
        (num / den).sqrt()
    }
}

/// A draft model's pass (EAGLE dumps both models into one folder): its `fc` or `midlayer`
/// gives it away.
fn is_draft_pass(pass: &DumpPass) -> bool {
    pass.role.as_deref() == Some("draft")
        || pass
            .tensors
            .iter()
            .any(|t| t.name.contains(".fc.") || t.name.contains("midlayer"))
}

fn where_of(pass: &DumpPass) -> String {
    match pass.layout {
        DumpLayout::Dumper => format!(
            "{}: step {} rank {}",
            pass.origin.display(),
            pass.step,
            pass.rank
        ),
        DumpLayout::Pass => format!("{}", pass.origin.display()),
    }
}

/// One pass's states, before they are cut into sequences.
struct PassStates {
    rows: usize,
    width: usize,
    states: BTreeMap<Slot, Vec<f32>>,
    tokens: Vec<i64>,
}

/// Reads sglang dumps under `root` as reference sequences.
pub fn read(root: &Path, files: &[PathBuf], opts: &ReferenceOptions) -> Result<SglangRead> {
    let passes = read_sglang_passes(files)?;
    let builtin = NameMap::builtin();
    let map = opts.map.as_ref().unwrap_or(&builtin);
    let capture_err = |message: String| Error::Capture {
        path: root.to_path_buf(),
        message,
    };
    let names = classify_names(&passes, map).map_err(capture_err)?;
    let l = layer_count(opts, names.implied).map_err(capture_err)?;
    let mut seqs = pass_sequences(root, &passes, &names.classified, l, opts)?;
    let merged = merge_ranks(std::mem::take(&mut seqs.by_key)).map_err(capture_err)?;
    let facts = read_facts(files, &passes, map, opts, &names, &seqs, &merged);
    let entries = merged.entries;
    if entries.is_empty() {
        return Err(capture_err(
            "the sglang dumps hold no whole sequence (every run starts after position 0: disable \
             the radix cache and chunked prefill while dumping)"
                .into(),
        ));
    }
    Ok(SglangRead { entries, facts })
}

/// Every tensor name of the dumps read once, by the name rules.
struct Names {
    /// Draft-model passes, skipped.
    draft_passes: usize,
    /// Per target pass (its index): the tensors that hold a boundary, with what they hold.
    classified: Vec<(usize, Vec<(usize, super::names::Classified)>)>,
    /// Per rule: how many tensors it named, and which layers.
    rule_use: BTreeMap<usize, (usize, BTreeSet<usize>)>,
    /// Names no rule reads (generic form), with their counts.
    unread: BTreeMap<String, usize>,
    /// The layer count the largest layer named implies.
    implied: usize,
}

/// Classifies every tensor name of every target pass; refuses dumps in which none names a
/// boundary the rules know.
fn classify_names(passes: &[DumpPass], map: &NameMap) -> std::result::Result<Names, String> {
    let mut draft_passes = 0usize;
    let mut classified: Vec<(usize, Vec<(usize, super::names::Classified)>)> = Vec::new();
    let mut rule_use: BTreeMap<usize, (usize, BTreeSet<usize>)> = BTreeMap::new();
    let mut unread: BTreeMap<String, usize> = BTreeMap::new();
    let mut implied = 0usize;
    for (p, pass) in passes.iter().enumerate() {
        if is_draft_pass(pass) {
            draft_passes += 1;
            continue;
        }
        let mut read = Vec::new();
        for (i, t) in pass.tensors.iter().enumerate() {
            match map.classify(&t.name, t.layer_id) {
                Some(c) => {
                    let entry = rule_use.entry(c.rule).or_default();
                    entry.0 += 1;
                    if let Some(layer) = c.layer {
                        entry.1.insert(layer);
                    }
                    if holds(&c, usize::MAX).is_some() {
                        implied = implied.max(implied_layers(&c).unwrap_or(0));
                        read.push((i, c));
                    }
                }
                None => *unread.entry(generic_name(&t.name)).or_default() += 1,
            }
        }
        classified.push((p, read));
    }
    if classified.iter().all(|(_, r)| r.is_empty()) {
        let seen: Vec<String> = unread.keys().take(6).cloned().collect();
        return Err(format!(
            "no tensor of these sglang dumps names a boundary that {} know: pass \
             --reference-map 'REGEX=QUANTITY' to say what they hold{}",
            match map.source {
                MapSource::BuiltIn => "the built-in sglang rules",
                MapSource::Flag => "the --reference-map rules",
            },
            if seen.is_empty() {
                String::new()
            } else {
                format!(" (names seen: {})", seen.join(", "))
            }
        ));
    }
    Ok(Names {
        draft_passes,
        classified,
        rule_use,
        unread,
        implied,
    })
}

/// A sequence's key: the dump's layout, the step and the tokens (the ranks that share one hold
/// the same states).
type Key = (DumpLayout, u64, Vec<i64>);

/// Every pass's whole sequences, grouped by [`Key`]: (rank, states, where it was read).
struct Sequences {
    by_key: BTreeMap<Key, Vec<(u64, RefStates, String)>>,
    num_layers: usize,
    /// Runs skipped for not starting at position 0.
    partial: usize,
    /// Passes without reference states.
    empty_passes: usize,
}

/// Each pass's states, checked to be the replicated residual stream's width, cut into whole
/// sequences.
fn pass_sequences(
    root: &Path,
    passes: &[DumpPass],
    classified: &[(usize, Vec<(usize, super::names::Classified)>)],
    l: usize,
    opts: &ReferenceOptions,
) -> Result<Sequences> {
    let capture_err = |message: String| Error::Capture {
        path: root.to_path_buf(),
        message,
    };
    let mut per_pass: Vec<(usize, PassStates)> = Vec::new();
    let mut empty_passes = 0usize;
    for (p, read) in classified {
        let pass = &passes[*p];
        if read.is_empty() {
            empty_passes += 1;
            continue;
        }
        per_pass.push((*p, pass_states(pass, read, l, opts)?));
    }

    // Whole sequences, and the ranks that hold the same one.
    let mut by_key: BTreeMap<Key, Vec<(u64, RefStates, String)>> = BTreeMap::new();
    let mut partial = 0usize;
    let hidden = opts
        .hidden_size
        .unwrap_or_else(|| per_pass.iter().map(|(_, s)| s.width).max().unwrap_or(0));
    for (p, st) in per_pass {
        let pass = &passes[p];
        if st.width != hidden {
            let shard = st.width < hidden && hidden.is_multiple_of(st.width.max(1));
            return Err(capture_err(if shard {
                format!(
                    "{}: the states are {} wide, 1/{} of the hidden size {hidden}: a tensor-parallel \
                     shard, not the replicated residual stream; dump the state after its all-reduce",
                    where_of(pass),
                    st.width,
                    hidden / st.width.max(1)
                )
            } else {
                format!(
                    "{}: the states are {} wide, the target's hidden size is {hidden}",
                    where_of(pass),
                    st.width
                )
            }));
        }
        let (runs, skipped) = sequences(pass, st.rows);
        partial += skipped;
        for (start, len) in runs {
            let cut = |v: &Vec<f32>| v[start * hidden..(start + len) * hidden].to_vec();
            let mut boundaries = vec![None; l + 1];
            let mut final_pre_norm = None;
            for (slot, v) in &st.states {
                match slot {
                    Slot::B(b) => boundaries[*b] = Some(cut(v)),
                    Slot::Pre => final_pre_norm = Some(cut(v)),
                }
            }
            let tokens = st.tokens[start..start + len].to_vec();
            by_key
                .entry((pass.layout, pass.step, tokens.clone()))
                .or_default()
                .push((
                    pass.rank,
                    RefStates {
                        tokens,
                        hidden_size: hidden,
                        num_layers: l,
                        boundaries,
                        final_pre_norm,
                        no_residual: vec![None; l + 1],
                    },
                    where_of(pass),
                ));
        }
    }

    Ok(Sequences {
        by_key,
        num_layers: l,
        partial,
        empty_passes,
    })
}

/// The sequences, one per key, the ranks' copies merged into one.
struct Merged {
    entries: Vec<RefStates>,
    /// The steps held by several ranks, and which.
    replicated: Vec<String>,
    /// The largest relative difference between ranks' copies.
    worst: f64,
}

/// Merges the ranks that hold one sequence, refusing copies that differ by more than bf16's
/// rounding budget.
fn merge_ranks(
    by_key: BTreeMap<Key, Vec<(u64, RefStates, String)>>,
) -> std::result::Result<Merged, String> {
    let tol = CaptureTolerance::for_dtype(DType::BF16).rel_err;
    let mut entries = Vec::new();
    let mut replicated = Vec::new();
    let mut worst = 0f64;
    for ((_, step, _), group) in by_key {
        let mut group = group.into_iter();
        let Some((rank, mut first, first_at)) = group.next() else {
            continue;
        };
        let mut ranks = vec![rank];
        for (other, states, at) in group {
            ranks.push(other);
            // Ranks of one tensor-parallel group hold the residual stream after the same
            // all-reduce; bf16's rounding budget (tolerance.rs) bounds any difference in
            // reduction order. Anything further apart is not a replicated state.
            let pairs = first
                .boundaries
                .iter()
                .zip(&states.boundaries)
                .enumerate()
                .map(|(b, (x, y))| (Slot::B(b), x.as_ref(), y.as_ref()))
                .chain(std::iter::once((
                    Slot::Pre,
                    first.final_pre_norm.as_ref(),
                    states.final_pre_norm.as_ref(),
                )));
            for (slot, x, y) in pairs {
                if let (Some(x), Some(y)) = (x, y) {
                    let d = rel_diff(y, x);
                    worst = worst.max(d);
                    if d > tol {
                        return Err(format!(
                            "step {step}: rank {rank} ({first_at}) and rank {other} ({at}) hold \
                             different {} for the same tokens (relative difference {d:.3e}, more \
                             than {tol:.0e}): a replicated state must agree across ranks; if these \
                             are per-rank partial sums or shards, dump the state after its all-reduce",
                            slot.describe()
                        ));
                    }
                }
            }
            for (b, y) in states.boundaries.into_iter().enumerate() {
                if first.boundaries[b].is_none() {
                    first.boundaries[b] = y;
                }
            }
            if first.final_pre_norm.is_none() {
                first.final_pre_norm = states.final_pre_norm;
            }
        }
        if ranks.len() > 1 {
            replicated.push(format!("step {step}: ranks {ranks:?}"));
        }
        entries.push(first);
    }

    Ok(Merged {
        entries,
        replicated,
        worst,
    })
}

/// What the report says about how the dumps were read.
fn read_facts(
    files: &[PathBuf],
    passes: &[DumpPass],
    map: &NameMap,
    opts: &ReferenceOptions,
    names: &Names,
    seqs: &Sequences,
    merged: &Merged,
) -> Vec<(String, String)> {
    let l = seqs.num_layers;
    let mut facts = Vec::new();
    let layouts: BTreeSet<&str> = passes
        .iter()
        .map(|p| match p.layout {
            DumpLayout::Dumper => "sglang dumper",
            DumpLayout::Pass => "sglang debug tensor dump",
        })
        .collect();
    let present: BTreeSet<usize> = merged
        .entries
        .iter()
        .flat_map(|e| {
            e.boundaries
                .iter()
                .enumerate()
                .filter(|(_, v)| v.is_some())
                .map(|(b, _)| b)
        })
        .collect();
    facts.push((
        "reference_layout".into(),
        format!(
            "{}: {} file(s), {} pass(es), {} sequence(s); b = {} of 0..={l}{}; L = {l} ({})",
            layouts.into_iter().collect::<Vec<_>>().join(" + "),
            files.len(),
            passes.len(),
            merged.entries.len(),
            crate::boundary::format_list(
                &present
                    .iter()
                    .map(|&b| crate::boundary::Boundary(b))
                    .collect::<Vec<_>>()
            ),
            if merged.entries.iter().any(|e| e.final_pre_norm.is_some()) {
                " and the pre-norm final state"
            } else {
                ""
            },
            if opts.num_layers.is_some() {
                "from the target or spec"
            } else {
                "inferred from the largest layer named"
            }
        ),
    ));
    let used: Vec<String> = names
        .rule_use
        .iter()
        .filter(|(i, _)| map.rules[**i].quantity != super::names::Quantity::Skip)
        .map(|(i, (n, layers))| {
            let r = &map.rules[*i];
            let layers = if layers.is_empty() {
                String::new()
            } else {
                format!(
                    ", layers {}..={}",
                    layers.first().unwrap_or(&0),
                    layers.last().unwrap_or(&0)
                )
            };
            format!(
                "`{}` -> {} ({n} tensors{layers})",
                r.text,
                r.quantity.describe()
            )
        })
        .collect();
    facts.push((
        "reference_names".into(),
        format!(
            "{}: {}",
            match map.source {
                MapSource::BuiltIn => "built-in sglang rules (names detected)",
                MapSource::Flag => "--reference-map",
            },
            used.join("; ")
        ),
    ));
    if !names.unread.is_empty() {
        facts.push((
            "reference_unread".into(),
            names
                .unread
                .iter()
                .map(|(n, c)| format!("{n} x{c}"))
                .collect::<Vec<_>>()
                .join(", "),
        ));
    }
    facts.push((
        "reference_tokens".into(),
        match &opts.tokens {
            Some((_, path)) if passes.iter().any(|p| p.input_ids.is_none()) => {
                format!("--reference-tokens {}", path.display())
            }
            _ => "input_ids dumped by the engine".into(),
        },
    ));
    if !merged.replicated.is_empty() {
        facts.push((
            "reference_ranks".into(),
            format!(
                "replicated across tensor-parallel ranks, max relative difference {:.1e} ({})",
                merged.worst,
                merged.replicated.join("; ")
            ),
        ));
    }
    let mut skipped = Vec::new();
    if seqs.partial > 0 {
        skipped.push(format!(
            "{} run(s) not starting at position 0 (decode steps, later prefill chunks, prefix-cache hits)",
            seqs.partial
        ));
    }
    if seqs.empty_passes > 0 {
        skipped.push(format!(
            "{} pass(es) without reference states",
            seqs.empty_passes
        ));
    }
    if names.draft_passes > 0 {
        skipped.push(format!("{} draft-model pass(es)", names.draft_passes));
    }
    if !skipped.is_empty() {
        facts.push(("reference_skipped".into(), skipped.join("; ")));
    }
    facts
}

/// The target's layer count L: from the target or spec, else the largest layer the dump names.
fn layer_count(opts: &ReferenceOptions, implied: usize) -> std::result::Result<usize, String> {
    Ok(match opts.num_layers {
        Some(l) => {
            if implied > l {
                return Err(format!(
                    "the dump names layer {} but the target has {l} layers (0..={})",
                    implied - 1,
                    l.saturating_sub(1)
                ));
            }
            l
        }
        None => implied,
    })
}

/// `model.layers.12.mlp` -> `model.layers.{i}.mlp`, for the report's list of unread names.
fn generic_name(name: &str) -> String {
    let mut out = String::new();
    let mut digits = false;
    for c in name.chars() {
        if c.is_ascii_digit() {
            if !digits {
                out.push_str("{i}");
            }
            digits = true;
        } else {
            digits = false;
            out.push(c);
        }
    }
    out
}

/// Every state one pass holds, checked: one width, one row count, duplicates that agree, pairs
/// that are complete.
fn pass_states(
    pass: &DumpPass,
    read: &[(usize, super::names::Classified)],
    l: usize,
    opts: &ReferenceOptions,
) -> Result<PassStates> {
    let at = where_of(pass);
    let err = |message: String| Error::Capture {
        path: pass.origin.clone(),
        message,
    };
    let mut full: BTreeMap<Slot, Vec<(&DumpTensor, Vec<f32>)>> = BTreeMap::new();
    let mut parts: BTreeMap<Slot, Vec<(&DumpTensor, Vec<f32>)>> = BTreeMap::new();
    let mut shape: Option<(usize, usize, String)> = None;
    for (i, c) in read {
        let t = &pass.tensors[*i];
        let Some(h) = holds(c, l) else { continue };
        let (rows, width) = rows_width(&t.tensor)
            .filter(|_| t.tensor.dtype.is_float())
            .ok_or_else(|| {
                err(format!(
                    "{at}: {} has shape {:?} ({}); a reference state is a float [T, H]",
                    t.name,
                    t.tensor.dims(),
                    t.tensor.dtype
                ))
            })?;
        match &shape {
            None => shape = Some((rows, width, t.name.clone())),
            Some((r, w, first)) if (*r, *w) != (rows, width) => {
                return Err(err(format!(
                    "{at}: {} is [{rows}, {width}] but {first} is [{r}, {w}]; the states of one \
                     pass must share [T, H]",
                    t.name
                )));
            }
            Some(_) => {}
        }
        let (slot, into) = match h {
            Holds::Boundary(b) if b > l => {
                return Err(err(format!(
                    "{at}: {} names b = {b}, past the target's {l} layers",
                    t.name
                )));
            }
            Holds::Boundary(b) => (Slot::B(b), &mut full),
            Holds::PreNorm => (Slot::Pre, &mut full),
            Holds::Part(b) if b >= l => (Slot::Pre, &mut parts),
            Holds::Part(b) => (Slot::B(b), &mut parts),
        };
        into.entry(slot)
            .or_default()
            .push((t, t.tensor.to_f32_vec()));
    }
    let Some((rows, width, _)) = shape else {
        return Err(err(format!("{at}: no reference state")));
    };
    let tol = CaptureTolerance::for_dtype(DType::BF16).rel_err;
    let mut states: BTreeMap<Slot, Vec<f32>> = BTreeMap::new();
    for (slot, list) in parts {
        if list.len() < 2 {
            return Err(err(format!(
                "{at}: {} is one summand of {} and its other summand is missing: a fused-residual \
                 layer's (hidden_states, residual) must both be dumped (the boundary is their sum)",
                list[0].0.name,
                slot.describe()
            )));
        }
        let mut sum = vec![0f32; rows * width];
        for (_, v) in &list {
            for (s, x) in sum.iter_mut().zip(v) {
                *s += x;
            }
        }
        full.entry(slot).or_default().push((list[0].0, sum));
    }
    for (slot, list) in full {
        let mut list = list.into_iter();
        let Some((first, v)) = list.next() else {
            continue;
        };
        for (other, w) in list {
            let d = rel_diff(&w, &v);
            if d > tol {
                return Err(err(format!(
                    "{at}: {} and {} both hold {} by their names but differ (relative difference \
                     {d:.3e}): one of the names is read wrongly; pass --reference-map",
                    first.name,
                    other.name,
                    slot.describe()
                )));
            }
        }
        states.insert(slot, v);
    }
    let tokens = match (&pass.input_ids, &opts.tokens) {
        (Some(ids), _) => {
            if ids.len() != rows {
                return Err(err(format!(
                    "{at}: {} token ids but {rows} rows of states: the rows are sharded across \
                     ranks (attention-TP scatter or sequence parallelism) or cut; dump the states \
                     after their all-gather",
                    ids.len()
                )));
            }
            ids.clone()
        }
        (None, Some((ids, path))) => {
            if ids.len() != rows {
                return Err(err(format!(
                    "{at}: --reference-tokens {} holds {} ids but the dump has {rows} rows",
                    path.display(),
                    ids.len()
                )));
            }
            ids.clone()
        }
        (None, None) => {
            return Err(err(format!(
                "{at}: no input_ids in the dump; pass --reference-tokens FILE (or add input_ids \
                 to the dumper's filter)"
            )));
        }
    };
    Ok(PassStates {
        rows,
        width,
        states,
        tokens,
    })
}

/// The three junctions of the founding incident, as `eagle-check plan` names their dumps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Junction {
    /// Each aux state as the engine captures it (`eagle_aux_capture`, one dump per capture).
    Captures,
    /// The concatenation the logits processor stores (`eagle_aux_hidden_states`).
    Concat,
    /// What the draft's `fc` is fed (`eagle_fc_input`, or the non-intrusive dumper's
    /// `*.fc.inputs.0`).
    FcInput,
}

impl Junction {
    pub fn of(name: &str) -> Option<Junction> {
        match name {
            "eagle_aux_capture" => Some(Junction::Captures),
            "eagle_aux_hidden_states" => Some(Junction::Concat),
            "eagle_fc_input" => Some(Junction::FcInput),
            n if n.ends_with(".fc.inputs.0") => Some(Junction::FcInput),
            _ => None,
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Junction::Captures => "junction 1: each captured aux state",
            Junction::Concat => "junction 2: the aux concatenation the logits processor stores",
            Junction::FcInput => "junction 3: the draft's fc input",
        }
    }
}

/// A junction dump regrouped as one capture sample.
pub struct JunctionSample {
    pub sample: Sample,
    /// For the report: where it came from and what it held.
    pub label: String,
}

/// Concatenates `[T, w_i]` tensors along the hidden axis, keeping their dtype when they share
/// one.
fn concat_hidden(parts: &[&HostTensor]) -> Option<HostTensor> {
    let dims: Vec<(usize, usize)> = parts.iter().map(|t| rows_width(t)).collect::<Option<_>>()?;
    let rows = dims.first()?.0;
    if dims.iter().any(|d| d.0 != rows) {
        return None;
    }
    let width: usize = dims.iter().map(|d| d.1).sum();
    let dtype = parts[0].dtype;
    if parts.iter().all(|t| t.dtype == dtype) {
        let size = dtype.size();
        let mut bytes = Vec::with_capacity(rows * width * size);
        for r in 0..rows {
            for (t, (_, w)) in parts.iter().zip(&dims) {
                bytes.extend_from_slice(&t.bytes()[r * w * size..(r + 1) * w * size]);
            }
        }
        return HostTensor::from_le_bytes(dtype, vec![rows, width], bytes).ok();
    }
    let data: Vec<Vec<f32>> = parts.iter().map(|t| t.to_f32_vec()).collect();
    let mut out = Vec::with_capacity(rows * width);
    for r in 0..rows {
        for (v, (_, w)) in data.iter().zip(&dims) {
            out.extend_from_slice(&v[r * w..(r + 1) * w]);
        }
    }
    HostTensor::from_f32(vec![rows, width], &out).ok()
}

/// Rows `start..start + len` of a `[T, W]` tensor.
fn cut_rows(t: &HostTensor, start: usize, len: usize) -> Option<HostTensor> {
    let (rows, w) = rows_width(t)?;
    if start + len > rows {
        return None;
    }
    let size = t.dtype.size();
    let bytes = t.bytes()[start * w * size..(start + len) * w * size].to_vec();
    HostTensor::from_le_bytes(t.dtype, vec![len, w], bytes).ok()
}

/// The sglang dumper files among `files` that hold junction dumps, regrouped: per pass and
/// junction, one sample per whole sequence, `aux` = the junction's `[T, k*H]` (the captures of
/// junction 1 concatenated in dump order, which is the order the engine captured them).
///
/// The draft's `fc` input comes from the draft's own forward, whose `input_ids` are the
/// target's shifted by one (EAGLE pairs the feature of token t with token t + 1): its rows
/// belong to the target pass whose ids, shifted, are the draft's, and they take those ids.
pub fn junction_samples(files: &[PathBuf]) -> Result<Vec<JunctionSample>> {
    let passes = read_sglang_passes(files)?;
    let mut out = Vec::new();
    for pass in &passes {
        let mut by_junction: BTreeMap<Junction, Vec<&DumpTensor>> = BTreeMap::new();
        for t in &pass.tensors {
            if let Some(j) = Junction::of(&t.name) {
                by_junction.entry(j).or_default().push(t);
            }
        }
        for (junction, tensors) in by_junction {
            let at = where_of(pass);
            let err = |message: String| Error::Capture {
                path: tensors[0].file.clone(),
                message,
            };
            let aux = match junction {
                Junction::Captures => {
                    concat_hidden(&tensors.iter().map(|t| &t.tensor).collect::<Vec<_>>())
                }
                _ if tensors.len() == 1 => rows_width(&tensors[0].tensor)
                    .and_then(|(r, w)| tensors[0].tensor.reshape(vec![r, w])),
                _ => {
                    return Err(err(format!(
                        "{at}: {} dumps of {} in one pass; expected one",
                        tensors.len(),
                        tensors[0].name
                    )));
                }
            }
            .ok_or_else(|| {
                err(format!(
                    "{at}: {} has shape {:?}; a junction dump is [T, k*H]",
                    tensors[0].name,
                    tensors[0].tensor.dims()
                ))
            })?;
            let rows = aux.dims()[0];
            let mut note = None;
            let tokens = match (&pass.input_ids, junction) {
                (Some(draft), Junction::FcInput) => match unshifted(&passes, pass, draft) {
                    Some((ids, step)) => {
                        note = Some(format!(
                            "paired with the target's tokens of step {step} (the draft's ids are \
                             those shifted by one)"
                        ));
                        ids
                    }
                    None => draft.clone(),
                },
                (Some(ids), _) => ids.clone(),
                (None, _) => {
                    return Err(err(format!(
                        "{at}: no input_ids dumped in this pass; add input_ids to the dumper's filter"
                    )));
                }
            };
            if tokens.len() != rows {
                return Err(err(format!(
                    "{at}: {} token ids but {} has {rows} rows; they must pair one to one",
                    tokens.len(),
                    tensors[0].name
                )));
            }
            let layers: Vec<i64> = tensors.iter().filter_map(|t| t.layer_id).collect();
            let (runs, _) = sequences(pass, rows);
            for (index, (start, len)) in runs.into_iter().enumerate() {
                let mut sample = Sample {
                    file: tensors[0].file.clone(),
                    index,
                    format: Format::SglangDumper,
                    token_ids: Some(tokens[start..start + len].to_vec()),
                    loss_mask: None,
                    aux: cut_rows(&aux, start, len),
                    layers: None,
                    final_hidden: None,
                    named: Vec::new(),
                    meta: Vec::new(),
                    notes: note.iter().cloned().collect(),
                };
                if sample.aux.is_none() {
                    return Err(err(format!(
                        "{at}: cannot cut rows {start}..{}",
                        start + len
                    )));
                }
                sample.notes.push(junction.describe().to_string());
                out.push(JunctionSample {
                    sample,
                    label: format!(
                        "{at}: {} ({}{}{})",
                        tensors[0].name,
                        junction.describe(),
                        if layers.is_empty() {
                            String::new()
                        } else {
                            format!(", captured inside layers {layers:?}")
                        },
                        note.as_ref().map(|n| format!("; {n}")).unwrap_or_default()
                    ),
                });
            }
        }
    }
    Ok(out)
}

/// The target pass (same rank, another step) whose ids the draft's are, shifted by one.
fn unshifted(passes: &[DumpPass], draft: &DumpPass, ids: &[i64]) -> Option<(Vec<i64>, u64)> {
    let n = ids.len();
    if n < 2 {
        return None;
    }
    passes
        .iter()
        .filter(|p| p.rank == draft.rank && p.step < draft.step && p.layout == draft.layout)
        .rev()
        .filter_map(|p| p.input_ids.as_ref().map(|x| (x, p.step)))
        .find(|(x, _)| x.len() == n && x[1..] == ids[..n - 1])
        .map(|(x, s)| (x.clone(), s))
}
