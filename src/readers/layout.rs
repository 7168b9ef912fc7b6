//! Layout recognisers: turn each producer's file into [`Sample`]s with one naming scheme
//! (token ids, loss mask, aux states `[S, k*H]`, per-layer states `[S, n, H]`, final state
//! `[S, H]`, everything else by name).
//!
//! Producers (shared/docs/eagle3-capture.md section 5):
//! - SpecForge `data_{i}.ckpt(.gz)`: `input_ids` [S] or [B, S], `loss_mask`,
//!   `aux_hidden_state` [B, S, k*H], `hidden_state` [B, S, H]; a batch B > 1 becomes B samples.
//! - Model-Optimizer `{id}.pt`: `input_ids` [S], `hidden_states` [S, H],
//!   `aux_hidden_states` [S, k*H], optional `loss_mask`, `conversation_id` (kept in `meta`).
//! - vLLM `hs_{i}.safetensors`: `token_ids` [T], `hidden_states` [T, n, H] -> `layers`.
//! - sglang dumper `...___name=X.pt`: `{"value": tensor, "meta": {...}}` -> `named` [(X, value)]
//!   and `meta`.
//! - sglang `Pass{NNNNN}.pt`: module name -> tensor (or list of tensors) -> `named`, with lists
//!   flattened as `name.0`, `name.1`; `*.forward_batch_info.input_ids` also fills `token_ids`.
//! - plain `.npy` or a bare tensor: `[S, k*H]` (or `[1, S, k*H]`) is taken as aux, anything else
//!   lands in `named` under the file stem; `.npz`/`.safetensors`/other torch dicts: the names
//!   above are recognised, the rest goes to `named`.

use std::path::{Path, PathBuf};

use super::numpy::{read_npy_noted, read_npz_noted};
use super::pickle::{Value, key_string};
use super::safetensors_file::read_safetensors;
use super::tensor::{HostTensor, fmt_shape};
use super::torch::read_torch;
use super::{Limits, ReadError};

/// Which producer's layout a file was recognised as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// SpecForge offline data (`aux_hidden_state`, `hidden_state`).
    SpecForge,
    /// NVIDIA Model-Optimizer `collect_hidden_states` (`aux_hidden_states`, `hidden_states`).
    ModelOpt,
    /// vLLM `extract_hidden_states` (`token_ids`, `hidden_states` [T, n, H]).
    Vllm,
    /// sglang dumper file `{"value", "meta"}`.
    SglangDumper,
    /// sglang `--debug-tensor-dump-output-folder` `Pass{NNNNN}.pt`.
    SglangPass,
    /// Plain `.npy`.
    Npy,
    /// Plain `.npz`.
    Npz,
    /// Plain `.safetensors`.
    Safetensors,
    /// Any other torch.save file.
    Torch,
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::SpecForge => "SpecForge",
            Format::ModelOpt => "ModelOpt",
            Format::Vllm => "Vllm",
            Format::SglangDumper => "SglangDumper",
            Format::SglangPass => "SglangPass",
            Format::Npy => "Npy",
            Format::Npz => "Npz",
            Format::Safetensors => "Safetensors",
            Format::Torch => "Torch",
        }
    }
}

/// One captured sequence, normalised. Shapes use S for the sequence (token) axis.
#[derive(Debug, Clone)]
pub struct Sample {
    pub file: PathBuf,
    /// Position of the sample within its file (batch row, or list element), from 0.
    pub index: usize,
    pub format: Format,
    /// [S] token ids (`input_ids` / `token_ids`).
    pub token_ids: Option<Vec<i64>>,
    /// [S] loss mask.
    pub loss_mask: Option<Vec<i64>>,
    /// [S, k*H] concatenated aux hidden states, in the producer's order.
    pub aux: Option<HostTensor>,
    /// [S, n, H] per-layer states (vLLM; its last slot is the final pre-norm state when the
    /// producer asked for it).
    pub layers: Option<HostTensor>,
    /// [S, H] the final hidden state (post-norm for SpecForge and Model-Optimizer).
    pub final_hidden: Option<HostTensor>,
    /// Every other tensor, by (dotted) name, in file order.
    pub named: Vec<(String, HostTensor)>,
    /// Plain values found beside the tensors (sglang dumper `meta` entries, ModelOpt
    /// `conversation_id`, safetensors `__metadata__` as strings), top-level keys in file order.
    pub meta: Vec<(String, Value)>,
    /// How the file was read where that needed a judgement (e.g. npy `<V2` taken as bf16).
    pub notes: Vec<String>,
}

