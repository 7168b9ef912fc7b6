//! Targets larger than memory: the forward runs one decoder layer at a time over all tokens.
//! Layer i is read from the checkpoint (positioned reads, see [`super::source`]), converted or
//! dequantised into the compute dtype by the same loader the resident target uses
//! ([`Decoder::load_layer`]), run, and dropped before layer i + 2 is read; a loader thread reads
//! layer i + 1 while layer i computes. What stays resident: the activations of the T tokens, the
//! boundaries captured, the final norm, and at most two layers. The embeddings are read row by
//! row (only the T tokens'), the output head in chunks of rows, so neither `[V, H]` matrix is
//! ever whole in memory in the compute dtype.
//!
//! Whether a target streams is decided from its weight headers before anything is read
//! ([`plan`]): asked for (`--stream-layers`), or because its weights in the compute dtype would
//! not fit the budget (`--max-memory`, else the memory available).

use crate::config::ModelConfig;
use crate::error::{CandleContext, Error, Result};
use crate::memory::Budget;
use crate::model::io::{self, READ_WINDOW, ReadOptions};
use crate::model::nn::RmsNorm;
use crate::model::source::{Vb, WeightSource};
use crate::model::{
    Capture, CaptureRequest, Decoder, DecoderRun, EmbedRows, ManyOptions, ManyRun, Progress, Sink,
    Target, finish_capture, llama, refuse_unread,
};
use crate::naming;
use crate::size::format_bytes;
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeSet, VecDeque};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// How a streamed target reads its weights.
#[derive(Debug, Clone, Copy)]
pub struct StreamOptions {
    /// Read layer i + 1 while layer i runs (two layers resident at most), else one after the
    /// other (one).
    pub prefetch: bool,
    /// The most bytes one chunk of the output head holds in the compute dtype (two chunks are
    /// in flight with the prefetch).
    pub head_chunk_bytes: usize,
    /// How each layer's tensors are read: several readers, reads ahead of the layer's loader
    /// within what the budget leaves ([`MemoryPlan::read_window`]).
    pub reads: ReadOptions,
    /// Read each layer on the loader thread (for a GPU into host memory) and make its tensors
    /// on the thread that runs the forward ([`io::read_to_host`]), so that one thread makes
    /// every device call. Always so on a GPU; elsewhere (the tests) when asked: the CPU builds each
    /// layer on the loader thread, its conversions overlapping the forward.
    pub host_stage: bool,
    /// Bytes of host memory that host-staged layers ([`StreamOptions::host_stage`]) stay in
    /// after their first read where more forwards follow ([`Target::keep_for_later`]), so that
    /// those copy them to the device from there (locked: [`crate::kernels::KeptHost`]) and
    /// read nothing from the checkpoint ([`host_keep_budget`]); the layers past it are read
    /// again at every forward. 0: none.
    pub host_keep: u64,
    /// Copy a kept layer to the device on a second queue while the layer before computes
    /// ([`crate::kernels::Aside`]): two layers on the device at once
    /// ([`MemoryPlan::copies_ahead`]).
    pub copy_ahead: bool,
}

/// Whether kept layers are copied ahead on a second queue ([`StreamOptions::copy_ahead`]):
/// `EAGLE_CHECK_COPY_AHEAD=1`. Off by default: it holds a second layer on the device, and under
/// a tight `--max-memory` that pushed the device's peak over the budget in one run of three in
/// BENCHMARKS.md run 71 and in one of six in runs 72-74 (by 0.01 GiB), where it saved
/// 0.23-0.26 s in the second pass of three.
pub fn copy_ahead_asked() -> bool {
    std::env::var("EAGLE_CHECK_COPY_AHEAD").is_ok_and(|v| v.trim() == "1")
}

/// The host memory a GPU's streamed layers may stay in between forwards
/// ([`StreamOptions::host_keep`]): `EAGLE_CHECK_HOST_KEEP` (a size, `0` for none), else half of
/// what the kernel says can be taken without swapping when the target opens. Kept, the
/// checkpoint is read once however many forwards there are (a diff's passes); measured on an
/// H100 machine in BENCHMARKS.md, runs 67-69.
pub fn host_keep_budget() -> u64 {
    host_keep_from(
        std::env::var("EAGLE_CHECK_HOST_KEEP").ok().as_deref(),
        crate::memory::mem_available(),
    )
}

/// [`host_keep_budget`] from the variable's value and the memory available (unknown: nothing
/// is kept unless a size is given): a value that is neither a size nor `half` keeps nothing,
/// and says so on stderr.
fn host_keep_from(var: Option<&str>, available: Option<u64>) -> u64 {
    match var.map(str::trim) {
        None | Some("half") => available.map_or(0, |b| b / 2),
        Some(v) => crate::size::parse_size(v).unwrap_or_else(|e| {
            eprintln!("eagle-check: EAGLE_CHECK_HOST_KEEP: {e}; no layer is kept in host memory");
            0
        }),
    }
}

/// Whether a streamed layer on `device` is read on the loader thread and put on the device by
/// the forward's thread ([`StreamOptions::host_stage`]): on a GPU, where two threads making
/// device calls at once stalled (BENCHMARKS.md, runs 28-30 and 40).
pub fn stages_on_host(device: &Device) -> bool {
    device.is_cuda()
}

impl Default for StreamOptions {
    /// 64 MiB chunks are 4096 rows of an 8B model's head in f32: the head is read in ~32 large
    /// sequential reads, small against any budget that holds a layer.
    fn default() -> StreamOptions {
        StreamOptions {
            prefetch: true,
            head_chunk_bytes: 64 << 20,
            reads: ReadOptions::default(),
            host_stage: false,
            host_keep: 0,
            copy_ahead: false,
        }
    }
}

/// A target's weights as its headers declare them, in bytes of the compute dtype: what the
/// loaded tensors hold once dequantised, not what the files hold.
#[derive(Debug, Clone)]
pub struct WeightEstimate {
    /// Everything the resident target holds (FP8 weights dequantised, their block scales
    /// dropped; MXFP4 weights as their values, two a stored byte, their scales dropped; GGUF
    /// tensors as the element shapes their headers declare, whatever the quantisation).
    pub total: u64,
    /// Per decoder layer 0..L.
    pub layers: Vec<u64>,
}

