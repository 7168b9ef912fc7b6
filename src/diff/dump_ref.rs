//! Reference states read from dumps of every layer an engine (or `eagle-check run --dump`)
//! wrote: the plain dumps here, sglang's through [`super::sglang_ref`].

use super::reference::{RefStates, ReferenceOptions, ReferenceSource};
use crate::error::{Error, Result};
use crate::readers::{Format, read_capture_path};
use std::path::{Path, PathBuf};

/// Reference states read from dumps of every layer: eagle-check's own `run --dump` files
/// (`input_ids`, `hidden_states.{b}`, `final_pre_norm`), vLLM `extract_hidden_states` files
/// made with layer ids `0..=L` (raw, b = id; `1..=L` on DeepSeek, whose backbone cannot
/// capture b = 0) whose last slot is the final pre-norm state (`token_ids`, `hidden_states`
/// [T, n, H]), and sglang's dumper or debug-tensor-dump files ([`super::sglang_ref`]).
pub struct DumpReference {
    path: PathBuf,
    entries: Vec<RefStates>,
    num_layers: usize,
    hidden_size: usize,
    facts: Vec<(String, String)>,
}

impl DumpReference {
    pub fn open(path: &Path) -> Result<DumpReference> {
        DumpReference::open_with(path, &ReferenceOptions::default())
    }

    pub fn open_with(path: &Path, opts: &ReferenceOptions) -> Result<DumpReference> {
        let files = crate::readers::capture_files(path)?;
        let (sglang, plain): (Vec<PathBuf>, Vec<PathBuf>) = files
            .into_iter()
            .partition(|f| crate::readers::sglang::is_sglang_dump(f));
        let mut entries = Vec::new();
        let mut facts = Vec::new();
        for file in &plain {
            for sample in read_capture_path(file)? {
                let states = dump_states(&sample, file, opts.num_layers)?;
                if sample.format == Format::Vllm {
                    facts.push((
                        "reference_layout".to_string(),
                        format!(
                            "vLLM extract_hidden_states: {} slots read as b = {}..={} (the last pre-norm)",
                            sample.layers.as_ref().map_or(0, |t| t.dims()[1]),
                            if states.boundaries.first().is_some_and(Option::is_some) { 0 } else { 1 },
                            states.num_layers
                        ),
                    ));
                }
                entries.push(states);
            }
        }
        if !sglang.is_empty() {
            let read = super::sglang_ref::read(path, &sglang, opts)?;
            entries.extend(read.entries);
            facts.extend(read.facts);
        }
        facts.dedup();
        let first = entries.first().ok_or_else(|| Error::Capture {
            path: path.to_path_buf(),
            message: "no reference dump found".into(),
        })?;
        let (num_layers, hidden_size) = (first.num_layers, first.hidden_size);
        // Rows 0 wide would make every capture width divide by zero in the diff.
        if hidden_size == 0 {
            return Err(Error::Capture {
                path: path.to_path_buf(),
                message: "reference states are 0 wide (hidden size 0)".into(),
            });
        }
        if let Some(bad) = entries
            .iter()
            .find(|e| e.num_layers != num_layers || e.hidden_size != hidden_size)
        {
            return Err(Error::Capture {
                path: path.to_path_buf(),
                message: format!(
                    "reference dumps disagree on the target ({} layers x {} vs {} x {})",
                    num_layers, hidden_size, bad.num_layers, bad.hidden_size
                ),
            });
        }
        Ok(DumpReference {
            path: path.to_path_buf(),
            entries,
            num_layers,
            hidden_size,
            facts,
        })
    }

    /// The sequences read, for tests and messages.
    pub fn entries(&self) -> &[RefStates] {
        &self.entries
    }
}

