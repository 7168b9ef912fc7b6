//! Model execution on candle-core tensors (device-agnostic: CPU now, CUDA through the same
//! ops). Targets capture every residual-stream boundary; the draft runs the EAGLE-3 layer.

mod cpu;
pub mod deepseek;
pub mod draft;
#[cfg(feature = "cuda")]
pub mod fast;
pub mod fp8;
pub(crate) mod gemma;
pub(crate) mod gemma4;
pub mod gguf;
pub mod io;
pub mod llama;
pub(crate) mod llama4;
pub(crate) mod moe;
pub mod nn;
pub mod phases;
pub(crate) mod qwen35;
pub mod report;
pub mod source;
pub(crate) mod sparse;
pub mod stream;

use crate::boundary::FinalNorm;
use crate::config::{Arch, ModelConfig};
use crate::engine::Feed;
use crate::error::{CandleContext, Error, Result};
use crate::locate::{is_gguf, resolve_model_dir};
use crate::memory::Budget;
use crate::naming;
use candle_core::{DType, Device, Tensor};
use deepseek::DeepseekDecoder;
use gemma::GemmaDecoder;
use llama::LlamaDecoder;
use llama4::Llama4Decoder;
use qwen35::Qwen35Decoder;
use sparse::SparseDecoder;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;
use stream::{MemoryPlan, Residency, StreamOptions, StreamStats, WeightEstimate};

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

/// What a forward over many samples ([`Target::forward_many`]) hands its consumer, one sample's
/// tensor at a time, in the order the forward makes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Produced {
    /// Boundary b, HF semantics (b = L after the final norm): `[T, H]`.
    Boundary(usize),
    /// What decoder layer i's feed-forward added to the residual stream (`mlp_out.{i}` of a
    /// single forward): `[T, H]`.
    LayerOutput(usize),
    /// The state after the last layer, before the final norm: `[T, H]`.
    FinalPreNorm,
    /// `[T, V]`.
    Logits,
}

/// The consumer of a forward over many samples: `(sample, what, tensor)`, in the compute dtype
/// on the target's device. The tensor is the forward's own: keep a clone only as long as needed.
pub type Sink<'a> = dyn FnMut(usize, Produced, &Tensor) -> Result<()> + 'a;

/// How a forward over many samples runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ManyOptions {
    /// Consecutive samples are packed into one forward of up to this many tokens (positions
    /// restarting per sample, attention within each), so short samples share every weight
    /// read and every launch; a longer sample runs alone. 0: one sample per forward.
    pub pack_tokens: usize,
}

impl ManyOptions {
    /// One sample per forward.
    pub const UNPACKED: ManyOptions = ManyOptions { pack_tokens: 0 };

    /// Packing where it pays: on a GPU, where short samples are launch- and weight-bound
    /// ([`GPU_PACK_TOKENS`]). Not on the CPU, which is compute-bound at any length, and where
    /// one sample per forward keeps every capture the bits of the sample's own forward (packed
    /// rows are those bits for the Llama family in f32, within 1.3e-6 for the MoE families,
    /// whose expert GEMMs then see other row counts: tests/stream.rs).
    pub fn for_device(device: &Device) -> ManyOptions {
        if device.is_cuda() {
            ManyOptions {
                pack_tokens: GPU_PACK_TOKENS,
            }
        } else {
            ManyOptions::UNPACKED
        }
    }
}

/// Tokens per packed forward on a GPU: an 8B-shape forward is GEMM-bound from about 2048
/// tokens on (BENCHMARKS.md, the H200 runs), and 4096 keeps the activations of one pass small.
pub const GPU_PACK_TOKENS: usize = 4096;