impl WeightEstimate {
    pub fn of(cfg: &ModelConfig, src: &dyn WeightSource, dtype: DType) -> WeightEstimate {
        let mut layers = vec![0u64; cfg.num_layers];
        let mut total = 0u64;
        let names = src.names();
        let held: BTreeSet<&str> = names.iter().map(String::as_str).collect();
        for name in &names {
            if naming::is_ignored_buffer(name)
                || (cfg.tie_word_embeddings && naming::LM_HEAD_NAMES.contains(&name.as_str()))
            {
                continue;
            }
            let Some(values) = dequantised_values(name, &held) else {
                continue;
            };
            let elems = src
                .shape(name)
                .and_then(|s| s.iter().try_fold(1u64, |a, &d| a.checked_mul(d as u64)))
                .unwrap_or(0);
            let bytes = elems
                .saturating_mul(values)
                .saturating_mul(dtype.size_in_bytes() as u64);
            match naming::layer_of(name) {
                Some(i) if i < cfg.num_layers => layers[i] += bytes,
                Some(_) => continue, // layers past num_hidden_layers (MTP) are never loaded
                None => {}
            }
            total = total.saturating_add(bytes);
        }
        WeightEstimate { total, layers }
    }

    /// The largest decoder layer: (index, bytes).
    pub fn largest_layer(&self) -> (usize, u64) {
        self.layers
            .iter()
            .copied()
            .enumerate()
            .max_by_key(|&(i, b)| (b, std::cmp::Reverse(i)))
            .unwrap_or((0, 0))
    }
}

/// Values per stored element once `name` is loaded and dequantised, among the tensors `held`:
/// one, two for MXFP4 blocks (`*_blocks`, two e2m1 values a byte); `None` for block scales,
/// which the dequantised weight does not keep (an FP8 weight's `*_scale_inv`, the `*_scales`
/// beside MXFP4 blocks).
fn dequantised_values(name: &str, held: &BTreeSet<&str>) -> Option<u64> {
    if name.ends_with("_scale_inv") {
        return None;
    }
    if let Some(stem) = name.strip_suffix("_scales")
        && held.contains(format!("{stem}_blocks").as_str())
    {
        return None;
    }
    if let Some(stem) = name.strip_suffix("_blocks")
        && held.contains(format!("{stem}_scales").as_str())
    {
        return Some(2);
    }
    Some(1)
}

/// How a target's weights are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// Every weight converted once at load.
    Resident,
    /// Layers streamed per forward; `prefetch`: the next layer is read while one computes (two
    /// resident at most), else one after the other (one).
    Streamed { prefetch: bool },
}

/// What [`plan`] decided, and from what.
#[derive(Debug, Clone)]
pub struct MemoryPlan {
    pub estimate: WeightEstimate,
    pub budget: Option<Budget>,
    pub residency: Residency,
    /// Streaming was not asked for: the weights did not fit the budget.
    pub automatic: bool,
    pub dtype: DType,
    /// A streamed layer waits in host memory and is put on the device by the forward's thread
    /// (a GPU's way, [`StreamOptions::host_stage`]): reading the next ahead costs host memory,
    /// not the budget's, and the device holds one layer, or two with `copies_ahead`.
    pub host_staged: bool,
    /// Host-staged, asked for ([`copy_ahead_asked`]), and the budget holds two layers: a layer
    /// kept in host memory is copied to the device while the one before computes
    /// ([`StreamOptions::copy_ahead`]).
    pub copies_ahead: bool,
    /// The most bytes read ahead of the loader ([`ReadOptions::window`]): what the budget
    /// leaves beside the weights held (all of them resident; one or two layers streamed), at
    /// most [`READ_WINDOW`].
    pub read_window: u64,
}

/// Decides how to hold a target whose weights are `estimate` (from headers; nothing is read).
/// Streams when `stream_layers` or when the weights do not fit `budget`; refuses a budget below
/// one decoder layer; prefetches when two of the largest layer fit, or always where the next
/// layer waits in host memory (`host_staged`: a GPU's device holds one layer at a time, two
/// where `copy_ahead` and two fit).
pub fn plan(
    estimate: WeightEstimate,
    stream_layers: bool,
    budget: Option<Budget>,
    dtype: DType,
    origin: &Path,
    host_staged: bool,
    copy_ahead: bool,
) -> Result<MemoryPlan> {
    let over = budget.is_some_and(|b| estimate.total > b.bytes);
    let residency = if !stream_layers && !over {
        Residency::Resident
    } else {
        let (layer, need) = estimate.largest_layer();
        if let Some(b) = budget
            && b.bytes < need
        {
            return Err(Error::MemoryBudget {
                path: origin.to_path_buf(),
                budget: b.describe(),
                layer,
                need,
                dtype: format!("{dtype:?}"),
            });
        }
        Residency::Streamed {
            prefetch: host_staged || budget.is_none_or(|b| b.bytes >= need.saturating_mul(2)),
        }
    };
    let two_layers = estimate.largest_layer().1.saturating_mul(2);
    let mut plan = MemoryPlan {
        estimate,
        budget,
        automatic: over && !stream_layers,
        residency,
        dtype,
        host_staged,
        copies_ahead: host_staged
            && copy_ahead
            && residency != Residency::Resident
            && budget.is_none_or(|b| b.bytes >= two_layers),
        read_window: READ_WINDOW,
    };
    if let Some(b) = budget {
        plan.read_window = b.bytes.saturating_sub(plan.held()).min(READ_WINDOW);
    }
    Ok(plan)
}

impl MemoryPlan {
    /// Bytes the weights hold at once in the budget's memory: all of them resident; streamed,
    /// the largest layer twice with a prefetch into that memory or copies ahead, else once (a
    /// host-staged prefetch waits in host memory).
    pub fn held(&self) -> u64 {
        match self.residency {
            Residency::Resident => self.estimate.total,
            Residency::Streamed { prefetch } => {
                let two = (prefetch && !self.host_staged) || self.copies_ahead;
                self.estimate
                    .largest_layer()
                    .1
                    .saturating_mul(1 + two as u64)
            }
        }
    }

    /// How the weights are read: the default readers, reading ahead within the budget.
    pub fn reads(&self) -> ReadOptions {
        ReadOptions {
            window: self.read_window,
            ..ReadOptions::default()
        }
    }

    /// The line said on stderr when streaming was not asked for.
    pub fn why_streamed(&self) -> String {
        format!(
            "the target's weights need about {} in {:?}, more than {}: streaming its layers one at \
             a time (as with --stream-layers)",
            format_bytes(self.estimate.total),
            self.dtype,
            self.budget
                .map_or_else(|| "the budget".to_string(), |b| b.describe())
        )
    }