impl Sample {
    fn new(file: &Path, index: usize, format: Format) -> Self {
        Sample {
            file: file.to_path_buf(),
            index,
            format,
            token_ids: None,
            loss_mask: None,
            aux: None,
            layers: None,
            final_hidden: None,
            named: Vec::new(),
            meta: Vec::new(),
            notes: Vec::new(),
        }
    }

    /// A tensor of `named` by name.
    pub fn tensor(&self, name: &str) -> Option<&HostTensor> {
        self.named.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// A value of `meta` by key.
    pub fn meta(&self, key: &str) -> Option<&Value> {
        self.meta.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Torch,
    Safetensors,
    Npy,
    Npz,
}

fn kind_of(path: &Path) -> Option<Kind> {
    // Lossy: a name that is not UTF-8 is still recognised by its (ASCII) extension, and read.
    let name = path.file_name()?.to_string_lossy().to_ascii_lowercase();
    if [".pt", ".pth", ".ckpt", ".ckpt.gz", ".pt.gz"]
        .iter()
        .any(|e| name.ends_with(e))
    {
        Some(Kind::Torch)
    } else if name.ends_with(".safetensors") {
        Some(Kind::Safetensors)
    } else if name.ends_with(".npy") {
        Some(Kind::Npy)
    } else if name.ends_with(".npz") {
        Some(Kind::Npz)
    } else {
        None
    }
}

/// Reads one capture file into its samples, with default [`Limits`].
pub fn read_capture_path(path: &Path) -> Result<Vec<Sample>, ReadError> {
    read_capture_path_with(path, &Limits::default())
}

/// Reads one capture file into its samples.
pub fn read_capture_path_with(path: &Path, limits: &Limits) -> Result<Vec<Sample>, ReadError> {
    match kind_of(path) {
        Some(Kind::Torch) => samples_from_torch(path, read_torch(path, limits)?),
        Some(Kind::Npy) => {
            let (t, notes) = read_npy_noted(path, limits)?;
            let mut s = single_array(path, Format::Npy, t);
            s.notes = notes;
            Ok(vec![s])
        }
        Some(Kind::Npz) => {
            let (named, notes) = read_npz_noted(path, limits)?;
            let entries = named
                .into_iter()
                .map(|(k, t)| (k, Value::Tensor(t)))
                .collect();
            let mut out = samples_from_entries(path, Format::Npz, 0, entries)?;
            for s in &mut out {
                s.notes.extend(notes.iter().cloned());
            }
            Ok(out)
        }
        Some(Kind::Safetensors) => {
            let f = read_safetensors(path, limits)?;
            let mut entries: Vec<(String, Value)> = f
                .tensors
                .into_iter()
                .map(|(k, t)| (k, Value::Tensor(t)))
                .collect();
            entries.extend(f.metadata.into_iter().map(|(k, v)| (k, Value::Str(v))));
            samples_from_entries(path, Format::Safetensors, 0, entries)
        }
        None => Err(ReadError::UnknownExtension {
            path: path.to_path_buf(),
        }),
    }
}

/// Every capture file under `path` (recursively; symlinked folders are not followed), sorted
/// with digit runs compared as numbers (`data_2` before `data_10`), recognised extensions only.
/// A file path is returned as is when its extension is recognised.
pub fn capture_files(path: &Path) -> Result<Vec<PathBuf>, ReadError> {
    let meta = std::fs::metadata(path).map_err(|error| ReadError::Io {
        path: path.to_path_buf(),
        error,
    })?;
    if !meta.is_dir() {
        return match kind_of(path) {
            Some(_) => Ok(vec![path.to_path_buf()]),
            None => Err(ReadError::UnknownExtension {
                path: path.to_path_buf(),
            }),
        };
    }
    let mut out = Vec::new();
    walk(path, 0, &mut out)?;
    out.sort_by(|a, b| natural_cmp(&a.to_string_lossy(), &b.to_string_lossy()));
    Ok(out)
}

fn walk(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) -> Result<(), ReadError> {
    const MAX_DEPTH: usize = 64;
    let io = |error| ReadError::Io {
        path: dir.to_path_buf(),
        error,
    };
    if depth > MAX_DEPTH {
        return Err(ReadError::Format {
            path: dir.to_path_buf(),
            detail: format!("folders nest deeper than {MAX_DEPTH} levels"),
        });
    }
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let entry = entry.map_err(io)?;
        let p = entry.path();
        let ft = entry.file_type().map_err(io)?;
        if ft.is_dir() {
            walk(&p, depth + 1, out)?;
        } else if (ft.is_file() || (ft.is_symlink() && p.is_file())) && kind_of(&p).is_some() {
            out.push(p);
        }
    }
    Ok(())
}

/// Compares strings with runs of ASCII digits ordered by numeric value.
pub(super) fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        if a[i].is_ascii_digit() && b[j].is_ascii_digit() {
            let si = i;
            while i < a.len() && a[i].is_ascii_digit() {
                i += 1;
            }
            let sj = j;
            while j < b.len() && b[j].is_ascii_digit() {
                j += 1;
            }
            let na = trim_zeros(&a[si..i]);
            let nb = trim_zeros(&b[sj..j]);
            let ord = na.len().cmp(&nb.len()).then_with(|| na.cmp(nb));
            if ord != Ordering::Equal {
                return ord;
            }
        } else {
            if a[i] != b[j] {
                return a[i].cmp(&b[j]);
            }
            i += 1;
            j += 1;
        }
    }
    (a.len() - i).cmp(&(b.len() - j)).then_with(|| a.cmp(b))
}