/// Hands a single forward's capture of sample `s` to `sink` in the order a layer-major forward
/// would make its tensors: b = 0, then per layer its output and the boundary after it, then the
/// pre-norm state, the logits and b = L.
pub(crate) fn emit_capture(
    s: usize,
    mut cap: Capture,
    num_layers: usize,
    sink: &mut Sink,
) -> Result<()> {
    if let Some(t) = cap.hidden.remove(&0).filter(|_| num_layers > 0) {
        sink(s, Produced::Boundary(0), &t)?;
    }
    for i in 0..num_layers {
        if let Some(t) = cap.extras.remove(&format!("mlp_out.{i}")) {
            sink(s, Produced::LayerOutput(i), &t)?;
        }
        if i + 1 < num_layers
            && let Some(t) = cap.hidden.remove(&(i + 1))
        {
            sink(s, Produced::Boundary(i + 1), &t)?;
        }
    }
    if let Some(t) = cap.final_pre_norm.take() {
        sink(s, Produced::FinalPreNorm, &t)?;
    }
    if let Some(t) = cap.logits.take() {
        sink(s, Produced::Logits, &t)?;
    }
    if let Some(t) = cap.hidden.remove(&num_layers) {
        sink(s, Produced::Boundary(num_layers), &t)?;
    }
    Ok(())
}

/// Token embeddings by row: a resident `[V, H]` table, or rows read from the checkpoint on
/// demand (a streamed target, whose table never sits in memory whole).
pub trait EmbedRows {
    /// `[ids.len(), H]` in the compute dtype.
    fn rows(&self, ids: &[u32]) -> Result<Tensor>;
}

impl EmbedRows for Tensor {
    fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        self.index_select(&ids_tensor(ids, self.device())?, 0)
            .ctx(|| "embedding lookup".to_string())
    }
}

/// A target model the runner can capture from.
pub trait Target {
    fn config(&self) -> &ModelConfig;
    /// Where the target computes.
    fn device(&self) -> &Device;
    /// The token embeddings (the draft shares them when it has none).
    fn embeddings(&self) -> &dyn EmbedRows;
    fn forward(
        &self,
        ids: &[u32],
        want: &CaptureRequest,
        progress: &mut Progress,
    ) -> Result<Capture>;
    /// The forwards of many token sequences, each tensor handed to `sink` as it is made and
    /// dropped once the next layer has consumed it (never every boundary of every sample at
    /// once). Each sample's tensors are those its own [`Target::forward`] computes, bit for
    /// bit. By default one forward per sample; decoders run it layer by layer over every
    /// sample ([`ManyRun`]), so a streamed target reads each layer once for all of them.
    fn forward_many(
        &self,
        samples: &[&[u32]],
        want: &CaptureRequest,
        _opts: &ManyOptions,
        sink: &mut Sink,
    ) -> Result<()> {
        let n = self.config().num_layers;
        for (s, ids) in samples.iter().enumerate() {
            let cap = self.forward(ids, want, &mut Progress::hidden())?;
            emit_capture(s, cap, n, sink)?;
        }
        Ok(())
    }
    /// What streaming the layers cost so far; `None` for a resident target.
    fn stream_stats(&self) -> Option<StreamStats> {
        None
    }
    /// Whether forwards after the next one will run the same layers again: a streamed target
    /// then keeps the layers it reads in host memory for them ([`stream::StreamOptions::host_keep`]),
    /// and otherwise reads each once and lets it go (keeping costs locking the memory and
    /// unlocking it at the end, for nothing when no forward follows). Until told, it does not.
    fn keep_for_later(&self, _later: bool) {}
}