    /// For the report: how the weights were held and how large they are.
    pub fn describe(&self) -> String {
        let (layer, bytes) = self.estimate.largest_layer();
        let size = format!(
            "{} in {:?}, largest layer {layer}: {}",
            format_bytes(self.estimate.total),
            self.dtype,
            format_bytes(bytes)
        );
        match self.residency {
            Residency::Resident => format!("resident ({size})"),
            Residency::Streamed { prefetch } => format!(
                "streamed one layer at a time{}{} ({size})",
                if prefetch && self.host_staged {
                    ", the next read into host memory while one computes"
                } else if prefetch {
                    ", the next read while one computes"
                } else {
                    ", no prefetch (two layers do not fit the budget)"
                },
                if self.automatic {
                    ", because the weights do not fit the budget"
                } else {
                    ""
                }
            ),
        }
    }
}

/// What streaming cost, over every forward so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StreamStats {
    pub forwards: usize,
    pub layers_loaded: usize,
    /// The most decoder layers alive at once (loaded and not yet dropped).
    pub max_resident_layers: usize,
    /// Their estimated bytes at that moment, at most.
    pub max_resident_bytes: u64,
    /// Bytes read from the checkpoint (layers, embedding rows, head chunks).
    pub bytes_read: u64,
    /// Layers of `layers_loaded` copied to the device from host memory, where they stayed after
    /// their first read ([`StreamOptions::host_keep`]), and the bytes that stay there.
    pub layers_from_host: usize,
    pub bytes_kept: u64,
    /// Bytes of kept layers in host memory now (not yet let go).
    pub bytes_held: u64,
    /// Layers of `layers_from_host` copied on the queue aside while the layer before computed
    /// ([`StreamOptions::copy_ahead`]).
    pub layers_copied_ahead: usize,
    /// Seconds spent reading and converting layers (on the loader thread, and on a GPU the
    /// device copies on the forward's thread).
    pub load_seconds: f64,
    /// Seconds the forward waited for a layer it needed.
    pub wait_seconds: f64,
    /// Wall time of the forwards.
    pub forward_seconds: f64,
}

impl StreamStats {
    pub fn describe(&self) -> String {
        let kept = if self.bytes_kept > 0 {
            format!(
                " ({} of them from host memory, where {} of layers stayed after their first read)",
                self.layers_from_host,
                format_bytes(self.bytes_kept)
            )
        } else {
            String::new()
        };
        format!(
            "{} layers loaded over {} forward(s){kept}, at most {} resident at once ({}); {} read \
             in {:.2} s of loading, {:.2} s of the {:.2} s forward spent waiting for a layer",
            self.layers_loaded,
            self.forwards,
            self.max_resident_layers,
            format_bytes(self.max_resident_bytes),
            format_bytes(self.bytes_read),
            self.load_seconds,
            self.wait_seconds,
            self.forward_seconds
        )
    }
}

/// Counts the layers alive: each [`LayerGuard`] holds one until it is dropped.
#[derive(Default)]
struct Live {
    /// (layers, bytes, most layers, most bytes)
    state: Mutex<(usize, u64, usize, u64)>,
}

impl Live {
    fn add(&self, bytes: u64) {
        if let Ok(mut s) = self.state.lock() {
            s.0 += 1;
            s.1 += bytes;
            s.2 = s.2.max(s.0);
            s.3 = s.3.max(s.1);
        }
    }

    fn remove(&self, bytes: u64) {
        if let Ok(mut s) = self.state.lock() {
            s.0 -= 1;
            s.1 -= bytes;
        }
    }

    fn most(&self) -> (usize, u64) {
        self.state.lock().map(|s| (s.2, s.3)).unwrap_or_default()
    }
}

/// A kept layer taken by the last forward that wants it: its index, and the point in the
/// device's work after its copies ([`Streamed::let_go_copied`]).
type Retiring = (usize, Arc<io::KeptLayer>, crate::kernels::Mark);

/// A loaded layer, counted alive until dropped.
struct LayerGuard<'a, L> {
    layer: L,
    bytes: u64,
    live: &'a Live,
}

impl<L> Drop for LayerGuard<'_, L> {
    fn drop(&mut self) {
        self.live.remove(self.bytes);
    }
}

/// Runs `consume(i, item)` for `i` in `0..n` on items `produce(i)` makes. With `prefetch`, a
/// second thread makes item i + 1 while item i is consumed and then waits for the hand-over (a
/// rendezvous channel: it holds the item until `consume` asks for it), so at most two items
/// exist at once: the one consumed (dropped when `consume` returns) and the next. Without, one.
/// Returns the seconds the consuming side waited for items.
fn pipelined<T: Send>(
    n: usize,
    prefetch: bool,
    produce: impl Fn(usize) -> Result<T> + Sync,
    mut consume: impl FnMut(usize, T) -> Result<()>,
) -> Result<f64> {
    let first = || Ok(());
    pipelined_after(n, prefetch, produce, first, |_, i, item| consume(i, item)).map(|(w, _)| w)
}

/// [`pipelined`], with `first` made on this thread once the second thread has started on item
/// 0 (so that the two overlap) and handed to every `consume`; returns it too.
fn pipelined_after<T: Send, S>(
    n: usize,
    prefetch: bool,
    produce: impl Fn(usize) -> Result<T> + Sync,
    first: impl FnOnce() -> Result<S>,
    mut consume: impl FnMut(&mut S, usize, T) -> Result<()>,
) -> Result<(f64, S)> {
    let mut waited = 0.0;
    if !prefetch {
        let mut state = first()?;
        for i in 0..n {
            let start = Instant::now();
            let item = produce(i)?;
            waited += start.elapsed().as_secs_f64();
            consume(&mut state, i, item)?;
        }
        return Ok((waited, state));
    }
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<T>>(0);
        let produce = &produce;
        std::thread::Builder::new()
            .name("ec-layers".into())
            .spawn_scoped(scope, move || {
                for i in 0..n {
                    let item = produce(i);
                    let failed = item.is_err();
                    // A closed channel: the forward stopped (an error); stop loading too.
                    if tx.send(item).is_err() || failed {
                        return;
                    }
                }
            })
            .map_err(|e| Error::Device(format!("could not start the layer loader thread: {e}")))?;
        let mut state = first()?;
        for i in 0..n {
            let start = Instant::now();
            let item = rx
                .recv()
                .map_err(|_| Error::Device("the layer loader thread stopped".into()))??;
            waited += start.elapsed().as_secs_f64();
            consume(&mut state, i, item)?;
        }
        Ok((waited, state))
    })
}

