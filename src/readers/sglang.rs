//! sglang's two dump layouts regrouped into forward passes: one file per tensor from its
//! dumper (`DUMPER_ENABLE=1`), one file per forward from `--debug-tensor-dump-output-folder`.
//!
//! sglang 0.5.23 sources (read from the wheel):
//! - dumper, `srt/debug_utils/dumper.py`: `_Dumper._dump_single` writes
//!   `{DUMPER_DIR}/{exp_name}/step={s}___rank={r}___dump_index={i}___name={name}___{tag}={v}....pt`
//!   (`_format_tags`), each `torch.save({"value": value, "meta": {step, rank, dump_index, name,
//!   tags..., world_rank, world_size, sglang_parallel_info}})`; `step` counts forward passes
//!   (`ModelRunner.forward` calls `dumper.step()`), `rank` is the global rank; the
//!   non-intrusive dumper tags every dump inside module `*.layers.N` with `layer_id=N`
//!   (`_NonIntrusiveDumper._detect_module_ctx`) and dumps the forward batch's `input_ids` and
//!   `positions` (its "core fields").
//! - debug tensor dump, `srt/debug_utils/tensor_dump_forward_hook.py`: one
//!   `TP{tp}_PP{pp}_Rank{rank}_pid{pid}/Pass{NNNNN}.pt` per forward, a dict from module name to
//!   output (a tuple of tensors as a list), plus `model.forward_batch_info.{input_ids,
//!   positions, seq_lens}`; with EAGLE the folders sit under `target/` and `draft/`
//!   (`load_model_utils.py maybe_register_debug_tensor_dump_hook`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::layout::{Format, Sample, read_capture_path};
use super::pickle::Value;
use super::{HostTensor, ReadError};

/// Which of sglang's two writers made a pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DumpLayout {
    /// The dumper: one file per tensor.
    Dumper,
    /// `--debug-tensor-dump-output-folder`: one file per forward pass.
    Pass,
}

/// One dumped tensor of a pass.
#[derive(Debug, Clone)]
pub struct DumpTensor {
    /// The dump name (dumper) or the module name (pass files), lists flattened as `name.0`.
    pub name: String,
    /// The dumper's `layer_id` tag, when the dump carries one.
    pub layer_id: Option<i64>,
    pub tensor: HostTensor,
    pub file: PathBuf,
}

/// Everything one rank dumped during one forward pass.
#[derive(Debug, Clone)]
pub struct DumpPass {
    pub layout: DumpLayout,
    /// `target` or `draft` for EAGLE debug tensor dumps; `None` otherwise.
    pub role: Option<String>,
    /// The dumper's `step`, or the pass number.
    pub step: u64,
    /// The dumper's global rank, or the pass folder's TP rank.
    pub rank: u64,
    /// The folder (dumper) or the pass file.
    pub origin: PathBuf,
    /// In dump order.
    pub tensors: Vec<DumpTensor>,
    /// [T] the forward batch's token ids.
    pub input_ids: Option<Vec<i64>>,
    /// [T] their positions (a new sequence starts at 0).
    pub positions: Option<Vec<i64>>,
}

/// Whether `path` is one of sglang's dump files (by its name).
pub fn is_sglang_dump(path: &Path) -> bool {
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    is_dumper_name(name) || is_pass_name(name)
}

fn is_dumper_name(name: &str) -> bool {
    name.ends_with(".pt") && name.starts_with("step=") && name.contains("___name=")
}

fn is_pass_name(name: &str) -> bool {
    name.strip_prefix("Pass")
        .and_then(|n| n.strip_suffix(".pt"))
        .is_some_and(|d| !d.is_empty() && d.bytes().all(|c| c.is_ascii_digit()))
}