/// One architecture's decoder, layer by layer: how layer `i` is loaded and how it runs. The
/// resident target ([`Resident`]) and the streamed one ([`stream::Streamed`]) both run through
/// it, so each architecture has one loading and one forward code path.
pub(crate) trait Decoder: Send + Sync {
    type Layer: Send;
    /// What every layer of one forward shares (rope tables, the mask) for T tokens.
    type Ctx: Sync;
    fn config(&self) -> &ModelConfig;
    fn dtype(&self) -> DType;
    /// Decoder layer `i`, from `m` (the decoder prefix: `m.pp("layers.{i}")` holds it).
    fn load_layer(&self, m: &source::Vb, i: usize) -> Result<Self::Layer>;
    fn context(&self, seq_len: usize, device: &Device) -> Result<Self::Ctx>;
    /// The context of sequences packed one after another (`lens`, in order) into one forward:
    /// positions restart at each and no token attends across the end of one, so each
    /// sequence's rows are what its own forward computes. `None` when this decoder runs one
    /// sequence per forward.
    fn context_packed(&self, _lens: &[usize], _device: &Device) -> Result<Option<Self::Ctx>> {
        Ok(None)
    }
    /// b = 0 from the embedding rows `[T, H]`: the rows themselves, Gemma's times sqrt(H).
    fn embed(&self, rows: Tensor) -> Result<Tensor> {
        Ok(rows)
    }
    /// The final norm, under the decoder prefix `m`.
    fn final_norm(&self, m: &source::Vb) -> Result<nn::RmsNorm> {
        let cfg = self.config();
        nn::RmsNorm::load(&m.pp("norm"), cfg.hidden_size, cfg.rms_norm_eps)
    }
    /// The logits from the head's product `[T, V]`: themselves, Gemma's softcapped.
    fn logits(&self, logits: Tensor) -> Result<Tensor> {
        Ok(logits)
    }
    /// Layer `i` over all tokens: `xs` [T, H] in, the residual stream after it out.
    fn step(
        &self,
        layer: &Self::Layer,
        i: usize,
        xs: &Tensor,
        ctx: &Self::Ctx,
    ) -> Result<LayerStep>;
}

/// A target with every weight in memory, converted once at load.
pub(crate) struct Resident<D: Decoder> {
    pub(crate) dec: D,
    /// [V, H]
    pub(crate) embed: Tensor,
    pub(crate) layers: Vec<D::Layer>,
    pub(crate) norm: nn::RmsNorm,
    /// [V, H]; the embeddings themselves when tied.
    pub(crate) lm_head: Tensor,
}

impl<D: Decoder> Resident<D> {
    pub(crate) fn load(dec: D, vb: &source::Vb) -> Result<Resident<D>> {
        let cfg = dec.config();
        let m = llama::decoder_prefix(vb);
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed = m.get("embed_tokens.weight", &[v, h])?;
        // Layers past num_hidden_layers (DeepSeek-V3's MTP layer 61) are not part of the target.
        let layers = (0..cfg.num_layers)
            .map(|i| dec.load_layer(&m, i))
            .collect::<Result<Vec<_>>>()?;
        let lm_head = llama::output_head(cfg, vb, &embed)?;
        let norm = dec.final_norm(&m)?;
        Ok(Resident {
            dec,
            embed,
            layers,
            norm,
            lm_head,
        })
    }
}

impl<D: Decoder> Target for Resident<D> {
    fn config(&self) -> &ModelConfig {
        self.dec.config()
    }

    fn device(&self) -> &Device {
        self.embed.device()
    }

    fn embeddings(&self) -> &dyn EmbedRows {
        &self.embed
    }

    fn forward(
        &self,
        ids: &[u32],
        want: &CaptureRequest,
        progress: &mut Progress,
    ) -> Result<Capture> {
        let dev = self.embed.device();
        phases::mark("start", dev);
        let ctx = self.dec.context(ids.len(), dev)?;
        let n = self.layers.len();
        let mut run = DecoderRun::new(self.dec.embed(self.embed.rows(ids)?)?, want, n, progress);
        phases::mark("embedding + context", dev);
        for (i, layer) in self.layers.iter().enumerate() {
            run.layer(i, |xs| self.dec.step(layer, i, xs, &ctx))?;
            phases::mark("residual + capture", dev);
        }
        let (mut capture, xs) = run.finish();
        finish_capture(&mut capture, xs, &self.norm, want, n, |normed| {
            let logits = self
                .lm_head
                .t()
                .and_then(|w| normed.matmul(&w))
                .ctx(|| "lm_head".to_string())?;
            self.dec.logits(logits)
        })?;
        phases::mark("final norm + lm_head", dev);
        Ok(capture)
    }