/// A layer as the loader thread hands it to the forward.
enum Fetched<'a, L> {
    /// Built on the loader thread (the CPU's way).
    Built(LayerGuard<'a, L>),
    /// Its tensors read or kept in host memory, to be built on the forward's thread.
    Staged(Staged<'a>),
}

/// A layer's tensors in host memory, waiting to be built on the forward's thread.
enum Staged<'a> {
    /// Read from the checkpoint; kept there afterwards when `keep`.
    Read {
        read: Box<io::ReadAhead<'a>>,
        keep: bool,
    },
    /// Kept since an earlier forward read them.
    Kept(Arc<io::KeptLayer>),
}

/// The layers kept in host memory between forwards ([`StreamOptions::host_keep`]).
struct HostKept {
    layers: Vec<Option<Arc<io::KeptLayer>>>,
    /// The bytes they may hold, and those held or promised to a layer being read to be kept.
    limit: u64,
    taken: u64,
    /// Whether a forward after the one running will want the layers again
    /// ([`Target::keep_for_later`]): layers are kept only then.
    later: bool,
}

impl Drop for HostKept {
    /// Lets the kept layers go, saying in the trace what that took (unlocking their memory,
    /// then freeing it).
    fn drop(&mut self) {
        let n = self.layers.iter().flatten().count();
        if n == 0 {
            return;
        }
        let start = Instant::now();
        #[cfg(feature = "cuda")]
        let unlocking = crate::kernels::cuda::unlocking_seconds();
        self.layers.clear();
        crate::progress::trace(|| {
            #[cfg(feature = "cuda")]
            let unlocked = format!(
                " ({:.2} s unlocking)",
                crate::kernels::cuda::unlocking_seconds() - unlocking
            );
            #[cfg(not(feature = "cuda"))]
            let unlocked = String::new();
            format!(
                "{n} layer(s) kept in host memory let go in {:.2} s{unlocked}",
                start.elapsed().as_secs_f64()
            )
        });
    }
}

/// A target whose decoder layers are read from the checkpoint at every forward.
pub(crate) struct Streamed<D: Decoder> {
    dec: D,
    src: Box<dyn WeightSource>,
    device: Device,
    /// The decoder prefix (`model`, `model.language_model`, ...).
    prefix: String,
    embed_name: String,
    /// The embeddings' name when tied.
    head_name: String,
    head_chunk: usize,
    /// FP8 block rows the head's chunks start on (1 for an unquantised head).
    head_align: usize,
    norm: RmsNorm,
    prefetch: bool,
    reads: ReadOptions,
    /// [`StreamOptions::host_stage`], on for a GPU.
    host_stage: bool,
    estimate: WeightEstimate,
    /// Per layer, every checkpoint tensor under it: each must be read by the layer's loader.
    layer_names: Vec<Vec<String>>,
    /// Per layer, the bytes its tensors hold as stored (what keeping it in host memory costs).
    stored: Vec<u64>,
    kept: Mutex<HostKept>,
    /// Kept layers the last forward that wants them has taken, each with the point in the
    /// device's work after its copies: let go once that passed ([`Streamed::let_go_copied`]).
    retiring: Mutex<VecDeque<Retiring>>,
    /// On a GPU keeping layers, the queue the next kept layer is copied on while the one
    /// before computes ([`Streamed::copy_ahead`]), and that copy.
    aside: crate::kernels::Aside,
    ahead: Mutex<Option<(usize, io::CopiedLayer)>>,
    /// The thread the host memory of kept layers let go is freed on ([`Streamed::let_go`]).
    freeing: Mutex<Option<std::sync::mpsc::Sender<Vec<Tensor>>>>,
    live: Live,
    stats: Mutex<StreamStats>,
}

impl<D: Decoder> Streamed<D> {
    /// Reads the final norm and checks, from headers, the embedding and head shapes and that no
    /// tensor outside the layers goes unread; the layers are read at each forward.
    pub(crate) fn open(
        dec: D,
        src: Box<dyn WeightSource>,
        device: &Device,
        opts: StreamOptions,
    ) -> Result<Streamed<D>> {
        let cfg = dec.config();
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let estimate = WeightEstimate::of(cfg, src.as_ref(), dec.dtype());
        let mut vb = Vb::new(src.as_ref(), dec.dtype(), device);
        vb.fp8_block = cfg.fp8_block;
        let m = llama::decoder_prefix(&vb);
        let prefix = m.path("");
        let prefix = prefix.trim_end_matches('.').to_string();
        let embed_name = m.checked("embed_tokens.weight", &[v, h])?;
        let head_name = match llama::head_name(cfg, &vb)? {
            Some(name) => vb.checked(name, &[v, h])?,
            None => embed_name.clone(),
        };
        let norm = dec.final_norm(&m)?;
        let mut read: BTreeSet<String> = vb.read_names();
        for name in [&embed_name, &head_name] {
            read.insert(name.clone());
            read.insert(format!("{name}_scale_inv"));
        }
        let names = src.names();
        let outside: Vec<String> = names
            .iter()
            .filter(|n| naming::layer_of(n).is_none() && !read.contains(*n))
            .cloned()
            .collect();
        refuse_unread(cfg, src.as_ref(), outside)?;
        let mut layer_names = vec![Vec::new(); cfg.num_layers];
        for name in names {
            if let Some(i) = naming::layer_of(&name).filter(|&i| i < cfg.num_layers) {
                layer_names[i].push(name);
            }
        }
        let layer_names: Vec<Vec<String>> = layer_names
            .iter()
            .map(|names| io::in_file_order(src.as_ref(), names))
            .collect();
        // A tensor without a stored extent (a GGUF one, decoded) counts as the estimate's.
        let stored = layer_names
            .iter()
            .zip(&estimate.layers)
            .map(|(names, &est)| {
                let bytes: Option<u64> = names
                    .iter()
                    .map(|n| src.extent(n).map(|e| e.bytes as u64))
                    .sum();
                bytes.unwrap_or(est)
            })
            .collect();
        let n_layers = cfg.num_layers;
        // An FP8 head is read in whole blocks of rows, so that each chunk takes whole rows of
        // scales (the block as declared, else DeepSeek's 128, which inference checks too).
        let fp8_head = src.shape(&format!("{head_name}_scale_inv")).is_some();
        let align = match (fp8_head, cfg.fp8_block) {
            (false, _) => 1,
            (true, Some([rows, _])) => rows.max(1),
            (true, None) => crate::model::fp8::DEFAULT_BLOCK,
        };
        let row_bytes = h.max(1) * dec.dtype().size_in_bytes();
        let rows = (opts.head_chunk_bytes / row_bytes).max(1);
        let head_chunk = if rows >= align {
            rows / align * align
        } else {
            align
        };
        let host_stage = opts.host_stage || stages_on_host(device);
        let aside = if host_stage && opts.host_keep > 0 && opts.copy_ahead {
            crate::kernels::Aside::new(device)
                .ctx(|| "opening a second queue for copies to the device".to_string())?
        } else {
            crate::kernels::Aside::none()
        };
        Ok(Streamed {
            dec,
            src,
            device: device.clone(),
            prefix,
            embed_name,
            head_name,
            head_chunk: head_chunk.min(v.max(1)),
            head_align: align,
            norm,
            prefetch: opts.prefetch,
            reads: opts.reads,
            host_stage,
            estimate,
            layer_names,
            stored,
            kept: Mutex::new(HostKept {
                layers: vec![None; n_layers],
                limit: opts.host_keep,
                taken: 0,
                later: false,
            }),
            retiring: Mutex::default(),
            aside,
            ahead: Mutex::default(),
            freeing: Mutex::default(),
            live: Live::default(),
            stats: Mutex::new(StreamStats::default()),
        })
    }

