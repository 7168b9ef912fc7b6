//! Model execution on candle-core tensors (device-agnostic: CPU now, CUDA through the same
//! ops). Targets capture every residual-stream boundary; the draft runs the EAGLE-3 layer.

pub mod deepseek;
pub mod draft;
#[cfg(feature = "cuda")]
pub mod fast;
pub mod fp8;
pub mod gguf;
pub mod llama;
pub mod nn;
pub mod source;

use crate::boundary::FinalNorm;
use crate::config::{Arch, ModelConfig};
use crate::engine::Feed;
use crate::error::{CandleContext, Error, Result};
use crate::locate::{is_gguf, resolve_model_dir};
use crate::naming;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// What a forward pass should keep. Boundaries not asked for are dropped as soon as the next
/// layer has consumed them.
#[derive(Debug, Clone)]
pub struct CaptureRequest {
    /// `None`: every boundary `0..=L`.
    pub boundaries: Option<Vec<usize>>,
    pub final_pre_norm: bool,
    pub logits: bool,
    /// Also keep each layer's MLP output (`extras["mlp_out.{i}"]`): what a fused-residual engine
    /// returns as `hidden_states` before the residual is added.
    pub layer_outputs: bool,
}

impl CaptureRequest {
    pub fn all() -> CaptureRequest {
        CaptureRequest {
            boundaries: None,
            final_pre_norm: true,
            logits: true,
            layer_outputs: false,
        }
    }

    pub fn wants(&self, b: usize) -> bool {
        self.boundaries.as_ref().is_none_or(|bs| bs.contains(&b))
    }
}

/// The tensors one forward pass captured.
#[derive(Debug, Default)]
pub struct Capture {
    /// b -> [T, H], HF semantics (b = L is after the final norm). Compute dtype.
    pub hidden: BTreeMap<usize, Tensor>,
    /// [T, H], the state after the last layer, before the final norm.
    pub final_pre_norm: Option<Tensor>,
    /// [T, V]
    pub logits: Option<Tensor>,
    /// Model-specific observables, e.g. `router.{layer}.topk_idx` for MoE models.
    pub extras: BTreeMap<String, Tensor>,
}

/// How a model computes attention and rope: candle's ops (head-major, `[heads, T, d]`, the
/// CPU default) or the fused kernels on token-major `[T, heads * d]` matrices (the GPU
/// default; on the CPU the kernels' Rust references run, which the parity tests use to check
/// the GPU code path without a GPU).
/// `Fused` (CUDA only, Llama family): the same kernels launched on raw pointers into
/// preallocated buffers ([`fast`]); other architectures take the kernel path there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ComputePath {
    Candle,
    Kernels,
    Fused,
}

impl ComputePath {
    pub fn for_device(device: &Device) -> ComputePath {
        if device.is_cuda() {
            ComputePath::Fused
        } else {
            ComputePath::Candle
        }
    }
}

/// A target model the runner can capture from.
pub trait Target {
    fn config(&self) -> &ModelConfig;
    /// [V, H] token embeddings (the draft shares them when it has none).
    fn embed_tokens(&self) -> &Tensor;
    fn forward(
        &self,
        ids: &[u32],
        want: &CaptureRequest,
        progress: &mut Progress,
    ) -> Result<Capture>;
}

/// Loads a target of any supported architecture from a weight source. A tensor the checkpoint
/// holds and the architecture (as configured) never reads is an error: running without it would
/// compute another model than the checkpoint's (a Llama with `mlp_bias` run without its biases).
pub fn load_target(
    cfg: &ModelConfig,
    src: &dyn source::WeightSource,
    dtype: DType,
    device: &Device,
) -> Result<Box<dyn Target>> {
    load_target_on(cfg, src, dtype, device, ComputePath::for_device(device))
}

/// [`load_target`] with the compute path chosen (tests run the kernel path on the CPU).
pub fn load_target_on(
    cfg: &ModelConfig,
    src: &dyn source::WeightSource,
    dtype: DType,
    device: &Device,
    path: ComputePath,
) -> Result<Box<dyn Target>> {
    let mut vb = source::Vb::new(src, dtype, device);
    vb.fp8_block = cfg.fp8_block;
    let path = match (path, device.is_cuda()) {
        (ComputePath::Fused, false) => ComputePath::Kernels,
        (p, _) => p,
    };
    let model: Box<dyn Target> = match (cfg.arch, path) {
        #[cfg(feature = "cuda")]
        (Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3, ComputePath::Fused) => Box::new(
            fast::FastLlama::new(llama::Llama::load(cfg, &vb, ComputePath::Kernels)?)?,
        ),
        (Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3, _) => {
            Box::new(llama::Llama::load(cfg, &vb, path)?)
        }
        (Arch::DeepseekV3, _) => Box::new(deepseek::Deepseek::load(cfg, &vb, path)?),
    };
    let unread: Vec<String> = vb
        .unread()
        .into_iter()
        .filter(|n| !naming::is_extra_layer(n, cfg.num_layers) && !naming::is_ignored_buffer(n))
        // transformers ties the head to the embeddings and ignores a stored copy.
        .filter(|n| !(cfg.tie_word_embeddings && naming::LM_HEAD_NAMES.contains(&n.as_str())))
        .collect();
    if let Some(first) = unread.first() {
        let hint = if unread.iter().any(|n| n.ends_with(".bias")) {
            "; biases: do `attention_bias` / `mlp_bias` in config.json match the checkpoint?"
        } else {
            ""
        };
        return Err(Error::UnusedTensors {
            path: src.origin().to_path_buf(),
            arch: cfg.model_type.clone(),
            count: unread.len(),
            first: first.clone(),
            hint: hint.to_string(),
        });
    }
    Ok(model)
}