    fn forward_many(
        &self,
        samples: &[&[u32]],
        want: &CaptureRequest,
        opts: &ManyOptions,
        sink: &mut Sink,
    ) -> Result<()> {
        let dev = self.embed.device();
        let mut run = ManyRun::new(
            &self.dec,
            samples,
            want,
            opts,
            sink,
            |ids| self.embed.rows(ids),
            dev,
        )?;
        for (i, layer) in self.layers.iter().enumerate() {
            run.layer(i, layer)?;
        }
        run.finish(&self.norm, |normed| {
            let logits = self
                .lm_head
                .t()
                .and_then(|w| normed.iter().map(|x| x.matmul(&w)).collect())
                .ctx(|| "lm_head".to_string())?;
            Ok(logits)
        })
    }
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
        (Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3, ComputePath::Fused) => {
            Box::new(fast::FastLlama::new(Resident::load(
                LlamaDecoder::new(cfg, dtype, ComputePath::Kernels),
                &vb,
            )?)?)
        }
        (Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 | Arch::Phi3, _) => {
            Box::new(Resident::load(LlamaDecoder::new(cfg, dtype, path), &vb)?)
        }
        (Arch::DeepseekV3 | Arch::Glm4MoeLite, _) => Box::new(Resident::load(
            DeepseekDecoder::new(cfg, dtype, path)?,
            &vb,
        )?),
        (
            Arch::Qwen3Moe
            | Arch::Qwen2Moe
            | Arch::Qwen3VlMoe
            | Arch::MiniMaxM2
            | Arch::Glm4Moe
            | Arch::GptOss,
            _,
        ) => Box::new(Resident::load(SparseDecoder::new(cfg, dtype, path)?, &vb)?),
        (Arch::Llama4, _) => Box::new(Resident::load(Llama4Decoder::new(cfg, dtype, path)?, &vb)?),
        (Arch::Qwen35Moe | Arch::Qwen3Next, _) => {
            Box::new(Resident::load(Qwen35Decoder::new(cfg, dtype, path)?, &vb)?)
        }
        (Arch::Gemma3 | Arch::Gemma4, _) => {
            Box::new(Resident::load(GemmaDecoder::new(cfg, dtype, path)?, &vb)?)
        }
    };
    refuse_unread(cfg, src, vb.unread())?;
    Ok(model)
}

/// Loads a target that holds no decoder layer: each forward streams them from `src` one at a
/// time ([`stream::Streamed`]).
pub fn load_streamed(
    cfg: &ModelConfig,
    src: Box<dyn source::WeightSource>,
    dtype: DType,
    device: &Device,
    opts: StreamOptions,
) -> Result<Box<dyn Target>> {
    // The fused CUDA forward holds every layer; streamed, the GPU runs the kernel path.
    let path = match ComputePath::for_device(device) {
        ComputePath::Fused => ComputePath::Kernels,
        p => p,
    };
    Ok(match cfg.arch {
        Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Qwen3 | Arch::Phi3 => Box::new(
            stream::Streamed::open(LlamaDecoder::new(cfg, dtype, path), src, device, opts)?,
        ),
        Arch::DeepseekV3 | Arch::Glm4MoeLite => Box::new(stream::Streamed::open(
            DeepseekDecoder::new(cfg, dtype, path)?,
            src,
            device,
            opts,
        )?),
        Arch::Qwen3Moe
        | Arch::Qwen2Moe
        | Arch::Qwen3VlMoe
        | Arch::MiniMaxM2
        | Arch::Glm4Moe
        | Arch::GptOss => Box::new(stream::Streamed::open(
            SparseDecoder::new(cfg, dtype, path)?,
            src,
            device,
            opts,
        )?),
        Arch::Llama4 => Box::new(stream::Streamed::open(
            Llama4Decoder::new(cfg, dtype, path)?,
            src,
            device,
            opts,
        )?),
        Arch::Qwen35Moe | Arch::Qwen3Next => Box::new(stream::Streamed::open(
            Qwen35Decoder::new(cfg, dtype, path)?,
            src,
            device,
            opts,
        )?),
        Arch::Gemma3 | Arch::Gemma4 => Box::new(stream::Streamed::open(
            GemmaDecoder::new(cfg, dtype, path)?,
            src,
            device,
            opts,
        )?),
    })
}