    fn vb(&self) -> Vb<'_> {
        let mut vb = Vb::new(self.src.as_ref(), self.dec.dtype(), &self.device);
        vb.fp8_block = self.dec.config().fp8_block;
        vb
    }

    /// Layer `i` as the loader thread hands it over: built (on the CPU), or read into host
    /// memory to be built by the forward's thread ([`StreamOptions::host_stage`]).
    fn read_layer(&self, i: usize) -> Result<Fetched<'_, D::Layer>> {
        if !self.host_stage {
            return self.load_layer(i, None).map(Fetched::Built);
        }
        let keep = {
            let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(layer) = &kept.layers[i] {
                crate::progress::trace(|| format!("layer {i}: kept in host memory"));
                return Ok(Fetched::Staged(Staged::Kept(layer.clone())));
            }
            let keep = kept.later && kept.taken.saturating_add(self.stored[i]) <= kept.limit;
            if keep {
                kept.taken += self.stored[i];
            }
            keep
        };
        let start = Instant::now();
        crate::progress::trace(|| format!("layer {i}: reading"));
        let read = io::read_to_host(
            self.src.as_ref(),
            &self.layer_names[i],
            self.dec.dtype(),
            &self.device,
            &self.reads,
            keep,
        )?;
        crate::progress::trace(|| {
            format!(
                "layer {i}: {} read in {:.2} s",
                format_bytes(read.waiting_bytes()),
                start.elapsed().as_secs_f64()
            )
        });
        if let Ok(mut s) = self.stats.lock() {
            s.load_seconds += start.elapsed().as_secs_f64();
        }
        Ok(Fetched::Staged(Staged::Read {
            read: Box::new(read),
            keep,
        }))
    }

    /// The layer a [`Fetched`] holds, built on this thread where it was read into host memory.
    fn built<'s>(
        &'s self,
        i: usize,
        fetched: Fetched<'s, D::Layer>,
    ) -> Result<LayerGuard<'s, D::Layer>> {
        match fetched {
            Fetched::Built(layer) => Ok(layer),
            Fetched::Staged(staged) => self.load_layer(i, Some(staged)),
        }
    }

    /// Layer `i`, read and converted (from `ready` where its tensors are in host memory
    /// already, else read ahead from the checkpoint now), checked to have read every tensor the
    /// checkpoint holds under it (a Llama with biases it does not expect stops here, at the
    /// first such layer). A layer read to be kept stays in host memory for the forwards after.
    fn load_layer(&self, i: usize, ready: Option<Staged<'_>>) -> Result<LayerGuard<'_, D::Layer>> {
        self.let_go_copied();
        let start = Instant::now();
        crate::progress::trace(|| format!("layer {i}: loading"));
        let (dtype, device) = (self.dec.dtype(), &self.device);
        let build = |src: &dyn WeightSource| {
            let mut vb = Vb::new(src, dtype, device);
            vb.fp8_block = self.dec.config().fp8_block;
            let layer = self.dec.load_layer(&vb.pp(&self.prefix), i)?;
            Ok((layer, vb.read_names()))
        };
        let from_host = matches!(ready, Some(Staged::Kept(_)));
        let mut copied_ahead = false;
        let (layer, read) = match ready {
            Some(Staged::Read { read, keep }) => {
                let built = build(&*read)?;
                if keep {
                    self.keep_layer(i, read.kept());
                }
                built
            }
            Some(Staged::Kept(kept)) => {
                let copied = {
                    let mut ahead = self.ahead.lock().unwrap_or_else(|p| p.into_inner());
                    ahead.take_if(|(j, _)| *j == i).map(|(_, copied)| copied)
                };
                copied_ahead = copied.is_some();
                let built = build(&kept.source(self.src.as_ref(), device, copied.as_ref())?)?;
                // No forward after this one wants it: it goes once its copies, queued by now,
                // are over, where this was the only holder left.
                let mut held = self.kept.lock().unwrap_or_else(|p| p.into_inner());
                if !held.later {
                    held.layers[i] = None;
                }
                drop(held);
                if Arc::strong_count(&kept) == 1 {
                    let copied = crate::kernels::Mark::now(device)
                        .ctx(|| format!("layer {i}: marking its copies from host memory"))?;
                    self.retiring_lock().push_back((i, kept, copied));
                }
                built
            }
            None => io::read_ahead(
                self.src.as_ref(),
                &self.layer_names[i],
                dtype,
                device,
                &self.reads,
                build,
            )?,
        };
        let unread: Vec<String> = self.layer_names[i]
            .iter()
            .filter(|n| !read.contains(*n))
            .cloned()
            .collect();
        refuse_unread(self.dec.config(), self.src.as_ref(), unread)?;
        let bytes = self.estimate.layers[i];
        crate::progress::trace(|| {
            format!(
                "layer {i}: loaded in {:.2} s",
                start.elapsed().as_secs_f64()
            )
        });
        self.live.add(bytes);
        if copied_ahead {
            // Counted alive since its copies were queued (`copy_ahead`).
            self.live.remove(bytes);
        }
        if let Ok(mut s) = self.stats.lock() {
            s.layers_loaded += 1;
            s.layers_from_host += from_host as usize;
            s.layers_copied_ahead += copied_ahead as usize;
            s.load_seconds += start.elapsed().as_secs_f64();
        }
        Ok(LayerGuard {
            layer,
            bytes,
            live: &self.live,
        })
    }

    /// On a GPU keeping layers: layer `next`, where it is kept in host memory, copied to the
    /// device now on the queue aside, behind the work queued so far, so that its copies run
    /// while the layer before it (queued next) computes; [`Streamed::load_layer`] takes them.
    /// Holds two layers on the device at once ([`MemoryPlan::held`]).
    fn copy_ahead(&self, next: usize) -> Result<()> {
        if !self.aside.active() {
            return Ok(());
        }
        let layer = {
            let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
            kept.layers.get(next).cloned().flatten()
        };
        let Some(layer) = layer else {
            return Ok(());
        };
        let copied = layer.copy_aside(&self.aside, &self.device)?;
        if copied.is_some() {
            self.live.add(self.estimate.layers[next]);
        }
        let mut ahead = self.ahead.lock().unwrap_or_else(|p| p.into_inner());
        // One left by a forward that failed before it took it.
        if let Some((stale, _)) = std::mem::replace(&mut *ahead, copied.map(|c| (next, c))) {
            self.live.remove(self.estimate.layers[stale]);
        }
        Ok(())
    }

    fn retiring_lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Retiring>> {
        self.retiring.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lets go the kept layers whose last copies are over ([`Streamed::let_go`]): unlocked
    /// without waiting for the device and freed on another thread, during the forward rather
    /// than all at the end (letting 13 GiB go took 0.7 s at the end of a diff, BENCHMARKS.md
    /// run 69; unlocking held the forward's thread 17-20 ms a layer in run 71). Those not yet
    /// copied wait for the next call, or the drop.
    fn let_go_copied(&self) {
        let mut retiring = self.retiring_lock();
        while retiring
            .front()
            .is_some_and(|(_, _, copied)| copied.passed())
        {
            let Some((i, layer, copied)) = retiring.pop_front() else {
                break;
            };
            let Ok(layer) = Arc::try_unwrap(layer) else {
                continue;
            };
            let bytes = layer.bytes();
            {
                let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
                kept.taken = kept.taken.saturating_sub(bytes);
            }
            self.let_go(i, layer, copied);
        }
    }

    /// Lets layer `i` go: its memory unlocked here, on the thread that makes every device call
    /// (two threads making device calls at once stalled loads: [`stages_on_host`]), and its
    /// host tensors handed to the thread that frees such layers in turn (started with the
    /// first; where it cannot start or has stopped, they are freed here).
    fn let_go(&self, i: usize, layer: io::KeptLayer, copied: crate::kernels::Mark) {
        let start = Instant::now();
        let bytes = layer.bytes();
        // The mark has passed (`let_go_copied`): its copies are over.
        let Ok(tensors) = layer.release(&copied) else {
            return;
        };
        crate::progress::trace(|| {
            format!(
                "layer {i}: {} let go from host memory (unlocked in {:.3} s)",
                format_bytes(bytes),
                start.elapsed().as_secs_f64()
            )
        });
        let mut freer = self.freeing.lock().unwrap_or_else(|p| p.into_inner());
        if freer.is_none() {
            let (tx, rx) = std::sync::mpsc::channel::<Vec<Tensor>>();
            let started = std::thread::Builder::new()
                .name("ec-free".into())
                .spawn(move || rx.into_iter().for_each(drop));
            *freer = started.ok().map(|_| tx);
        }
        if let Some(tx) = &*freer {
            // A stopped thread hands them back, dropped here.
            let _ = tx.send(tensors);
        }
    }

    /// Keeps layer `i`'s tensors (read to be kept) in host memory for the forwards after this
    /// one, counting their real bytes in place of the promised ones.
    fn keep_layer(&self, i: usize, layer: io::KeptLayer) {
        let bytes = layer.bytes();
        crate::progress::trace(|| {
            let (n, locked) = layer.count();
            format!(
                "layer {i}: {} kept in host memory ({locked} of {n} tensors locked)",
                format_bytes(bytes)
            )
        });
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.taken = kept.taken.saturating_sub(self.stored[i]) + bytes;
        kept.layers[i] = Some(Arc::new(layer));
        if let Ok(mut s) = self.stats.lock() {
            s.bytes_kept += bytes;
        }
    }

    /// Each of `normed` ([T, H]) -> its logits [T, V], the head read `head_chunk` rows at a
    /// time, once for all of them.
    fn head(&self, normed: &[Tensor]) -> Result<Vec<Tensor>> {
        let cfg = self.dec.config();
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let vb = self.vb();
        let rows = self.head_chunk;
        // Every chunk is `rows` rows: the last one starts early, overlapping the one before,
        // and only its new columns are kept. The CPU GEMM takes another path for a narrow
        // remainder (a last chunk of 16 rows rounded differently from the whole head), while
        // chunks of one width give the whole-head products bit for bit. (An FP8 head starts
        // its last chunk on a block edge, so it is up to a block wider unless V divides into
        // blocks, as DeepSeek-V3's 129280 = 1010 x 128 does.)
        // Chunk c covers the rows `start..start + len`, of which `c * rows..end` are kept.
        let span = |c: usize| {
            let end = ((c + 1) * rows).min(v);
            let start = (c * rows).min(v - rows);
            let start = start - start % self.head_align;
            (start, rows.max(end - start), end)
        };
        let mut parts: Vec<Vec<Tensor>> = vec![Vec::with_capacity(v.div_ceil(rows)); normed.len()];
        pipelined(
            v.div_ceil(rows),
            self.prefetch,
            |c| {
                let (start, len, _) = span(c);
                vb.get_row_range(&self.head_name, &[v, h], start, len)
            },
            |c, w| {
                let (start, _, end) = span(c);
                let w = w.t().ctx(|| "lm_head".to_string())?;
                for (x, parts) in normed.iter().zip(parts.iter_mut()) {
                    let part = x
                        .matmul(&w)
                        .and_then(|p| p.narrow(1, c * rows - start, end - c * rows))
                        .ctx(|| "lm_head".to_string())?;
                    parts.push(part);
                }
                Ok(())
            },
        )?;
        parts
            .iter()
            .map(|p| Tensor::cat(p, 1).ctx(|| "lm_head".to_string()))
            .collect()
    }

    /// Adds one pass over the layers to the statistics.
    fn count_pass(&self, start: Instant, read_before: u64, waited: f64) {
        if let Ok(mut s) = self.stats.lock() {
            s.forwards += 1;
            s.wait_seconds += waited;
            s.bytes_read += self.src.bytes_read() - read_before;
            s.forward_seconds += start.elapsed().as_secs_f64();
        }
    }
}

impl<D: Decoder> EmbedRows for Streamed<D> {
    fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let cfg = self.dec.config();
        self.vb()
            .get_rows(&self.embed_name, &[cfg.vocab_size, cfg.hidden_size], ids)
    }
}

