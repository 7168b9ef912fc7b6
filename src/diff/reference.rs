//! Reference boundaries for a token sequence: from the runner (the target model run here) or
//! from a dump a distributed engine made of every layer. Both are one interface.

use super::names::NameMap;
use crate::error::{CandleContext, Error, Result};
use crate::model::{
    Capture, CaptureRequest, LoadedTarget, ManyOptions, Progress, Sink, TargetOptions,
};
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

    /// Refuses tokens the source cannot compute states for (ids outside the target's
    /// vocabulary), before any pass.
    fn check_tokens(&self, _tokens: &[i64]) -> Result<()> {
        Ok(())
    }

    /// Whether the source reads its weights again at each pass over the samples (a streamed
    /// target).
    fn streams(&self) -> bool {
        false
    }

    /// Bytes of one value of the reference states where the batched identification keeps
    /// them: 2 where a GPU forward makes bf16 states (kept as made, see
    /// [`crate::diff::online::OnlineSample::take`]), else 4 (f32).
    fn state_bytes(&self) -> u64 {
        4
    }

    /// Bytes of the target's weights held at once in the memory a budget bounds (all of them
    /// resident, one or two layers streamed); 0 for a source that runs nothing.
    fn held_bytes(&self) -> u64 {
        0
    }

    /// Whether [`ReferenceSource::run_many`] runs: the runner does, a dump does not.
    fn runs_many(&self) -> bool {
        false
    }

    /// Whether passes after the next one will run ([`crate::model::Target::keep_for_later`]).
    fn keep_for_later(&mut self, _later: bool) {}

    /// The reference states of many token sequences at once, each handed to `sink` as the
    /// target makes it (every boundary, the pre-norm state, each layer's output), the target's
    /// layers run once for all of them. Only where [`ReferenceSource::runs_many`].
    fn run_many(&mut self, _tokens: &[&[i64]], _sink: &mut Sink) -> Result<()> {
        Err(Error::Usage(format!(
            "{} computes no reference states of its own",
            self.describe()
        )))
    }
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
        crate::model::report::report_target(report, &self.target);
    }

    fn runs_many(&self) -> bool {
        true
    }

    fn held_bytes(&self) -> u64 {
        self.target.memory.held()
    }

    fn state_bytes(&self) -> u64 {
        let on_gpu = !self.target.model.device().is_cpu();
        if on_gpu && self.target.memory.dtype == DType::BF16 {
            2
        } else {
            4
        }
    }

    fn streams(&self) -> bool {
        self.target.model.stream_stats().is_some()
    }

    fn keep_for_later(&mut self, later: bool) {
        self.target.model.keep_for_later(later);
    }

    fn check_tokens(&self, tokens: &[i64]) -> Result<()> {
        self.ids(tokens).map(|_| ())
    }

    fn run_many(&mut self, tokens: &[&[i64]], sink: &mut Sink) -> Result<()> {
        let ids = tokens
            .iter()
            .map(|t| self.ids(t))
            .collect::<Result<Vec<_>>>()?;
        let ids: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
        let start = std::time::Instant::now();
        let opts = ManyOptions::for_device(self.target.model.device());
        let done = self
            .target
            .model
            .forward_many(&ids, &reference_request(), &opts, sink);
        self.forward_seconds += start.elapsed().as_secs_f64();
        done
    }

    fn states(&mut self, tokens: &[i64]) -> Result<RefStates> {
        let cfg = &self.target.cfg;
        let ids = self.ids(tokens)?;
        let want = reference_request();
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

/// What the runner captures as a reference: every boundary, the pre-norm state and each
/// layer's output; no logits.
fn reference_request() -> CaptureRequest {
    CaptureRequest {
        boundaries: None,
        final_pre_norm: true,
        logits: false,
        layer_outputs: true,
    }
}

impl RunnerReference {
    /// `tokens` as the target's ids, refused when one lies outside its vocabulary.
    fn ids(&self, tokens: &[i64]) -> Result<Vec<u32>> {
        let cfg = &self.target.cfg;
        tokens
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

/// A [`ReferenceSource`] that counts the samples the diff compares on a spinner.
pub struct Counted<'a> {
    inner: &'a mut dyn ReferenceSource,
    bar: indicatif::ProgressBar,
    label: String,
    count: u64,
}

impl<'a> Counted<'a> {
    pub fn new(inner: &'a mut dyn ReferenceSource, label: &str) -> Counted<'a> {
        Counted {
            inner,
            bar: crate::progress::spinner(label),
            label: label.to_string(),
            count: 0,
        }
    }

    /// Clears the spinner.
    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl ReferenceSource for Counted<'_> {
    fn num_layers(&self) -> usize {
        self.inner.num_layers()
    }

    fn hidden_size(&self) -> usize {
        self.inner.hidden_size()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn device(&self) -> candle_core::Device {
        self.inner.device()
    }

    fn facts(&self) -> Vec<(String, String)> {
        self.inner.facts()
    }

    fn report_resources(&self, report: &mut Report) {
        self.inner.report_resources(report);
    }

    fn runs_many(&self) -> bool {
        self.inner.runs_many()
    }

    fn state_bytes(&self) -> u64 {
        self.inner.state_bytes()
    }

    fn held_bytes(&self) -> u64 {
        self.inner.held_bytes()
    }

    fn streams(&self) -> bool {
        self.inner.streams()
    }

    fn keep_for_later(&mut self, later: bool) {
        self.inner.keep_for_later(later);
    }

    fn check_tokens(&self, tokens: &[i64]) -> Result<()> {
        self.inner.check_tokens(tokens)
    }

    fn run_many(&mut self, tokens: &[&[i64]], sink: &mut Sink) -> Result<()> {
        let done = self.inner.run_many(tokens, sink);
        self.count += tokens.len() as u64;
        self.bar
            .set_message(format!("{}: {}", self.label, self.count));
        done
    }

    fn states(&mut self, tokens: &[i64]) -> Result<RefStates> {
        let states = self.inner.states(tokens);
        self.count += 1;
        self.bar
            .set_message(format!("{}: {}", self.label, self.count));
        states
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}