fn trim_zeros(d: &[u8]) -> &[u8] {
    let k = d.iter().take_while(|&&c| c == b'0').count();
    d.get(k..).unwrap_or(&[])
}

fn layout_err(path: &Path, detail: String) -> ReadError {
    ReadError::Layout {
        path: path.to_path_buf(),
        detail,
    }
}

/// One array (an `.npy` or a bare torch tensor): `[S, k*H]` or `[1, S, k*H]` is aux.
fn single_array(path: &Path, format: Format, t: HostTensor) -> Sample {
    let mut s = Sample::new(path, 0, format);
    let float = t.dtype.is_float();
    match t.rank() {
        2 if float => s.aux = Some(t),
        3 if float && t.dims().first() == Some(&1) => s.aux = t.squeeze0(),
        _ => {
            let stem = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.split('.').next())
                .unwrap_or("array")
                .to_string();
            s.named.push((stem, t));
        }
    }
    s
}

fn is_pass_file(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("Pass"))
        .and_then(|n| n.strip_suffix(".pt"))
        .is_some_and(|d| !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit()))
}

fn dict_entries(items: Vec<(Value, Value)>) -> Vec<(String, Value)> {
    items
        .into_iter()
        .map(|(k, v)| (key_string(&k), v))
        .collect()
}

/// Appends every tensor inside `v` to `named` under dotted names; returns false (and adds
/// nothing) when `v` holds no tensor.
fn flatten_tensors(prefix: &str, v: Value, named: &mut Vec<(String, HostTensor)>) -> bool {
    if !v.contains_tensor() {
        return false;
    }
    match v {
        Value::Tensor(t) => named.push((prefix.to_string(), t)),
        Value::List(xs) | Value::Tuple(xs) => {
            for (i, x) in xs.into_iter().enumerate() {
                flatten_tensors(&format!("{prefix}.{i}"), x, named);
            }
        }
        Value::Dict(items) => {
            for (k, x) in items {
                flatten_tensors(&format!("{prefix}.{}", key_string(&k)), x, named);
            }
        }
        _ => {}
    }
    true
}

fn samples_from_torch(path: &Path, v: Value) -> Result<Vec<Sample>, ReadError> {
    match v {
        Value::Tensor(t) => Ok(vec![single_array(path, Format::Torch, t)]),
        Value::Dict(items) => {
            let entries = dict_entries(items);
            if let Some(s) = sglang_dumper(path, &entries) {
                return Ok(vec![s]);
            }
            if is_pass_file(path) {
                return Ok(vec![sglang_pass(path, entries)]);
            }
            samples_from_entries(path, Format::Torch, 0, entries)
        }
        Value::List(xs) | Value::Tuple(xs)
            if !xs.is_empty() && xs.iter().all(|x| matches!(x, Value::Dict(_))) =>
        {
            let mut out = Vec::new();
            for x in xs {
                if let Value::Dict(items) = x {
                    let index = out.len();
                    out.extend(samples_from_entries(
                        path,
                        Format::Torch,
                        index,
                        dict_entries(items),
                    )?);
                }
            }
            Ok(out)
        }
        other => Err(layout_err(
            path,
            format!(
                "holds a {} at the top level, not a dict of tensors",
                other.kind()
            ),
        )),
    }
}