/// Fails on checkpoint tensors no loader read (`unread`), leaving out what no architecture
/// reads: layers past `num_layers`, saved buffers, a stored copy of a tied head.
pub(crate) fn refuse_unread(
    cfg: &ModelConfig,
    src: &dyn source::WeightSource,
    unread: Vec<String>,
) -> Result<()> {
    let unread: Vec<String> = unread
        .into_iter()
        .filter(|n| !naming::is_never_loaded(n, cfg.num_layers, cfg.tie_word_embeddings))
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
    Ok(())
}

/// How to open a target: the compute dtype and device, and how its weights may be held.
#[derive(Debug, Clone)]
pub struct TargetOptions {
    pub dtype: DType,
    pub device: Device,
    /// `--stream-layers`: stream the decoder layers even when the model would fit.
    pub stream_layers: bool,
    /// `--max-memory`: the budget in bytes (resident memory on the CPU, device memory on a
    /// GPU); without it the memory available when the target is opened.
    pub max_memory: Option<u64>,
}

impl TargetOptions {
    /// Resident unless the model does not fit in the memory available.
    pub fn new(dtype: DType, device: &Device) -> TargetOptions {
        TargetOptions {
            dtype,
            device: device.clone(),
            stream_layers: false,
            max_memory: None,
        }
    }
}

/// A loaded target with its config and how its weights are held.
pub struct LoadedTarget {
    pub cfg: ModelConfig,
    pub model: Box<dyn Target>,
    pub memory: MemoryPlan,
}

/// Loads a target from an HF directory, an HF cache entry, or a GGUF file, resident unless it
/// would not fit in the memory available.
pub fn open_target(path: &Path, dtype: DType, device: &Device) -> Result<LoadedTarget> {
    open_target_with(path, &TargetOptions::new(dtype, device))
}

/// [`open_target`] with the streaming options. The decision is made from the weight headers
/// before any weight is read: the model streams when asked to, or when its weights in the
/// compute dtype would not fit the budget (said on stderr); a budget smaller than one decoder
/// layer is refused.
pub fn open_target_with(path: &Path, opts: &TargetOptions) -> Result<LoadedTarget> {
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
    let estimate = WeightEstimate::of(&cfg, src.as_ref(), opts.dtype);
    let budget = Budget::resolve(opts.max_memory, &opts.device);
    let plan = stream::plan(
        estimate,
        opts.stream_layers,
        budget,
        opts.dtype,
        &dir,
        stream::stages_on_host(&opts.device),
        stream::copy_ahead_asked(),
    )?;
    if plan.automatic {
        eprintln!("eagle-check: {}", plan.why_streamed());
    }
    let model = match plan.residency {
        Residency::Resident => {
            let order = io::resident_order(src.as_ref(), cfg.num_layers, cfg.tie_word_embeddings);
            let (dtype, device) = (opts.dtype, &opts.device);
            io::read_ahead(src.as_ref(), &order, dtype, device, &plan.reads(), |src| {
                load_target(&cfg, src, dtype, device)
            })?
        }
        Residency::Streamed { prefetch } => {
            let stream = StreamOptions {
                prefetch,
                reads: plan.reads(),
                host_keep: if plan.host_staged {
                    stream::host_keep_budget()
                } else {
                    0
                },
                copy_ahead: plan.copies_ahead,
                ..StreamOptions::default()
            };
            load_streamed(&cfg, src, opts.dtype, &opts.device, stream)?
        }
    };
    crate::memory::note_device_use(&opts.device);
    progress.finish();
    Ok(LoadedTarget {
        cfg,
        model,
        memory: plan,
    })
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

/// The common body of every target forward: from the embedded tokens, one [`DecoderRun::layer`]
/// per decoder layer, capturing the boundaries asked for on the way.
pub(crate) struct DecoderRun<'a> {
    capture: Capture,
    /// [T, H], the residual stream: the input of the next layer.
    xs: Tensor,
    want: &'a CaptureRequest,
    num_layers: usize,
    progress: &'a mut Progress,
}

