//! Reference boundaries for a token sequence: from the runner (the target model run here) or
//! from a dump a distributed engine made of every layer. Both are one interface.

use super::names::NameMap;
use crate::error::{CandleContext, Error, Result};
use crate::model::{Capture, CaptureRequest, LoadedTarget, Progress, TargetOptions};
use crate::readers::{Format, read_capture_path};
use crate::report::Report;
use candle_core::{DType, Tensor};
use std::path::{Path, PathBuf};

/// Every reference state of one sequence, f32 row-major `[T, H]` each.
pub struct RefStates {
    pub tokens: Vec<i64>,
    pub hidden_size: usize,
    pub num_layers: usize,
    /// b = 0..=L, HF semantics (b = L after the final norm, when known).
    pub boundaries: Vec<Option<Vec<f32>>>,
    /// The state after the last layer, before the final norm.
    pub final_pre_norm: Option<Vec<f32>>,
    /// Per b = 1..=L (index b): what layer b-1 adds without the residual stream (its MLP
    /// output), the tensor a fused-residual engine hands back as `hidden_states`.
    pub no_residual: Vec<Option<Vec<f32>>>,
}

impl RefStates {
    pub fn rows(&self) -> usize {
        self.tokens.len()
    }
}

/// A source of reference states for token sequences.
pub trait ReferenceSource {
    fn num_layers(&self) -> usize;
    fn hidden_size(&self) -> usize;
    fn describe(&self) -> String;
    /// Reference states for exactly these tokens.
    fn states(&mut self, tokens: &[i64]) -> Result<RefStates>;
    /// Where the scoring against these states runs: the runner's device, else the CPU.
    fn device(&self) -> candle_core::Device {
        candle_core::Device::Cpu
    }
    /// What the report should say about how the reference was read (key, value).
    fn facts(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    /// Facts about the resources the source used (the runner's memory), once every sample
    /// was compared.
    fn report_resources(&self, _report: &mut Report) {}
}

/// The target model, run here on each sample's tokens.
pub struct RunnerReference {
    pub target: LoadedTarget,
    pub path: PathBuf,
    /// Seconds spent in target forwards (the benchmark reports the split).
    pub forward_seconds: f64,
}

impl RunnerReference {
    /// Opens the target at `path` as `opts` say (streamed with `--stream-layers`, or when it
    /// does not fit `--max-memory` / the memory available).
    pub fn open(path: &Path, opts: &TargetOptions) -> Result<RunnerReference> {
        Ok(RunnerReference {
            target: crate::model::open_target_with(path, opts)?,
            path: path.to_path_buf(),
            forward_seconds: 0.0,
        })
    }
}

fn to_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .ctx(|| "reading a reference state".to_string())
}

impl ReferenceSource for RunnerReference {
    fn num_layers(&self) -> usize {
        self.target.cfg.num_layers
    }

    fn hidden_size(&self) -> usize {
        self.target.cfg.hidden_size
    }

    fn describe(&self) -> String {
        format!(
            "runner: {} ({})",
            self.target.cfg.model_type,
            self.path.display()
        )
    }

    fn device(&self) -> candle_core::Device {
        self.target.model.device().clone()
    }

    fn report_resources(&self, report: &mut Report) {
        crate::memory::report_target(report, &self.target);
    }

    fn states(&mut self, tokens: &[i64]) -> Result<RefStates> {
        let cfg = &self.target.cfg;
        let ids = tokens
            .iter()
            .map(|&t| {
                u32::try_from(t)
                    .ok()
                    .filter(|&t| (t as usize) < cfg.vocab_size)
            })
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| Error::Tokens {
                origin: self.path.display().to_string(),
                message: format!(
                    "token ids outside the target's vocabulary (vocab_size {})",
                    cfg.vocab_size
                ),
            })?;
        let want = CaptureRequest {
            boundaries: None,
            final_pre_norm: true,
            logits: false,
            layer_outputs: true,
        };
        let start = std::time::Instant::now();
        let capture: Capture = self
            .target
            .model
            .forward(&ids, &want, &mut Progress::hidden())?;
        self.forward_seconds += start.elapsed().as_secs_f64();
        let l = cfg.num_layers;
        let mut boundaries = Vec::with_capacity(l + 1);
        for b in 0..=l {
            boundaries.push(capture.hidden.get(&b).map(to_vec).transpose()?);
        }
        let mut no_residual = vec![None];
        for layer in 0..l {
            no_residual.push(
                capture
                    .extras
                    .get(&format!("mlp_out.{layer}"))
                    .map(to_vec)
                    .transpose()?,
            );
        }
        Ok(RefStates {
            tokens: tokens.to_vec(),
            hidden_size: cfg.hidden_size,
            num_layers: l,
            boundaries,
            final_pre_norm: capture.final_pre_norm.as_ref().map(to_vec).transpose()?,
            no_residual,
        })
    }
}

/// How to read a reference dump whose names or token ids are not self-evident.
#[derive(Debug, Clone, Default)]
pub struct ReferenceOptions {
    /// `--reference-map`: what the dump's tensor names hold (default: the built-in sglang rules).
    pub map: Option<NameMap>,
    /// `--reference-tokens`: the token ids of dumps that carry none, with the file they came from.
    pub tokens: Option<(Vec<i64>, PathBuf)>,
    /// The target's layer count L (from `--target` or the spec), when known.
    pub num_layers: Option<usize>,
    /// The target's hidden size, when known (tells a tensor-parallel shard from a state).
    pub hidden_size: Option<usize>,
}

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