/// `k=v` tags of a dumper file name, in order.
fn file_tags(name: &str) -> Vec<(String, String)> {
    let stem = name.strip_suffix(".pt").unwrap_or(name);
    stem.split("___")
        .filter_map(|part| part.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `TP{t}_PP{p}_Rank{r}_pid{pid}` -> (t, p).
fn pass_folder(name: &str) -> Option<(u64, u64)> {
    let mut tp = None;
    let mut pp = None;
    for part in name.split('_') {
        if let Some(v) = part.strip_prefix("TP") {
            tp = v.parse().ok();
        } else if let Some(v) = part.strip_prefix("PP") {
            pp = v.parse().ok();
        }
    }
    Some((tp?, pp?))
}

fn int_tag(meta: &[(String, Value)], tags: &[(String, String)], key: &str) -> Option<i64> {
    meta.iter()
        .find(|(k, _)| k == key)
        .and_then(|(_, v)| match v {
            Value::Int(i) => Some(*i),
            Value::Str(s) => s.parse().ok(),
            _ => None,
        })
        .or_else(|| {
            tags.iter()
                .find(|(k, _)| k == key)
                .and_then(|(_, v)| v.parse().ok())
        })
}

fn ids_of(t: &HostTensor) -> Option<Vec<i64>> {
    if t.rank() == 1 { t.to_i64_vec() } else { None }
}

fn layout_err(path: &Path, detail: String) -> ReadError {
    ReadError::Layout {
        path: path.to_path_buf(),
        detail,
    }
}

/// Reads sglang dump files (either layout, any mix of ranks and passes) into passes, ordered by
/// (layout, role, step, rank). Files that are not sglang dumps are refused.
pub fn read_sglang_passes(files: &[PathBuf]) -> Result<Vec<DumpPass>, ReadError> {
    type Key = (DumpLayout, Option<String>, u64, u64);
    let mut passes: BTreeMap<Key, DumpPass> = BTreeMap::new();
    for file in files {
        let name = file
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default()
            .to_string();
        let samples = read_capture_path(file)?;
        for sample in samples {
            match sample.format {
                Format::SglangDumper => add_dumper(&mut passes, file, &name, sample)?,
                Format::SglangPass => add_pass(&mut passes, file, &name, sample)?,
                _ => {
                    return Err(layout_err(
                        file,
                        "not an sglang dump (expected a dumper file step=..___rank=..___name=...pt \
                         or a Pass{NNNNN}.pt in a TP{t}_PP{p}_Rank{r}_pid{pid} folder)"
                            .into(),
                    ));
                }
            }
        }
    }
    Ok(passes.into_values().collect())
}

fn add_dumper(
    passes: &mut BTreeMap<(DumpLayout, Option<String>, u64, u64), DumpPass>,
    file: &Path,
    name: &str,
    sample: Sample,
) -> Result<(), ReadError> {
    let tags = file_tags(name);
    let step = int_tag(&sample.meta, &tags, "step");
    let rank = int_tag(&sample.meta, &tags, "rank");
    let (Some(step), Some(rank)) = (step, rank) else {
        return Err(layout_err(
            file,
            "sglang dumper file without step= and rank= (in its name or its meta)".into(),
        ));
    };
    let (Ok(step), Ok(rank)) = (u64::try_from(step), u64::try_from(rank)) else {
        return Err(layout_err(
            file,
            format!("negative step {step} or rank {rank}"),
        ));
    };
    let layer_id = int_tag(&sample.meta, &tags, "layer_id");
    let origin = file.parent().map(Path::to_path_buf).unwrap_or_default();
    let pass = passes
        .entry((DumpLayout::Dumper, None, step, rank))
        .or_insert_with(|| DumpPass {
            layout: DumpLayout::Dumper,
            role: None,
            step,
            rank,
            origin,
            tensors: Vec::new(),
            input_ids: None,
            positions: None,
        });
    for (tensor_name, tensor) in sample.named {
        match tensor_name.as_str() {
            "input_ids" if pass.input_ids.is_none() => pass.input_ids = ids_of(&tensor),
            "positions" if pass.positions.is_none() => pass.positions = ids_of(&tensor),
            _ => pass.tensors.push(DumpTensor {
                name: tensor_name,
                layer_id,
                tensor,
                file: file.to_path_buf(),
            }),
        }
    }
    Ok(())
}

fn add_pass(
    passes: &mut BTreeMap<(DumpLayout, Option<String>, u64, u64), DumpPass>,
    file: &Path,
    name: &str,
    sample: Sample,
) -> Result<(), ReadError> {
    let number: u64 = name
        .strip_prefix("Pass")
        .and_then(|n| n.strip_suffix(".pt"))
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| layout_err(file, "pass file name is not Pass{NNNNN}.pt".into()))?;
    let folder = file.parent();
    let (tp, _pp) = folder
        .and_then(|d| d.file_name())
        .and_then(|n| n.to_str())
        .and_then(pass_folder)
        .unwrap_or((0, 0));
    let role = folder
        .and_then(Path::parent)
        .and_then(|d| d.file_name())
        .and_then(|n| n.to_str())
        .filter(|n| *n == "target" || *n == "draft")
        .map(str::to_string);
    // Pipeline stages of one TP rank hold disjoint layers of the same forward: one pass.
    let pass = passes
        .entry((DumpLayout::Pass, role.clone(), number, tp))
        .or_insert_with(|| DumpPass {
            layout: DumpLayout::Pass,
            role,
            step: number,
            rank: tp,
            origin: file.to_path_buf(),
            tensors: Vec::new(),
            input_ids: None,
            positions: None,
        });
    for (tensor_name, tensor) in sample.named {
        if tensor_name.ends_with("forward_batch_info.input_ids") {
            if pass.input_ids.is_none() {
                pass.input_ids = ids_of(&tensor);
            }
        } else if tensor_name.ends_with("forward_batch_info.positions") {
            if pass.positions.is_none() {
                pass.positions = ids_of(&tensor);
            }
        } else if !tensor_name.contains("forward_batch_info.") {
            pass.tensors.push(DumpTensor {
                name: tensor_name,
                layer_id: None,
                tensor,
                file: file.to_path_buf(),
            });
        }
    }
    Ok(())
}

/// The sequences a pass holds, as `(start row, length)`: each run of positions that starts at
/// 0 and counts up by one (a batched prefill holds one run per request). Runs that start later
/// (a decode step, a chunk after the first, a prefix-cache hit) are not whole sequences and
/// are counted in the second value. Without positions the whole pass is one sequence.
pub fn sequences(pass: &DumpPass, rows: usize) -> (Vec<(usize, usize)>, usize) {
    let Some(pos) = pass.positions.as_ref().filter(|p| p.len() == rows) else {
        return (vec![(0, rows)], 0);
    };
    let mut out = Vec::new();
    let mut partial = 0;
    let mut start = 0;
    while start < rows {
        let mut end = start + 1;
        while end < rows && pos[end] == pos[end - 1] + 1 {
            end += 1;
        }
        if pos[start] == 0 {
            out.push((start, end - start));
        } else {
            partial += 1;
        }
        start = end;
    }
    (out, partial)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dumper_file_tags() {
        let t =
            file_tags("step=3___rank=1___dump_index=7___name=eagle_aux_capture___layer_id=12.pt");
        assert_eq!(t[0], ("step".into(), "3".into()));
        assert_eq!(t[3], ("name".into(), "eagle_aux_capture".into()));
        assert_eq!(t[4], ("layer_id".into(), "12".into()));
        assert!(is_dumper_name(
            "step=0___rank=0___dump_index=1___name=input_ids___recompute_status=disabled.pt"
        ));
        assert!(!is_dumper_name("data_0.ckpt"));
        assert_eq!(pass_folder("TP3_PP1_Rank7_pid4242"), Some((3, 1)));
        assert_eq!(pass_folder("dump_1700000000"), None);
    }

    #[test]
    fn sequences_split_on_position_resets() {
        let pass = DumpPass {
            layout: DumpLayout::Dumper,
            role: None,
            step: 0,
            rank: 0,
            origin: PathBuf::new(),
            tensors: Vec::new(),
            input_ids: None,
            positions: Some(vec![0, 1, 2, 0, 1, 7, 8, 0]),
        };
        // [0,1,2] and [0,1] are whole; [7,8] continues a cached prefix; [0] is whole.
        assert_eq!(sequences(&pass, 8), (vec![(0, 3), (3, 2), (7, 1)], 1));
        assert_eq!(sequences(&pass, 5), (vec![(0, 5)], 0));
    }
}