impl<D: Decoder> Target for Streamed<D> {
    fn config(&self) -> &ModelConfig {
        self.dec.config()
    }

    fn device(&self) -> &Device {
        &self.device
    }

    fn embeddings(&self) -> &dyn EmbedRows {
        self
    }

    fn forward(
        &self,
        ids: &[u32],
        want: &CaptureRequest,
        progress: &mut Progress,
    ) -> Result<Capture> {
        let start = Instant::now();
        let read_before = self.src.bytes_read();
        let n = self.dec.config().num_layers;
        let ctx = self.dec.context(ids.len(), &self.device)?;
        let mut run = DecoderRun::new(self.dec.embed(self.rows(ids)?)?, want, n, progress);
        let waited = pipelined(
            n,
            self.prefetch,
            |i| self.read_layer(i),
            |i, fetched| {
                let layer = self.built(i, fetched)?;
                self.copy_ahead(i + 1)?;
                run.layer(i, |xs| self.dec.step(&layer.layer, i, xs, &ctx))?;
                crate::memory::note_device_use(&self.device);
                Ok(())
            },
        )?;
        let (mut capture, xs) = run.finish();
        finish_capture(&mut capture, xs, &self.norm, want, n, |normed| {
            let logits = self.head(std::slice::from_ref(normed))?.remove(0);
            self.dec.logits(logits)
        })?;
        self.let_go_copied();
        self.count_pass(start, read_before, waited);
        Ok(capture)
    }