impl<'a> DecoderRun<'a> {
    /// `xs`: [T, H], the embeddings of the tokens (b = 0).
    pub(crate) fn new(
        xs: Tensor,
        want: &'a CaptureRequest,
        num_layers: usize,
        progress: &'a mut Progress,
    ) -> DecoderRun<'a> {
        DecoderRun {
            capture: Capture::default(),
            xs,
            want,
            num_layers,
            progress,
        }
    }

    /// Layer `i` on the current state: b = i (its input) is captured first, if asked for.
    pub(crate) fn layer(
        &mut self,
        i: usize,
        step: impl FnOnce(&Tensor) -> Result<LayerStep>,
    ) -> Result<()> {
        if self.want.wants(i) {
            self.capture.hidden.insert(i, self.xs.clone());
        }
        let out = step(&self.xs)?;
        if self.want.layer_outputs {
            self.capture
                .extras
                .insert(format!("mlp_out.{i}"), out.ffn_out);
        }
        self.capture.extras.extend(out.extras);
        self.xs = out.next;
        self.progress.tick(i + 1, self.num_layers);
        Ok(())
    }

    /// The capture and the state after the last layer.
    pub(crate) fn finish(self) -> (Capture, Tensor) {
        self.progress.finish();
        (self.capture, self.xs)
    }
}

/// The body of every decoder's [`Target::forward_many`]: every sample's residual stream and
/// context held at once, each layer run over all of them before the next is needed, each state
/// handed to the sink as it is made. Consecutive samples are packed into one forward where the
/// decoder can ([`Decoder::context_packed`]) up to [`ManyOptions::pack_tokens`]. Memory:
/// `samples x T x H` activations, not a boundary more.
pub(crate) struct ManyRun<'a, 's, D: Decoder> {
    dec: &'a D,
    /// Per packed forward: `[sum T, H]`, the input of the next layer.
    xs: Vec<Tensor>,
    ctxs: Vec<D::Ctx>,
    /// Per packed forward: its samples, each `(sample, first row, rows)`.
    packs: Vec<Vec<(usize, usize, usize)>>,
    want: &'a CaptureRequest,
    sink: &'a mut Sink<'s>,
}

impl<'a, 's, D: Decoder> ManyRun<'a, 's, D> {
    /// Packs and embeds every sample (`rows`: the embedding rows of some ids) and hands over
    /// b = 0.
    pub(crate) fn new(
        dec: &'a D,
        samples: &[&[u32]],
        want: &'a CaptureRequest,
        opts: &ManyOptions,
        sink: &'a mut Sink<'s>,
        rows: impl Fn(&[u32]) -> Result<Tensor>,
        device: &Device,
    ) -> Result<ManyRun<'a, 's, D>> {
        let mut run = ManyRun {
            dec,
            xs: Vec::new(),
            ctxs: Vec::new(),
            packs: Vec::new(),
            want,
            sink,
        };
        for pack in packs(samples, opts.pack_tokens) {
            let lens: Vec<usize> = pack.iter().map(|&s| samples[s].len()).collect();
            let ctx = match pack.len() {
                1 => None,
                _ => dec.context_packed(&lens, device)?,
            };
            let (members, ctx) = match ctx {
                Some(ctx) => (vec![pack], vec![ctx]),
                None => {
                    let ctxs = lens
                        .iter()
                        .map(|&t| dec.context(t, device))
                        .collect::<Result<Vec<_>>>()?;
                    (pack.into_iter().map(|s| vec![s]).collect(), ctxs)
                }
            };
            for (members, ctx) in members.into_iter().zip(ctx) {
                let ids: Vec<u32> = members
                    .iter()
                    .flat_map(|&s| samples[s].iter().copied())
                    .collect();
                let x = dec.embed(rows(&ids)?)?;
                let mut at = 0;
                let mut placed = Vec::with_capacity(members.len());
                for &s in &members {
                    placed.push((s, at, samples[s].len()));
                    at += samples[s].len();
                }
                run.xs.push(x);
                run.ctxs.push(ctx);
                run.packs.push(placed);
            }
        }
        if want.wants(0) && dec.config().num_layers > 0 {
            for p in 0..run.xs.len() {
                run.hand(p, Produced::Boundary(0), &run.xs[p].clone())?;
            }
        }
        Ok(run)
    }