/// A loaded target with its config.
pub struct LoadedTarget {
    pub cfg: ModelConfig,
    pub model: Box<dyn Target>,
}

/// Loads a target from an HF directory, an HF cache entry, or a GGUF file.
pub fn open_target(path: &Path, dtype: DType, device: &Device) -> Result<LoadedTarget> {
    let mut progress = Progress::new("loading target");
    let dir = resolve_model_dir(path)?;
    let (cfg, src): (ModelConfig, Box<dyn source::WeightSource>) = if is_gguf(&dir) {
        let (cfg, src) = gguf::open_gguf(&dir)?;
        (cfg, Box::new(src))
    } else {
        (
            ModelConfig::load(&dir)?,
            Box::new(source::SafetensorsSource::open(&dir)?),
        )
    };
    let model = load_target(&cfg, src.as_ref(), dtype, device)?;
    progress.finish();
    Ok(LoadedTarget { cfg, model })
}

/// The `fc` input `feed` assembles from a capture: [T, k*H], slots in feed order; at b = L the
/// side of the final norm the engine captures.
pub fn assemble_fc_input(feed: &Feed, capture: &Capture, num_layers: usize) -> Result<Tensor> {
    let slots = feed.fed_slots();
    let mut parts = Vec::with_capacity(slots.len());
    for slot in slots {
        let b = slot.boundary.index();
        let t = if b == num_layers && slot.norm == Some(FinalNorm::Pre) {
            capture.final_pre_norm.as_ref()
        } else {
            capture.hidden.get(&b)
        };
        parts.push(t.ok_or_else(|| Error::Capture {
            path: feed.engine.to_string().into(),
            message: format!("boundary {b} was not captured by the forward pass"),
        })?);
    }
    if parts.is_empty() {
        return Err(Error::Capture {
            path: feed.engine.to_string().into(),
            message: "the engine feeds no slots to fc".into(),
        });
    }
    Tensor::cat(&parts, 1).ctx(|| "assembling the fc input".to_string())
}

/// What one decoder layer produced: the residual stream after it, what its FFN added (the
/// tensor a fused-residual engine returns as `hidden_states`), and model-specific observables.
pub(crate) struct LayerStep {
    pub next: Tensor,
    pub ffn_out: Tensor,
    pub extras: Vec<(String, Tensor)>,
}

/// The common body of every target forward: embed, then run `step` per layer, capturing the
/// boundaries asked for on the way. Returns the capture and the state after the last layer.
pub(crate) fn run_decoder(
    embed: &Tensor,
    ids: &[u32],
    num_layers: usize,
    want: &CaptureRequest,
    progress: &mut Progress,
    mut step: impl FnMut(usize, &Tensor) -> Result<LayerStep>,
) -> Result<(Capture, Tensor)> {
    let mut capture = Capture::default();
    let mut xs = embed
        .index_select(&ids_tensor(ids, embed.device())?, 0)
        .ctx(|| "embedding lookup".to_string())?;
    for i in 0..num_layers {
        if want.wants(i) {
            capture.hidden.insert(i, xs.clone());
        }
        let out = step(i, &xs)?;
        if want.layer_outputs {
            capture.extras.insert(format!("mlp_out.{i}"), out.ffn_out);
        }
        capture.extras.extend(out.extras);
        xs = out.next;
        progress.tick(i + 1, num_layers);
    }
    progress.finish();
    Ok((capture, xs))
}

/// The common end of every target forward: keep the pre-norm state, apply the final norm, the
/// logits, and `b = L` (post-norm, HF semantics) as asked.
pub(crate) fn finish_capture(
    capture: &mut Capture,
    xs: Tensor,
    norm: &nn::RmsNorm,
    lm_head: &Tensor,
    want: &CaptureRequest,
    num_layers: usize,
) -> Result<()> {
    let normed = norm.forward(&xs).ctx(|| "final norm".to_string())?;
    if want.final_pre_norm {
        capture.final_pre_norm = Some(xs);
    }
    if want.logits {
        let logits = lm_head
            .t()
            .and_then(|w| normed.matmul(&w))
            .ctx(|| "lm_head".to_string())?;
        capture.logits = Some(logits);
    }
    if want.wants(num_layers) {
        capture.hidden.insert(num_layers, normed);
    }
    Ok(())
}

/// Token ids as a [T] u32 tensor.
pub fn ids_tensor(ids: &[u32], device: &Device) -> Result<Tensor> {
    Tensor::new(ids, device).ctx(|| "token ids".to_string())
}

/// Progress on stderr for a step that takes more than a moment: a spinner with the time spent,
/// turned into a bar once `tick` gives a total. A thin wrapper over [`crate::progress`]
/// (indicatif), drawn only on a terminal and only when the output is for people.
pub struct Progress {
    label: String,
    start: Instant,
    bar: indicatif::ProgressBar,
}

impl Progress {
    pub fn new(label: &str) -> Progress {
        Progress {
            label: label.to_string(),
            start: Instant::now(),
            bar: crate::progress::spinner(label),
        }
    }

    pub fn hidden() -> Progress {
        Progress {
            label: String::new(),
            start: Instant::now(),
            bar: indicatif::ProgressBar::hidden(),
        }
    }

    pub fn tick(&mut self, done: usize, total: usize) {
        crate::progress::to_bar(&self.bar, total as u64);
        self.bar.set_position(done as u64);
    }

    /// Clears the bar and, when it was drawn for more than a moment, says how long it took.
    pub fn finish(&mut self) {
        if self.bar.is_hidden() || self.bar.is_finished() {
            return;
        }
        self.bar.finish_and_clear();
        let secs = self.start.elapsed().as_secs_f64();
        if secs > 0.5 {
            eprintln!("{}: done in {secs:.1} s", self.label);
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}