/// `{"value": ..., "meta": {...}}` as sglang's dumper writes it.
fn sglang_dumper(path: &Path, entries: &[(String, Value)]) -> Option<Sample> {
    let find = |key: &str| entries.iter().find(|(k, _)| k == key).map(|(_, v)| v);
    let (Some(value), Some(Value::Dict(meta))) = (find("value"), find("meta")) else {
        return None;
    };
    if entries.len() != 2 {
        return None;
    }
    let mut s = Sample::new(path, 0, Format::SglangDumper);
    s.meta = dict_entries(meta.clone());
    let from_file = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.split("___").find_map(|p| p.strip_prefix("name=")))
        .map(|n| n.strip_suffix(".pt").unwrap_or(n).to_string());
    let name = s
        .meta("name")
        .and_then(Value::as_str)
        .map(str::to_string)
        .or(from_file)
        .unwrap_or_else(|| "value".to_string());
    if !flatten_tensors(&name, value.clone(), &mut s.named) {
        s.meta.push(("value".to_string(), value.clone()));
    }
    if name == "input_ids"
        && let Some(ids) = s.tensor("input_ids").and_then(ids_1d)
    {
        s.token_ids = Some(ids);
    }
    Some(s)
}

fn ids_1d(t: &HostTensor) -> Option<Vec<i64>> {
    if t.rank() == 1 { t.to_i64_vec() } else { None }
}

fn sglang_pass(path: &Path, entries: Vec<(String, Value)>) -> Sample {
    let mut s = Sample::new(path, 0, Format::SglangPass);
    for (k, v) in entries {
        if !flatten_tensors(&k, v.clone(), &mut s.named) {
            s.meta.push((k, v));
        }
    }
    s.token_ids = s
        .named
        .iter()
        .find(|(n, _)| n.ends_with("forward_batch_info.input_ids"))
        .and_then(|(_, t)| ids_1d(t));
    s
}