    /// Every sample through layer i before layer i + 1 is read: each layer is read once for
    /// all of them (the head too), and `layers loaded` grows by L, not L per sample.
    fn forward_many(
        &self,
        samples: &[&[u32]],
        want: &CaptureRequest,
        opts: &ManyOptions,
        sink: &mut Sink,
    ) -> Result<()> {
        let start = Instant::now();
        let read_before = self.src.bytes_read();
        let n = self.dec.config().num_layers;
        // The samples are embedded once the loader has started on layer 0, so that reading
        // their embedding rows and reading the layer overlap.
        let embed = move || {
            let at = Instant::now();
            // Moved in whole (not reborrowed): the run holds it past this closure.
            let sink = sink;
            let run = ManyRun::new(
                &self.dec,
                samples,
                want,
                opts,
                sink,
                |ids| self.rows(ids),
                &self.device,
            );
            crate::progress::trace(|| {
                format!(
                    "{} sample(s) embedded in {:.2} s",
                    samples.len(),
                    at.elapsed().as_secs_f64()
                )
            });
            run
        };
        let (waited, run) = pipelined_after(
            n,
            self.prefetch,
            |i| self.read_layer(i),
            embed,
            |run, i, fetched| {
                let layer = self.built(i, fetched)?;
                self.copy_ahead(i + 1)?;
                let start = Instant::now();
                run.layer(i, &layer.layer)?;
                crate::memory::note_device_use(&self.device);
                crate::progress::trace(|| {
                    format!(
                        "layer {i}: {} sample(s) through it in {:.2} s",
                        samples.len(),
                        start.elapsed().as_secs_f64()
                    )
                });
                Ok(())
            },
        )?;
        run.finish(&self.norm, |normed| self.head(normed))?;
        self.let_go_copied();
        self.count_pass(start, read_before, waited);
        Ok(())
    }

    fn keep_for_later(&self, later: bool) {
        self.kept.lock().unwrap_or_else(|p| p.into_inner()).later = later;
    }