fn dump_states(
    sample: &crate::readers::Sample,
    file: &Path,
    num_layers: Option<usize>,
) -> Result<RefStates> {
    let bad = |message: String| Error::Capture {
        path: file.to_path_buf(),
        message,
    };
    let tokens = sample
        .token_ids
        .clone()
        .ok_or_else(|| bad("reference dump without token ids".into()))?;
    let t = tokens.len();
    if sample.format == Format::Vllm {
        let layers = sample
            .layers
            .as_ref()
            .ok_or_else(|| bad("vLLM dump without hidden_states".into()))?;
        let [rows, n, h] = layers.dims() else {
            return Err(bad(format!(
                "hidden_states has shape {:?}, expected [T, L + 1, H]",
                layers.dims()
            )));
        };
        if *rows != t || *n < 2 {
            return Err(bad(format!(
                "hidden_states {:?} does not match {t} tokens",
                layers.dims()
            )));
        }
        let (n, h) = (*n, *h);
        let all = layers.to_f32_vec();
        let slot = |j: usize| -> Vec<f32> {
            (0..t)
                .flat_map(|r| all[(r * n + j) * h..(r * n + j + 1) * h].iter().copied())
                .collect()
        };
        // Slots are b = 0..=L (ids 0..=L, raw), or b = 1..=L where the backbone cannot capture
        // the embedding (vLLM's deepseek_v2.py: id 0 crashes, so `plan` asks for 1..=L). Only
        // the layer count tells the two apart.
        let (l, first) = match num_layers {
            Some(l) if n == l + 1 => (l, 0),
            Some(l) if n == l => (l, 1),
            Some(l) => {
                return Err(bad(format!(
                    "hidden_states holds {n} layer slots; an all-layer dump of a {l}-layer target \
                     holds {} (ids 0..={l}) or {l} (ids 1..={l})",
                    l + 1
                )));
            }
            None => (n - 1, 0),
        };
        let mut boundaries: Vec<Option<Vec<f32>>> = vec![None; l + 1];
        for (b, state) in boundaries.iter_mut().enumerate().take(l).skip(first) {
            *state = Some(slot(b - first));
        }
        // Post-norm b = L is not in a vLLM dump; its last slot is the pre-norm state.
        return Ok(RefStates {
            tokens,
            hidden_size: h,
            num_layers: l,
            boundaries,
            final_pre_norm: Some(slot(n - 1)),
            no_residual: vec![None; l + 1],
        });
    }
    let mut boundaries = Vec::new();
    while let Some(tensor) = sample.tensor(&format!("hidden_states.{}", boundaries.len())) {
        if tensor.dims().len() != 2 || tensor.dims()[0] != t {
            return Err(bad(format!(
                "hidden_states.{} has shape {:?}",
                boundaries.len(),
                tensor.dims()
            )));
        }
        boundaries.push(tensor.to_f32_vec());
    }
    if boundaries.len() < 2 {
        return Err(bad("not a reference dump: expected hidden_states.0 ... hidden_states.L (eagle-check run --dump) or a vLLM all-layer file".into()));
    }
    let h = boundaries[0].len() / t.max(1);
    let l = boundaries.len() - 1;
    let final_pre_norm = sample.tensor("final_pre_norm").map(|t| t.to_f32_vec());
    // Every state must be [T, H] with the same H, or scoring would read past a row.
    if h == 0
        || boundaries
            .iter()
            .chain(final_pre_norm.iter())
            .any(|b| b.len() != t * h)
    {
        return Err(bad(format!(
            "reference states disagree on [T, H] (T = {t})"
        )));
    }
    Ok(RefStates {
        tokens,
        hidden_size: h,
        num_layers: l,
        boundaries: boundaries.into_iter().map(Some).collect(),
        final_pre_norm,
        no_residual: vec![None; l + 1],
    })
}

impl ReferenceSource for DumpReference {
    fn num_layers(&self) -> usize {
        self.num_layers
    }

    fn hidden_size(&self) -> usize {
        self.hidden_size
    }

    fn describe(&self) -> String {
        format!(
            "dump: {} ({} sequences)",
            self.path.display(),
            self.entries.len()
        )
    }

    fn facts(&self) -> Vec<(String, String)> {
        self.facts.clone()
    }

    fn states(&mut self, tokens: &[i64]) -> Result<RefStates> {
        // A capture may cover a prefix of the dumped sequence (an engine dump holds the prompt).
        let entry = self
            .entries
            .iter()
            .find(|e| e.tokens.len() >= tokens.len() && e.tokens[..tokens.len()] == *tokens)
            .ok_or_else(|| Error::Capture {
                path: self.path.clone(),
                message: format!(
                    "no reference sequence starts with the capture's {} tokens",
                    tokens.len()
                ),
            })?;
        let (t, h) = (tokens.len(), entry.hidden_size);
        let cut = |v: &Option<Vec<f32>>| v.as_ref().map(|v| v[..t * h].to_vec());
        Ok(RefStates {
            tokens: tokens.to_vec(),
            hidden_size: h,
            num_layers: entry.num_layers,
            boundaries: entry.boundaries.iter().map(cut).collect(),
            final_pre_norm: cut(&entry.final_pre_norm),
            no_residual: entry.no_residual.iter().map(cut).collect(),
        })
    }
}