    /// Hands each sample's rows of packed forward `p`'s tensor `xs` to the sink.
    fn hand(&mut self, p: usize, what: Produced, xs: &Tensor) -> Result<()> {
        if let [(s, _, _)] = self.packs[p][..] {
            return (self.sink)(s, what, xs);
        }
        for &(s, at, len) in &self.packs[p] {
            let rows = xs
                .narrow(0, at, len)
                .ctx(|| format!("sample {s} of a packed forward"))?;
            (self.sink)(s, what, &rows)?;
        }
        Ok(())
    }

    /// Layer `i` over every sample; its output and the boundary after it handed over.
    pub(crate) fn layer(&mut self, i: usize, layer: &D::Layer) -> Result<()> {
        let n = self.dec.config().num_layers;
        for p in 0..self.xs.len() {
            let out = self.dec.step(layer, i, &self.xs[p], &self.ctxs[p])?;
            if self.want.layer_outputs {
                self.hand(p, Produced::LayerOutput(i), &out.ffn_out)?;
            }
            self.xs[p] = out.next;
            if i + 1 < n && self.want.wants(i + 1) {
                self.hand(p, Produced::Boundary(i + 1), &self.xs[p].clone())?;
            }
        }
        Ok(())
    }

    /// The final norm over every sample: the pre-norm state, the logits (`head`: each packed
    /// forward's normed `[T, H]` to its `[T, V]`) and b = L, as asked.
    pub(crate) fn finish(
        mut self,
        norm: &nn::RmsNorm,
        head: impl FnOnce(&[Tensor]) -> Result<Vec<Tensor>>,
    ) -> Result<()> {
        let n = self.dec.config().num_layers;
        // The final norm only where the logits or b = L are asked for.
        let normed = if self.want.logits || self.want.wants(n) {
            self.xs
                .iter()
                .map(|x| norm.forward(x).ctx(|| "final norm".to_string()))
                .collect::<Result<Vec<_>>>()?
        } else {
            Vec::new()
        };
        if self.want.final_pre_norm {
            for p in 0..self.xs.len() {
                self.hand(p, Produced::FinalPreNorm, &self.xs[p].clone())?;
            }
        }
        if self.want.logits {
            let logits = head(&normed)?;
            for (p, lg) in logits.into_iter().enumerate() {
                let lg = self.dec.logits(lg)?;
                self.hand(p, Produced::Logits, &lg)?;
            }
        }
        if self.want.wants(n) {
            for (p, x) in normed.iter().enumerate() {
                self.hand(p, Produced::Boundary(n), x)?;
            }
        }
        Ok(())
    }
}

/// Consecutive samples in packs of at most `budget` tokens (a longer sample alone); every
/// sample alone when `budget` is 0.
pub(crate) fn packs(samples: &[&[u32]], budget: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut tokens = 0;
    for (s, ids) in samples.iter().enumerate() {
        match out.last_mut() {
            Some(last) if budget > 0 && tokens + ids.len() <= budget => {
                last.push(s);
                tokens += ids.len();
            }
            _ => {
                out.push(vec![s]);
                tokens = ids.len();
            }
        }
    }
    out
}

/// The common end of every target forward: keep the pre-norm state, apply the final norm, the
/// logits (`head`: [T, H] normed -> [T, V]), and `b = L` (post-norm, HF semantics) as asked.
pub(crate) fn finish_capture(
    capture: &mut Capture,
    xs: Tensor,
    norm: &nn::RmsNorm,
    want: &CaptureRequest,
    num_layers: usize,
    head: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<()> {
    let normed = norm.forward(&xs).ctx(|| "final norm".to_string())?;
    if want.final_pre_norm {
        capture.final_pre_norm = Some(xs);
    }
    if want.logits {
        capture.logits = Some(head(&normed)?);
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