/// The generic recogniser for a name -> value mapping.
fn samples_from_entries(
    path: &Path,
    container: Format,
    index: usize,
    entries: Vec<(String, Value)>,
) -> Result<Vec<Sample>, ReadError> {
    let has = |k: &str| entries.iter().any(|(n, _)| n == k);
    let rank_of = |k: &str| {
        entries
            .iter()
            .find(|(n, _)| n == k)
            .and_then(|(_, v)| v.as_tensor())
            .map(HostTensor::rank)
    };
    let format = if container != Format::Torch {
        // Plain containers keep their own name; vLLM is recognised by its two tensors.
        if container == Format::Safetensors
            && has("token_ids")
            && rank_of("hidden_states") == Some(3)
        {
            Format::Vllm
        } else {
            container
        }
    } else if has("aux_hidden_state") || has("hidden_state") {
        Format::SpecForge
    } else if has("aux_hidden_states") {
        Format::ModelOpt
    } else if has("token_ids") && rank_of("hidden_states") == Some(3) {
        Format::Vllm
    } else {
        Format::Torch
    };
    // A rank-3 `hidden_states` next to `token_ids` is vLLM's [T, n, H]; elsewhere rank 3 is
    // [B, S, H].
    let layered_hidden = has("token_ids") && !has("aux_hidden_states") && !has("aux_hidden_state");

    let mut ids = None;
    let mut mask = None;
    let mut aux = None;
    let mut hidden = None;
    let mut named = Vec::new();
    let mut meta = Vec::new();
    for (k, v) in entries {
        let slot = match k.as_str() {
            "input_ids" | "token_ids" if ids.is_none() => Some(&mut ids),
            "loss_mask" if mask.is_none() => Some(&mut mask),
            "aux_hidden_state" | "aux_hidden_states" if aux.is_none() => Some(&mut aux),
            "hidden_state" | "hidden_states" if hidden.is_none() => Some(&mut hidden),
            _ => None,
        };
        match (slot, v) {
            (Some(slot), Value::Tensor(t)) => *slot = Some((k, t)),
            (_, v) => {
                if !flatten_tensors(&k, v.clone(), &mut named) {
                    meta.push((k, v));
                }
            }
        }
    }

    // The batch size: from [B, S] ids and [B, S, X] aux/hidden; all must agree.
    let mut batch: Option<(usize, String)> = None;
    let mut agree = |n: usize, name: &str| -> Result<(), ReadError> {
        match &batch {
            Some((b, first)) if *b != n => Err(layout_err(
                path,
                format!("{first} has a batch of {b} but {name} has {n}"),
            )),
            Some(_) => Ok(()),
            None => {
                batch = Some((n, name.to_string()));
                Ok(())
            }
        }
    };
    let lead = |t: &HostTensor| t.dims().first().copied().unwrap_or(0);
    for (name, t) in [&ids, &mask].into_iter().flatten() {
        match t.rank() {
            1 => {}
            2 => agree(lead(t), name)?,
            _ => {
                return Err(layout_err(
                    path,
                    format!(
                        "{name} has shape {}; expected [S] or [B, S]",
                        fmt_shape(t.dims())
                    ),
                ));
            }
        }
        if name != "loss_mask" && t.dims().last() == Some(&0) {
            return Err(layout_err(
                path,
                format!(
                    "{name} has shape {}: it holds no tokens",
                    fmt_shape(t.dims())
                ),
            ));
        }
        if t.to_i64_vec().is_none() && name != "loss_mask" {
            return Err(layout_err(
                path,
                format!("{name} has dtype {}; expected integers", t.dtype),
            ));
        }
    }
    if let Some((name, t)) = &aux {
        match t.rank() {
            2 => {}
            3 => agree(lead(t), name)?,
            _ => {
                return Err(layout_err(
                    path,
                    format!(
                        "{name} has shape {}; expected [S, k*H] or [B, S, k*H]",
                        fmt_shape(t.dims())
                    ),
                ));
            }
        }
    }
    let hidden_is_layers = hidden
        .as_ref()
        .is_some_and(|(_, t)| t.rank() == 3 && layered_hidden);
    if let Some((name, t)) = &hidden {
        match t.rank() {
            2 => {}
            3 if hidden_is_layers => {}
            3 => agree(lead(t), name)?,
            _ => {
                return Err(layout_err(
                    path,
                    format!(
                        "{name} has shape {}; expected [S, H], [B, S, H] or [T, n, H]",
                        fmt_shape(t.dims())
                    ),
                ));
            }
        }
    }
    let b = batch.map_or(1, |(b, _)| b);
    if b == 0 {
        return Err(layout_err(path, "holds a batch of 0 sequences".into()));
    }

    // Row `i` of a batched tensor, or the tensor itself when it carries no batch axis.
    let row = |t: &HostTensor, batched_rank: usize, i: usize| -> Option<HostTensor> {
        if t.rank() == batched_rank {
            t.select0(i)
        } else {
            Some(t.clone())
        }
    };
    let to_ids = |t: HostTensor| -> Vec<i64> {
        t.to_i64_vec()
            .unwrap_or_else(|| t.to_f64_vec().into_iter().map(|x| x as i64).collect())
    };
    let mut out = Vec::with_capacity(b);
    for i in 0..b {
        let mut s = Sample::new(path, index + i, format);
        let missing = || layout_err(path, format!("batch row {i} is missing"));
        if let Some((_, t)) = &ids {
            s.token_ids = Some(to_ids(row(t, 2, i).ok_or_else(missing)?));
        }
        if let Some((_, t)) = &mask {
            s.loss_mask = Some(to_ids(row(t, 2, i).ok_or_else(missing)?));
        }
        if let Some((_, t)) = &aux {
            s.aux = Some(row(t, 3, i).ok_or_else(missing)?);
        }
        if let Some((_, t)) = &hidden {
            if hidden_is_layers {
                s.layers = Some(t.clone());
            } else {
                s.final_hidden = Some(row(t, 3, i).ok_or_else(missing)?);
            }
        }
        s.named = named.clone();
        s.meta = meta.clone();
        out.push(s);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn natural_order() {
        let mut v = vec![
            "d/data_10.ckpt",
            "d/data_2.ckpt",
            "d/data_1.ckpt",
            "c/x.npy",
        ];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            v,
            [
                "c/x.npy",
                "d/data_1.ckpt",
                "d/data_2.ckpt",
                "d/data_10.ckpt"
            ]
        );
        assert_eq!(natural_cmp("a01", "a1"), std::cmp::Ordering::Less);
    }

    #[test]
    fn pass_file_names() {
        assert!(is_pass_file(Path::new("x/Pass00012.pt")));
        assert!(!is_pass_file(Path::new("x/Pass.pt")));
        assert!(!is_pass_file(Path::new("x/Passes.pt")));
    }

    #[test]
    fn batch_disagreement_is_a_layout_error() {
        let entries = vec![
            (
                "input_ids".to_string(),
                Value::Tensor(HostTensor::from_i64(vec![2, 3], &[1, 2, 3, 4, 5, 6]).unwrap()),
            ),
            (
                "aux_hidden_state".to_string(),
                Value::Tensor(HostTensor::from_f32(vec![3, 3, 1], &[0.0; 9]).unwrap()),
            ),
        ];
        let e = samples_from_entries(Path::new("b.ckpt"), Format::Torch, 0, entries).unwrap_err();
        assert_eq!(
            e.to_string(),
            "b.ckpt: input_ids has a batch of 2 but aux_hidden_state has 3"
        );
    }
}