    fn stream_stats(&self) -> Option<StreamStats> {
        let mut stats = self.stats.lock().ok()?.clone();
        (stats.max_resident_layers, stats.max_resident_bytes) = self.live.most();
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        let retiring = self.retiring_lock();
        stats.bytes_held = (kept.layers.iter().flatten())
            .chain(retiring.iter().map(|(_, layer, _)| layer))
            .map(|layer| layer.bytes())
            .sum();
        Some(stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::BudgetOrigin;

    fn estimate() -> WeightEstimate {
        WeightEstimate {
            total: 1000,
            layers: vec![200, 300, 250],
        }
    }

    fn budget(bytes: u64) -> Option<Budget> {
        Some(Budget {
            bytes,
            origin: BudgetOrigin::Flag,
            on_gpu: false,
        })
    }

    fn decide(stream: bool, b: Option<Budget>) -> Result<MemoryPlan> {
        plan(
            estimate(),
            stream,
            b,
            DType::F32,
            Path::new("m"),
            false,
            true,
        )
    }

    /// On a GPU: each streamed layer read into host memory, put on the device by the
    /// forward's thread.
    fn decide_gpu(stream: bool, b: Option<Budget>) -> Result<MemoryPlan> {
        plan(
            estimate(),
            stream,
            b,
            DType::BF16,
            Path::new("m"),
            true,
            true,
        )
    }

    /// Host-staged: a budget between one and two layers still reads the next ahead (into host
    /// memory), the device holding one layer; from two layers on, a kept layer is copied ahead
    /// while the one before computes, and what is left for the rest counts two.
    #[test]
    fn a_host_staged_stream_always_reads_the_next_ahead_and_copies_ahead_where_two_fit() {
        for bytes in [300, 599, 600, 5000] {
            let p = decide_gpu(true, budget(bytes)).unwrap();
            assert_eq!(
                p.residency,
                Residency::Streamed { prefetch: true },
                "{bytes}"
            );
            let held = if bytes >= 600 { 600 } else { 300 };
            assert_eq!(p.copies_ahead, bytes >= 600, "{bytes}");
            assert_eq!(p.held(), held, "{bytes}");
            assert_eq!(p.read_window, (bytes - held).min(READ_WINDOW), "{bytes}");
            assert!(p.describe().contains("host memory"), "{}", p.describe());
        }
        assert!(decide_gpu(true, None).unwrap().copies_ahead, "no budget");
        let unasked = plan(
            estimate(),
            true,
            None,
            DType::BF16,
            Path::new("m"),
            true,
            false,
        );
        assert!(!unasked.unwrap().copies_ahead, "not asked for");
        assert!(!decide(true, None).unwrap().copies_ahead, "not host-staged");
        assert!(decide_gpu(true, budget(299)).is_err(), "below one layer");
        assert_eq!(
            decide_gpu(false, budget(1000)).unwrap().held(),
            1000,
            "resident: all of it"
        );
    }

    /// `first` runs while the loader makes item 0 (it sees the loader started, and the loader
    /// sees it started), every item reaches `consume` in order with `first`'s value, and an
    /// error from `first` stops the loader and is returned.
    #[test]
    fn the_first_step_overlaps_the_loaders_first_item() {
        use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
        let wait_for = |flag: &AtomicBool| {
            let start = Instant::now();
            while !flag.load(SeqCst) && start.elapsed().as_secs() < 5 {
                std::thread::yield_now();
            }
            flag.load(SeqCst)
        };
        let (loading, first_running) = (AtomicBool::new(false), AtomicBool::new(false));
        let produce = |i: usize| {
            if i == 0 {
                loading.store(true, SeqCst);
                assert!(
                    wait_for(&first_running),
                    "the first step never ran beside item 0"
                );
            }
            Ok(i * 10)
        };
        let first = || {
            first_running.store(true, SeqCst);
            assert!(wait_for(&loading), "the loader had not started on item 0");
            Ok(vec![7])
        };
        let (_, seen) = pipelined_after(4, true, produce, first, |seen, i, item| {
            assert_eq!(item, i * 10);
            seen.push(item);
            Ok(())
        })
        .unwrap();
        assert_eq!(seen, [7, 0, 10, 20, 30]);
        // Without a prefetch: first, then every item.
        let (_, seen) = pipelined_after(
            3,
            false,
            Ok,
            || Ok(vec![9]),
            |seen, _, item| {
                seen.push(item);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(seen, [9, 0, 1, 2]);
        let made = std::sync::atomic::AtomicUsize::new(0);
        let failed = pipelined_after(
            100,
            true,
            |i| {
                made.fetch_add(1, SeqCst);
                Ok(i)
            },
            || Err::<(), _>(Error::Device("no embedding".into())),
            |_, _, _| Ok(()),
        );
        assert!(failed.unwrap_err().to_string().contains("no embedding"));
        assert!(made.load(SeqCst) <= 2, "the loader went on: {made:?}");
    }

    #[test]
    fn host_keep_is_the_variables_size_or_half_the_memory_available() {
        assert_eq!(host_keep_from(Some("2GiB"), Some(100)), 2 << 30);
        assert_eq!(host_keep_from(Some("0"), Some(100)), 0);
        assert_eq!(host_keep_from(Some("lots"), Some(100)), 0);
        assert_eq!(host_keep_from(Some("half"), Some(100)), 50);
        assert_eq!(host_keep_from(Some("half"), None), 0);
        assert_eq!(host_keep_from(None, Some(100)), 50);
        assert_eq!(host_keep_from(None, None), 0);
    }

    #[test]
    fn streams_when_asked_or_when_the_weights_do_not_fit() {
        let fits = decide(false, budget(1000)).unwrap();
        assert_eq!(fits.residency, Residency::Resident);
        let asked = decide(true, budget(1000)).unwrap();
        assert_eq!(asked.residency, Residency::Streamed { prefetch: true });
        assert!(!asked.automatic);
        let auto = decide(false, budget(999)).unwrap();
        assert_eq!(auto.residency, Residency::Streamed { prefetch: true });
        assert!(auto.automatic);
        assert_eq!(
            decide(false, None).unwrap().residency,
            Residency::Resident,
            "no budget known: resident"
        );
    }

    #[test]
    fn budget_between_one_and_two_layers_streams_without_prefetch() {
        let p = decide(true, budget(599)).unwrap();
        assert_eq!(p.residency, Residency::Streamed { prefetch: false });
        let p = decide(true, budget(600)).unwrap();
        assert_eq!(p.residency, Residency::Streamed { prefetch: true });
    }

    /// What is read ahead of the loader is what the budget leaves beside the weights held:
    /// all of them resident, one or two layers streamed; at most [`READ_WINDOW`].
    #[test]
    fn reads_ahead_only_what_the_budget_leaves() {
        let window = |stream, b| decide(stream, b).unwrap().read_window;
        assert_eq!(window(false, budget(1500)), 500, "resident: 1000 held");
        assert_eq!(window(true, budget(1000)), 400, "two layers of 300 held");
        assert_eq!(window(true, budget(599)), 299, "one layer of 300 held");
        assert_eq!(window(false, None), READ_WINDOW);
        assert_eq!(window(true, budget(u64::MAX)), READ_WINDOW);
    }

    #[test]
    fn budget_below_one_layer_is_refused_naming_both_sizes() {
        let err = decide(true, budget(299)).unwrap_err().to_string();
        assert!(
            err.contains("299 B") && err.contains("300 B") && err.contains("layer 1"),
            "{err}"
        );
        assert!(decide(false, budget(299)).is_err());
    }

    #[test]
    fn prefetched_layers_are_made_on_the_named_loader_thread_in_order() {
        // A stalled streamed run is read from its threads' names (EAGLE_CHECK_TRACE, the GPU
        // scripts' stall reports): the layers must be made on "ec-layers", consumed here.
        let made = Mutex::new(Vec::new());
        let mut consumed = Vec::new();
        pipelined(
            3,
            true,
            |i| {
                let name = std::thread::current().name().map(str::to_string);
                made.lock().unwrap().push((i, name));
                Ok(i * 10)
            },
            |i, item| {
                consumed.push((i, item));
                Ok(())
            },
        )
        .unwrap();
        let loader = Some("ec-layers".to_string());
        assert_eq!(
            made.into_inner().unwrap(),
            vec![(0, loader.clone()), (1, loader.clone()), (2, loader)]
        );
        assert_eq!(consumed, vec![(0, 0), (1, 10), (2, 20)]);
    }
}
