//! Reading weights at the disk's rate: a few reader threads read the tensors a loader is about
//! to ask for, several positioned reads in flight, each tensor split into pieces that several
//! readers fill at once, ahead of the loader that asks for the tensors one by one.
//!
//! [`read_ahead`] puts a [`WeightSource`] in front of the loader's ([`ReadAhead`]): the
//! decoders load through it unchanged, by name, in their own order, and get each tensor as soon
//! as its pieces are in; their conversions (FP8 and MXFP4 dequantisation, the CPU forward's
//! fused projections) run while the readers go on with the next tensors. Where the loader's
//! form of a tensor is a plain conversion it is done by the readers, piece by piece:
//! - bf16 or f16 weights for an f32 forward on the CPU are widened as each piece arrives (the
//!   source's [`WeightSource::load_f32`]);
//! - for a GPU the readers read into host memory and the loader's thread copies each tensor
//!   to the device as it takes it ([`crate::kernels::to_device`]: through that thread's own
//!   pinned staging buffers): every CUDA call stays on that one thread. (Readers that
//!   copied their own pieces to the device through pinned staging buffers, from several
//!   threads at once, left loads of full-width checkpoints stalled on an H100, every reader
//!   spinning in the driver: BENCHMARKS.md, runs 28-30.) A streamed GPU layer goes further
//!   ([`read_to_host`]): the loader thread only has it read into host memory, in full, and the
//!   thread that runs the forward takes its tensors from that [`ReadAhead`], copying each to
//!   the device, so that no two threads make device calls at once (run 40: a loader thread
//!   copying while the forward ran stalled).
//! - a tensor that has no plain extent (a GGUF tensor is decoded) is read and decoded whole by
//!   one reader, several tensors at once.
//!
//! The loaded tensors are bit for bit those of the source read alone: every piece is the same
//! bytes at the same place, every conversion is elementwise. How far ahead the readers go is
//! bounded ([`ReadOptions::window`]: bytes read and not yet taken, counted against the memory
//! budget by [`super::stream::plan`]); a tensor the loader asks for before the readers reached
//! it is read next, whatever the window, and a tensor read twice, or in another form than the
//! one read ahead, comes from the source itself.

use crate::error::{CandleContext, Error, Result};
use crate::kernels::{Aside, Copies, KeptHost, Mark};
use crate::model::source::{Extent, HostBuf, Rows, WeightSource, widen, zeroed_f32};
use crate::naming;
use candle_core::{DType, Device, Tensor};
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::{Condvar, Mutex, MutexGuard};

/// The most bytes read ahead of the loader by default.
pub const READ_WINDOW: u64 = 1 << 30;

/// How [`read_ahead`] reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadOptions {
    /// Reader threads, so reads in flight; 0 reads nothing ahead (the loader reads each
    /// tensor itself, one after the other).
    pub readers: usize,
    /// Bytes per read: a larger tensor is read in pieces of this size, by several readers.
    pub piece_bytes: usize,
    /// The most bytes (in the form the loader takes them) read and not yet taken. A tensor the
    /// loader asks for is read whatever this says.
    pub window: u64,
}

impl Default for ReadOptions {
    /// `EAGLE_CHECK_READERS` readers when set, else one per core but one, at most 8: a core is
    /// left to the loader (and, streamed, to the forward), whose own work overlaps the reads.
    /// Reads from the page cache are copies that scale with cores, and a cold disk wants
    /// several reads in flight; on the 2-core development VM, where writing fresh pages is the
    /// bound (1.3 GB/s, not faster from more threads) a second reader only slowed loads down
    /// (BENCHMARKS.md). 8 MiB pieces: large sequential reads, and a piece in flight per reader
    /// is a small part of any budget that holds a layer.
    fn default() -> ReadOptions {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let readers = std::env::var("EAGLE_CHECK_READERS")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(cores.saturating_sub(1).clamp(1, 8));
        ReadOptions {
            readers,
            piece_bytes: 8 << 20,
            window: READ_WINDOW,
        }
    }
}

/// Runs `load` over `src` with [`ReadOptions::readers`] threads reading `names` ahead of it,
/// in that order (a tensor `load` asks for early is read next). `load`'s tensors are the ones
/// it would read from `src` itself, bit for bit. Tensors it never asks for are read at most
/// up to the window, and dropped.
pub fn read_ahead<R>(
    src: &dyn WeightSource,
    names: &[String],
    dtype: DType,
    device: &Device,
    opts: &ReadOptions,
    load: impl FnOnce(&dyn WeightSource) -> Result<R>,
) -> Result<R> {
    if opts.readers == 0 || names.is_empty() {
        return load(src);
    }
    let ahead = ReadAhead::new(src, names, dtype, device, opts);
    // Less than one piece in all: a thread would cost more than the reads.
    if ahead.lock().slots.iter().map(|s| s.bytes).sum::<u64>() <= ahead.opts.piece_bytes as u64 {
        return load(src);
    }
    ahead.run(load)
}

/// `names` read ahead in full by the readers (the window set aside), for a loader on another
/// thread: the first half of a streamed GPU layer's load, made on the loader thread, where no
/// device call is made (for a GPU the readers read into host memory). The returned source
/// then serves them as [`read_ahead`]'s does, each copied to `device` as it is taken, on the
/// thread that runs the forward, so that one thread makes every device call of a streamed
/// forward (a loader thread copying to the device while the forward ran left the DeepSeek-V3
/// shape's streamed diff stalled on an H100: BENCHMARKS.md, run 40). With `keep`, each tensor
/// taken stays in host memory too (locked for a GPU's copies: [`KeptHost`]), for
/// [`ReadAhead::kept`].
pub fn read_to_host<'a>(
    src: &'a dyn WeightSource,
    names: &[String],
    dtype: DType,
    device: &Device,
    opts: &ReadOptions,
    keep: bool,
) -> Result<ReadAhead<'a>> {
    let opts = ReadOptions {
        window: u64::MAX,
        ..*opts
    };
    let mut ahead = ReadAhead::new(src, names, dtype, device, &opts);
    ahead.keep = keep;
    ahead.run(|_| {
        ahead.wait_all_read();
        Ok(())
    })?;
    Ok(ahead)
}

/// The order a resident load asks for a target's tensors in: the embeddings (and anything else
/// outside the layers), the layers in turn, then the output head; in file order within each
/// (sequential reads where the loader's own order is not known). Tensors no loader reads
/// (layers past `num_layers`, saved buffers, other towers, a tied head's stored copy) are left
/// out.
pub fn resident_order(src: &dyn WeightSource, num_layers: usize, tied: bool) -> Vec<String> {
    let mut names: Vec<(usize, String)> = src
        .names()
        .into_iter()
        .filter(|n| !naming::is_never_loaded(n, num_layers, tied))
        .map(|n| {
            let head = naming::LM_HEAD_NAMES.iter().any(|h| {
                n.strip_prefix(h)
                    .is_some_and(|r| r.is_empty() || r.starts_with('_'))
            });
            let group = match naming::layer_of(&n) {
                Some(i) => 1 + i,
                None if head => 1 + num_layers,
                None => 0,
            };
            (group, n)
        })
        .collect();
    names.sort_by_cached_key(|(group, n)| (*group, file_position(src, n), n.clone()));
    names.into_iter().map(|(_, n)| n).collect()
}

/// `names` (one layer's) in file order, without the buffers no loader reads.
pub fn in_file_order(src: &dyn WeightSource, names: &[String]) -> Vec<String> {
    let mut names: Vec<String> = names
        .iter()
        .filter(|n| !naming::is_ignored_buffer(n))
        .cloned()
        .collect();
    names.sort_by_cached_key(|n| (file_position(src, n), n.clone()));
    names
}

/// Where a tensor's bytes start: (file, offset), or nothing for a tensor without an extent.
fn file_position(src: &dyn WeightSource, name: &str) -> Option<(std::path::PathBuf, u64)> {
    src.extent(name).map(|e| (e.path.to_path_buf(), e.offset))
}

/// Stops the readers of a [`ReadAhead`] when dropped.
struct Stop<'r, 'a>(&'r ReadAhead<'a>);

impl Drop for Stop<'_, '_> {
    fn drop(&mut self) {
        self.0.lock().stop = true;
        self.0.work.notify_all();
    }
}

/// The form a tensor is read ahead in: the one [`super::source::Vb`] asks the source for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Form {
    /// As stored ([`WeightSource::load`]).
    Stored,
    /// Widened to f32 ([`WeightSource::load_f32`]).
    F32,
}

/// How one tensor is read.
enum Job<'a> {
    /// Copied from its extent in pieces; `widen`: bf16 (true) or f16 bits widened to f32.
    Extent {
        ext: Extent<'a>,
        widen: Option<bool>,
    },
    /// Read (and decoded) whole by the source, by one reader.
    Whole,
}

/// Where a tensor's pieces go.
enum Dest {
    Host(HostBuf),
    Widened(Vec<f32>),
}

/// The address a piece writes to (a raw pointer: the pieces of one buffer are written by
/// several readers at once, each to its own range).
#[derive(Clone, Copy)]
enum Target {
    Host(*mut u8),
    Widened(*mut f32),
    Whole,
}

// SAFETY: a `Target` points into a buffer its slot owns and keeps in place (never resized or
// moved out) until every piece handed out has been reported done; pieces of one buffer cover
// disjoint ranges ([`ReadAhead::piece`]).
unsafe impl Send for Target {}

enum Stage {
    Queued,
    /// Its buffer is being allocated (outside the lock: zeroing a reused buffer is a pass over
    /// it).
    Allocating,
    /// Its pieces are being read; `left` have not been reported done.
    Reading {
        left: usize,
    },
    Ready(Result<Tensor>),
    /// Taken by the loader (or never to be read).
    Gone,
}

struct Slot<'a> {
    name: String,
    job: Job<'a>,
    form: Form,
    /// What it holds once read, in bytes.
    bytes: u64,
    /// Pieces in all, and the next to hand out.
    pieces: usize,
    next: usize,
    stage: Stage,
    dest: Option<Dest>,
    target: Target,
    /// The first piece that failed.
    failed: Option<Error>,
}

struct State<'a> {
    slots: Vec<Slot<'a>>,
    /// The next slot to read ahead of the loader.
    cursor: usize,
    /// Slots with pieces still to hand out, the one the loader waits for first.
    active: VecDeque<usize>,
    /// Bytes of slots being read or read and not yet taken, and the most there were.
    ahead: u64,
    most_ahead: u64,
    /// Buffers being allocated (their slots join `active` next).
    allocating: usize,
    stop: bool,
}

/// What a reader does next.
enum Task {
    Read(Piece),
    /// Allocate slot k's buffer.
    Allocate(usize),
}

/// One piece of one tensor, handed to a reader.
struct Piece {
    slot: usize,
    /// Byte range in the tensor's stored data.
    at: usize,
    len: usize,
    target: Target,
}

/// A [`WeightSource`] whose tensors are read ahead by reader threads ([`read_ahead`]).
pub struct ReadAhead<'a> {
    src: &'a dyn WeightSource,
    device: Device,
    opts: ReadOptions,
    by_name: HashMap<String, usize>,
    state: Mutex<State<'a>>,
    /// Readers wait here for pieces.
    work: Condvar,
    /// The loader waits here for tensors.
    ready: Condvar,
    /// Whether the tensors taken are kept in host memory too ([`read_to_host`]).
    keep: bool,
    kept: Mutex<HashMap<(String, Form), KeptHost>>,
}

impl<'a> ReadAhead<'a> {
    fn new(
        src: &'a dyn WeightSource,
        names: &[String],
        dtype: DType,
        device: &Device,
        opts: &ReadOptions,
    ) -> ReadAhead<'a> {
        // Whole elements of any dtype (8 bytes at most) in every piece.
        let piece_bytes = opts.piece_bytes.max(64) / 8 * 8;
        let mut by_name = HashMap::new();
        let mut slots = Vec::new();
        for name in names {
            if by_name.contains_key(name) {
                continue;
            }
            let Some(slot) = plan_slot(src, name, dtype, device, piece_bytes) else {
                continue;
            };
            by_name.insert(name.clone(), slots.len());
            slots.push(slot);
        }
        ReadAhead {
            src,
            device: device.clone(),
            opts: ReadOptions {
                piece_bytes,
                ..*opts
            },
            by_name,
            state: Mutex::new(State {
                slots,
                cursor: 0,
                active: VecDeque::new(),
                ahead: 0,
                most_ahead: 0,
                allocating: 0,
                stop: false,
            }),
            work: Condvar::new(),
            ready: Condvar::new(),
            keep: false,
            kept: Mutex::new(HashMap::new()),
        }
    }

    /// `load` over this source while the readers read.
    fn run<R>(&self, load: impl FnOnce(&dyn WeightSource) -> Result<R>) -> Result<R> {
        let readers = self.opts.readers.min(self.pieces());
        std::thread::scope(|scope| {
            // Named, so that a stalled run's threads say what they are (`EAGLE_CHECK_TRACE`,
            // the GPU scripts' stall reports).
            let started = (0..readers)
                .filter(|r| {
                    std::thread::Builder::new()
                        .name(format!("ec-read-{r}"))
                        .spawn_scoped(scope, || self.work())
                        .is_ok()
                })
                .count();
            // Stops the readers when `load` returns or unwinds, so that the scope can end.
            let _stop = Stop(self);
            if started == 0 {
                // No reader (none asked for, or none could start): nothing is read ahead, the
                // loader reads each tensor itself, also through this source later.
                for slot in &mut self.lock().slots {
                    slot.stage = Stage::Gone;
                }
                return load(self.src);
            }
            load(self)
        })
    }

    /// Where the readers make their tensors: the host for a GPU (the loader's thread copies
    /// them over in [`Self::take`], so that no reader calls the driver), else the device.
    fn readers_device(&self) -> Device {
        if self.device.is_cuda() {
            Device::Cpu
        } else {
            self.device.clone()
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<'a>> {
        // A reader never panics holding the lock; were one to, the state is still whole.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pieces to read in all (no more readers than this are worth starting).
    fn pieces(&self) -> usize {
        self.lock().slots.iter().map(|s| s.pieces).sum()
    }

    /// Bytes read ahead and not taken yet.
    pub fn waiting_bytes(&self) -> u64 {
        self.lock().ahead
    }

    /// Waits until every tensor is read (or failed, which its loader is told when it asks).
    fn wait_all_read(&self) {
        let mut guard = self.lock();
        for k in 0..guard.slots.len() {
            guard = self.wait_read(guard, k);
        }
    }

    /// `guard` held again once slot `k` is read or gone (asking for it first when it is not
    /// being read yet).
    fn wait_read<'g>(
        &'g self,
        mut guard: MutexGuard<'g, State<'a>>,
        k: usize,
    ) -> MutexGuard<'g, State<'a>> {
        loop {
            let st = &mut *guard;
            match st.slots[k].stage {
                Stage::Queued => {
                    Self::admit(st, k);
                    drop(guard);
                    self.allocate(k, true);
                    guard = self.lock();
                }
                Stage::Allocating | Stage::Reading { .. } => {
                    guard = self.ready.wait(guard).unwrap_or_else(|e| e.into_inner());
                }
                Stage::Ready(_) | Stage::Gone => return guard,
            }
        }
    }

    /// A reader: takes pieces and reads them until every slot is read or the loader is done.
    fn work(&self) {
        let mut scratch = Scratch::default();
        loop {
            let task = {
                let mut st = self.lock();
                loop {
                    if st.stop {
                        return;
                    }
                    if let Some(task) = self.next_task(&mut st) {
                        break task;
                    }
                    if st.cursor == st.slots.len() && st.active.is_empty() && st.allocating == 0 {
                        return;
                    }
                    st = self.work.wait(st).unwrap_or_else(|e| e.into_inner());
                }
            };
            match task {
                Task::Read(piece) => {
                    let result = self.read_piece(&piece, &mut scratch);
                    self.piece_done(piece.slot, result);
                }
                Task::Allocate(k) => self.allocate(k, false),
            }
        }
    }

    /// What to do next: a piece of the tensors being read, the loader's first; else the next
    /// tensor in order, when the window has room for it.
    fn next_task(&self, st: &mut State<'a>) -> Option<Task> {
        while let Some(&k) = st.active.front() {
            let slot = &mut st.slots[k];
            if slot.next < slot.pieces {
                let p = self.piece(k, slot);
                slot.next += 1;
                return Some(Task::Read(p));
            }
            st.active.pop_front();
        }
        let queued =
            (st.cursor..st.slots.len()).find(|&k| matches!(st.slots[k].stage, Stage::Queued));
        let Some(k) = queued else {
            st.cursor = st.slots.len();
            return None;
        };
        let bytes = st.slots[k].bytes;
        if st.ahead > 0 && st.ahead.saturating_add(bytes) > self.opts.window {
            return None;
        }
        st.cursor = k + 1;
        Self::admit(st, k);
        Some(Task::Allocate(k))
    }

    /// Piece `slot.next` of slot `k`.
    fn piece(&self, k: usize, slot: &Slot) -> Piece {
        let (at, len) = match &slot.job {
            Job::Extent { ext, .. } => {
                let at = slot.next * self.opts.piece_bytes;
                (at, self.opts.piece_bytes.min(ext.bytes - at))
            }
            Job::Whole => (0, 0),
        };
        Piece {
            slot: k,
            at,
            len,
            target: slot.target,
        }
    }

    /// Starts reading slot `k`: counted ahead, its buffer to be allocated ([`Self::allocate`]).
    fn admit(st: &mut State<'a>, k: usize) {
        st.slots[k].stage = Stage::Allocating;
        st.ahead += st.slots[k].bytes;
        st.most_ahead = st.most_ahead.max(st.ahead);
        st.allocating += 1;
    }

    /// Allocates admitted slot `k`'s buffer, outside the lock, and queues its pieces (first
    /// when the loader waits for it).
    fn allocate(&self, k: usize, first: bool) {
        let (name, job) = {
            let st = self.lock();
            let slot = &st.slots[k];
            let job = match &slot.job {
                Job::Extent { ext, widen } => Some((*ext, *widen)),
                Job::Whole => None,
            };
            (slot.name.clone(), job)
        };
        let made = match job {
            Some((ext, widen)) => self.buffer(&name, &ext, widen).map(|(d, t)| (Some(d), t)),
            None => Ok((None, Target::Whole)),
        };
        let mut guard = self.lock();
        let st = &mut *guard;
        st.allocating -= 1;
        let slot = &mut st.slots[k];
        match made {
            Ok((dest, target)) => {
                (slot.dest, slot.target) = (dest, target);
                slot.stage = Stage::Reading { left: slot.pieces };
                if first {
                    st.active.push_front(k);
                } else {
                    st.active.push_back(k);
                }
            }
            Err(e) => {
                slot.stage = Stage::Ready(Err(e));
                self.ready.notify_all();
            }
        }
        self.work.notify_all();
    }

    /// A buffer for tensor `name` of extent `ext` (widened to f32 when `widen`), and where its
    /// pieces go.
    fn buffer(&self, name: &str, ext: &Extent, widen: Option<bool>) -> Result<(Dest, Target)> {
        let elems: usize = ext.shape.iter().product();
        let what = || format!("{}: buffer for {name}", ext.path.display());
        // The targets point into the buffers' heap memory, which stays where it is when the
        // buffers move into their slot.
        Ok(match widen {
            Some(_) => {
                let mut v = zeroed_f32(elems);
                let target = Target::Widened(v.as_mut_ptr());
                (Dest::Widened(v), target)
            }
            None => {
                let mut buf = HostBuf::zeroed(ext.dtype, elems).ok_or_else(|| {
                    Error::weights(ext.path, format!("{}: dtype {}", what(), ext.dtype))
                })?;
                let target = Target::Host(buf.bytes_mut().as_mut_ptr());
                (Dest::Host(buf), target)
            }
        })
    }

    /// Reads one piece into its slot's buffer; a whole tensor comes back as the tensor.
    fn read_piece(&self, piece: &Piece, scratch: &mut Scratch) -> Result<Option<Tensor>> {
        let (name, job) = {
            let st = self.lock();
            let slot = &st.slots[piece.slot];
            (
                slot.name.clone(),
                match &slot.job {
                    Job::Extent { ext, widen } => Some((*ext, *widen)),
                    Job::Whole => None,
                },
            )
        };
        let Some((ext, widen_bf16)) = job else {
            return self.src.load(&name, &self.readers_device()).map(Some);
        };
        match piece.target {
            Target::Host(base) => {
                // SAFETY: `base` is the start of the slot's host buffer of `ext.bytes` bytes,
                // alive and unmoved until this piece is reported done; `at..at + len` lies in
                // it and no other piece covers it.
                let dst = unsafe { std::slice::from_raw_parts_mut(base.add(piece.at), piece.len) };
                ext.read_at(dst, piece.at)?;
            }
            Target::Widened(base) => {
                let n = piece.len / 2;
                let bits = scratch.bits(n);
                ext.read_at(as_bytes(bits), piece.at)?;
                // SAFETY: as above, over the slot's f32 buffer of `ext.bytes / 2` elements; the
                // piece's elements start at `at / 2`.
                let dst = unsafe { std::slice::from_raw_parts_mut(base.add(piece.at / 2), n) };
                widen(dst, bits, widen_bf16.unwrap_or(true));
            }
            Target::Whole => {}
        }
        Ok(None)
    }

    /// Reports a piece read; the slot's last piece makes its tensor and hands it over.
    fn piece_done(&self, k: usize, result: Result<Option<Tensor>>) {
        let mut st = self.lock();
        let slot = &mut st.slots[k];
        let whole = match result {
            Ok(t) => t,
            Err(e) => {
                slot.failed.get_or_insert(e);
                None
            }
        };
        let Stage::Reading { left } = &mut slot.stage else {
            return;
        };
        *left -= 1;
        if *left > 0 {
            return;
        }
        let dest = slot.dest.take();
        let failed = slot.failed.take();
        let shape = match &slot.job {
            Job::Extent { ext, .. } => ext.shape.to_vec(),
            Job::Whole => Vec::new(),
        };
        let what = format!("{}: loading {}", self.src.origin().display(), slot.name);
        drop(st);
        let tensor = match (failed, whole, dest) {
            (Some(e), _, _) => Err(e),
            (None, Some(t), _) => Ok(t),
            (None, None, Some(Dest::Host(buf))) => {
                buf.into_tensor(&shape, &self.readers_device()).ctx(|| what)
            }
            (None, None, Some(Dest::Widened(v))) => {
                Tensor::from_vec(v, shape, &self.device).ctx(|| what)
            }
            (None, None, None) => Err(Error::Device(format!("{what}: no buffer was read"))),
        };
        let mut st = self.lock();
        st.slots[k].stage = Stage::Ready(tensor);
        self.ready.notify_all();
    }

    /// The tensor `name` in `form` if it is read ahead: waits for its pieces (asking for it
    /// first when it is not being read yet). `None`: the source reads it.
    fn take(&self, name: &str, form: Form, device: &Device) -> Option<Result<Tensor>> {
        let &k = self.by_name.get(name)?;
        if !device.same_device(&self.device) {
            return None;
        }
        let guard = self.lock();
        if guard.slots[k].form != form {
            return None;
        }
        let mut guard = self.wait_read(guard, k);
        let st = &mut *guard;
        let slot = &mut st.slots[k];
        let Stage::Ready(t) = std::mem::replace(&mut slot.stage, Stage::Gone) else {
            return None;
        };
        st.ahead -= slot.bytes;
        self.work.notify_all();
        drop(guard);
        let copying = || {
            format!(
                "{}: copying {name} to the device",
                self.src.origin().display()
            )
        };
        if self.keep {
            return Some(t.and_then(|t| {
                let kept = KeptHost::new(t, &self.device).ctx(copying)?;
                let on_device = kept.to_device(&self.device).ctx(copying)?;
                if let Ok(mut all) = self.kept.lock() {
                    all.insert((name.to_string(), form), kept);
                }
                Ok(on_device)
            }));
        }
        Some(t.and_then(|t| crate::kernels::to_device(&t, &self.device).ctx(copying)))
    }

    /// The tensors taken so far, kept in host memory ([`read_to_host`] with `keep`), as a
    /// [`KeptLayer`]; none without `keep`.
    pub fn kept(&self) -> KeptLayer {
        let tensors = self
            .kept
            .lock()
            .map(|mut k| std::mem::take(&mut *k))
            .unwrap_or_default();
        KeptLayer { tensors }
    }
}

/// Tensors as they were first read into host memory and taken ([`ReadAhead::kept`]): a
/// streamed layer kept between forwards, so that the forwards after the first copy it to the
/// device from there and read nothing from the checkpoint ([`KeptLayer::source`]).
pub struct KeptLayer {
    tensors: HashMap<(String, Form), KeptHost>,
}

impl KeptLayer {
    /// The bytes it holds.
    pub fn bytes(&self) -> u64 {
        self.tensors.values().map(KeptHost::bytes).sum()
    }

    /// How many tensors it holds, and how many of them are locked for direct copies.
    pub fn count(&self) -> (usize, usize) {
        let locked = self.tensors.values().filter(|k| k.locked()).count();
        (self.tensors.len(), locked)
    }

    /// Its host tensors, their memory unlocked without waiting for the device, once `copied`
    /// (made after the last copy from them was queued) has passed; `Err(self)` until then.
    pub fn release(self, copied: &Mark) -> std::result::Result<Vec<Tensor>, KeptLayer> {
        if !copied.passed() {
            return Err(self);
        }
        // Passed above, so each one's copies are over too.
        let out = self.tensors.into_values();
        Ok(out.filter_map(|kept| kept.release(copied).ok()).collect())
    }

    /// Its tensors copied to `device` on `aside` now, behind the work queued on the device so
    /// far, so that the copies run while that work does ([`Aside`]); `None` where `aside`
    /// copies nothing or none is locked.
    pub fn copy_aside(&self, aside: &Aside, device: &Device) -> Result<Option<CopiedLayer>> {
        let (keys, kept): (Vec<&(String, Form)>, Vec<&KeptHost>) = self.tensors.iter().unzip();
        let copied = aside
            .copy(&kept, device)
            .ctx(|| "copying a layer kept in host memory to the device".to_string())?;
        Ok(copied.map(|(tensors, copies)| CopiedLayer {
            tensors: (tensors.into_iter())
                .map(|(i, t)| (keys[i].clone(), t))
                .collect(),
            copies,
        }))
    }

    /// `src` with this layer's tensors served from host memory, copied to `device` as they are
    /// taken (each as often as asked for), or from `copied` where it was copied aside
    /// ([`KeptLayer::copy_aside`]; the device's stream then waits for those copies); anything
    /// else from `src`.
    pub fn source<'a>(
        &'a self,
        src: &'a dyn WeightSource,
        device: &Device,
        copied: Option<&'a CopiedLayer>,
    ) -> Result<KeptSource<'a>> {
        if let Some(copied) = copied {
            copied
                .copies
                .ready(device)
                .ctx(|| "waiting for a layer's copies to the device".to_string())?;
        }
        Ok(KeptSource {
            layer: self,
            src,
            device: device.clone(),
            copied,
        })
    }
}

/// A [`KeptLayer`] in front of its checkpoint ([`KeptLayer::source`]).
pub struct KeptSource<'a> {
    layer: &'a KeptLayer,
    src: &'a dyn WeightSource,
    device: Device,
    copied: Option<&'a CopiedLayer>,
}

/// A kept layer's tensors on the device, copied on a queue aside ([`KeptLayer::copy_aside`]).
pub struct CopiedLayer {
    tensors: HashMap<(String, Form), Tensor>,
    copies: Copies,
}

impl Front for KeptSource<'_> {
    fn behind(&self) -> &dyn WeightSource {
        self.src
    }

    fn serve(&self, name: &str, form: Form, device: &Device) -> Option<Result<Tensor>> {
        if !device.same_device(&self.device) {
            return None;
        }
        let key = (name.to_string(), form);
        if let Some(t) = self.copied.and_then(|c| c.tensors.get(&key)) {
            return Some(Ok(t.clone()));
        }
        let kept = self.layer.tensors.get(&key)?;
        Some(kept.to_device(device).ctx(|| {
            format!(
                "{}: copying {name} to the device from host memory",
                self.src.origin().display()
            )
        }))
    }
}

/// What one tensor is read as (`None`: not read ahead; the source reads it when asked).
fn plan_slot<'a>(
    src: &'a dyn WeightSource,
    name: &str,
    dtype: DType,
    device: &Device,
    piece_bytes: usize,
) -> Option<Slot<'a>> {
    let slot = |job, form, bytes: u64, pieces| Slot {
        name: name.to_string(),
        job,
        form,
        bytes,
        pieces,
        next: 0,
        stage: Stage::Queued,
        dest: None,
        target: Target::Whole,
        failed: None,
    };
    let Some(ext) = src.extent(name) else {
        // Decoded whole by the source, into f32 on the host (GGUF).
        let elems = src.shape(name)?.iter().product::<usize>() as u64;
        return Some(slot(Job::Whole, Form::Stored, elems * 4, 1));
    };
    let size = crate::weights::header::dtype_size(ext.dtype)?;
    let elems: usize = ext.shape.iter().product();
    // A tensor whose extent does not hold its shape is the source's to refuse, when asked.
    if ext.bytes == 0 || elems.checked_mul(size) != Some(ext.bytes) {
        return None;
    }
    let widen = match ext.dtype {
        "BF16" => Some(true),
        "F16" => Some(false),
        _ => None,
    }
    .filter(|_| dtype == DType::F32 && device.is_cpu());
    if device.is_cuda() && !device_holds(ext.dtype) {
        return None;
    }
    let (form, bytes) = match widen {
        Some(_) => (Form::F32, ext.bytes as u64 * 2),
        None => (Form::Stored, ext.bytes as u64),
    };
    let pieces = ext.bytes.div_ceil(piece_bytes);
    Some(slot(Job::Extent { ext, widen }, form, bytes, pieces))
}

/// A reader's own buffer: the stored bits of a piece to widen.
#[derive(Default)]
struct Scratch {
    bits: Vec<u16>,
}

impl Scratch {
    fn bits(&mut self, n: usize) -> &mut [u16] {
        if self.bits.len() < n {
            self.bits.resize(n, 0);
        }
        &mut self.bits[..n]
    }
}

fn as_bytes(v: &mut [u16]) -> &mut [u8] {
    // SAFETY: u16 has no padding and every byte pattern is valid; u8 has alignment 1.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// A source that serves some tensors itself, in the form the loader asks for them (read
/// ahead: [`ReadAhead`]; kept in host memory: [`KeptSource`]), and everything else from the
/// source behind it.
trait Front: Send + Sync {
    fn behind(&self) -> &dyn WeightSource;
    /// `name` in `form` on `device`, where this front holds it.
    fn serve(&self, name: &str, form: Form, device: &Device) -> Option<Result<Tensor>>;
}

impl Front for ReadAhead<'_> {
    fn behind(&self) -> &dyn WeightSource {
        self.src
    }

    fn serve(&self, name: &str, form: Form, device: &Device) -> Option<Result<Tensor>> {
        self.take(name, form, device)
    }
}

impl<F: Front> WeightSource for F {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.behind().shape(name)
    }

    fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        match self.serve(name, Form::Stored, device) {
            Some(t) => t,
            None => self.behind().load(name, device),
        }
    }

    fn load_rows(&self, name: &str, ids: &[u32], device: &Device) -> Result<Tensor> {
        self.behind().load_rows(name, ids, device)
    }

    fn load_row_range(
        &self,
        name: &str,
        start: usize,
        len: usize,
        device: &Device,
    ) -> Result<Tensor> {
        self.behind().load_row_range(name, start, len, device)
    }

    fn origin(&self) -> &Path {
        self.behind().origin()
    }

    fn names(&self) -> Vec<String> {
        self.behind().names()
    }

    fn bytes_read(&self) -> u64 {
        self.behind().bytes_read()
    }

    fn load_f32(&self, name: &str, rows: Rows, device: &Device) -> Result<Option<Tensor>> {
        if matches!(rows, Rows::All)
            && let Some(t) = self.serve(name, Form::F32, device)
        {
            return t.map(Some);
        }
        self.behind().load_f32(name, rows, device)
    }

    fn extent(&self, name: &str) -> Option<Extent<'_>> {
        self.behind().extent(name)
    }
}

/// The stored dtypes a device tensor holds as they are (a tensor of another is left to the
/// source, which converts it).
fn device_holds(dtype: &str) -> bool {
    matches!(
        dtype,
        "F32" | "F64" | "I64" | "I32" | "U32" | "BF16" | "F16" | "U8" | "BOOL" | "F8_E4M3"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::source::{SafetensorsSource, Vb};

    /// A safetensors file of every dtype the readers copy, sized so that pieces end inside
    /// elements' runs, and values that differ everywhere (a piece in the wrong place shows).
    fn checkpoint() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("ec-io-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut x: u32 = 12345;
        let mut values = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                    (x >> 8) as f32 / (1u32 << 24) as f32 * 8.0 - 4.0
                })
                .collect()
        };
        let dev = Device::Cpu;
        let t = |v: Vec<f32>, shape: &[usize], dtype: DType| {
            Tensor::from_vec(v, shape, &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
        };
        let mut tensors = HashMap::new();
        for (name, shape, dtype) in [
            ("a.f32", vec![101, 37], DType::F32),
            ("b.bf16", vec![300, 301], DType::BF16),
            ("c.f16", vec![777], DType::F16),
            ("d.f64", vec![13], DType::F64),
            ("e.u8", vec![1001], DType::U8),
            ("f.i64", vec![17, 3], DType::I64),
            ("g.u32", vec![33], DType::U32),
            ("h.f8", vec![129, 130], DType::F8E4M3),
            ("i.bf16", vec![5], DType::BF16),
        ] {
            let n = shape.iter().product();
            let v = match dtype {
                DType::U8 | DType::I64 | DType::U32 => (0..n).map(|i| (i % 251) as f32).collect(),
                _ => values(n),
            };
            tensors.insert(name.to_string(), t(v, &shape, dtype));
        }
        let path = dir.join("model.safetensors");
        candle_core::safetensors::save(&tensors, &path).unwrap();
        path
    }

    /// Every element's bits, as stored (a device tensor's, copied to the host).
    fn bits(t: &Tensor) -> (Vec<usize>, DType, Vec<u64>) {
        use candle_core::CpuStorage as C;
        let flat = t.to_device(&Device::Cpu).unwrap().flatten_all().unwrap();
        let (storage, layout) = flat.storage_and_layout();
        let candle_core::Storage::Cpu(c) = &*storage else {
            panic!("a CPU tensor")
        };
        let (start, n) = (layout.start_offset(), flat.elem_count());
        let v: Vec<u64> = match c {
            C::U8(v) => v[start..start + n].iter().map(|&x| x as u64).collect(),
            C::U32(v) => v[start..start + n].iter().map(|&x| x as u64).collect(),
            C::I64(v) => v[start..start + n].iter().map(|&x| x as u64).collect(),
            C::BF16(v) => v[start..start + n]
                .iter()
                .map(|x| x.to_bits() as u64)
                .collect(),
            C::F16(v) => v[start..start + n]
                .iter()
                .map(|x| x.to_bits() as u64)
                .collect(),
            C::F32(v) => v[start..start + n]
                .iter()
                .map(|x| x.to_bits() as u64)
                .collect(),
            C::F64(v) => v[start..start + n].iter().map(|x| x.to_bits()).collect(),
            C::F8E4M3(v) => v[start..start + n]
                .iter()
                .map(|x| x.to_bits() as u64)
                .collect(),
            _ => panic!("no test of {:?}", t.dtype()),
        };
        (t.dims().to_vec(), t.dtype(), v)
    }

    /// The tensors `load` gets through `ahead`, in `order`, in both Vb forms (`get` in the
    /// compute dtype, then `get_raw` as stored), against the source read alone, on the CPU.
    fn check(
        src: &SafetensorsSource,
        names: &[String],
        order: &[String],
        dtype: DType,
        opts: ReadOptions,
    ) -> u64 {
        check_on(src, names, order, dtype, opts, &Device::Cpu)
    }

    /// [`check`] on `dev`: each tensor on `dev`, the same bits as the source's own load there.
    fn check_on(
        src: &SafetensorsSource,
        names: &[String],
        order: &[String],
        dtype: DType,
        opts: ReadOptions,
        dev: &Device,
    ) -> u64 {
        let dev = dev.clone();
        let alone = Vb::new(src, dtype, &dev);
        let ahead = ReadAhead::new(src, names, dtype, &dev, &opts);
        ahead
            .run(|s| {
                let vb = Vb::new(s, dtype, &dev);
                for name in order {
                    let shape = src.shape(name).unwrap();
                    let what = format!("{name} in {dtype:?}, {opts:?}");
                    // candle's CUDA casts start from float, u8 and u32 storage only (FP8
                    // weights are dequantised by model::fp8 from their raw bits; integer
                    // tensors are never converted to a compute dtype): on a GPU the others
                    // are compared raw only. Run 32 met "converting f.i64" here.
                    let stored = src.extent(name).map_or("", |e| e.dtype);
                    let castable = ["F32", "F16", "BF16", "F64", "U8", "U32"].contains(&stored);
                    if castable || !dev.is_cuda() {
                        let got = vb.get(name, &shape).unwrap();
                        assert_eq!(
                            bits(&got),
                            bits(&alone.get(name, &shape).unwrap()),
                            "{what}"
                        );
                    }
                    let got = vb.get_raw(name).unwrap();
                    assert!(
                        got.device().same_device(&dev),
                        "{what}: on {:?}",
                        got.device()
                    );
                    assert_eq!(
                        bits(&got),
                        bits(&alone.get_raw(name).unwrap()),
                        "{what}, raw"
                    );
                }
                Ok(())
            })
            .unwrap();
        ahead.lock().most_ahead
    }

    #[test]
    fn tensors_read_ahead_in_pieces_equal_the_source_read_alone() {
        let path = checkpoint();
        let src = SafetensorsSource::open(&path).unwrap();
        let names = in_file_order(&src, &src.names());
        let mut reversed = names.clone();
        reversed.reverse();
        // Asked out of order, and one never asked for.
        let mut mixed = vec!["h.f8".to_string()];
        mixed.extend(
            names
                .iter()
                .filter(|n| *n != "h.f8" && *n != "c.f16")
                .cloned(),
        );
        for readers in [1, 3, 8] {
            for piece_bytes in [64, 1000, 1 << 20] {
                for window in [0, 10_000, READ_WINDOW] {
                    let opts = ReadOptions {
                        readers,
                        piece_bytes,
                        window,
                    };
                    for dtype in [DType::F32, DType::BF16] {
                        for order in [&names, &reversed, &mixed] {
                            check(&src, &names, order, dtype, opts);
                        }
                        // Some names not read ahead at all.
                        check(&src, &names[..3], &names, dtype, opts);
                    }
                }
            }
        }
    }

    /// A streamed GPU layer's first half: every tensor read in full by the readers (in pieces,
    /// the window given smaller than the layer), before the loader asks for any; then served
    /// with the source's own bits without reading the checkpoint again, a second ask going to
    /// the source. With no readers nothing is read ahead and every ask goes to the source.
    #[test]
    fn tensors_read_in_full_are_the_sources_bits_served_once() {
        let path = checkpoint();
        let src = SafetensorsSource::open(&path).unwrap();
        let names = in_file_order(&src, &src.names());
        let stored: u64 = names
            .iter()
            .map(|n| src.extent(n).unwrap().bytes as u64)
            .sum();
        for readers in [0, 1, 3] {
            let opts = ReadOptions {
                readers,
                piece_bytes: 1000,
                window: 10_000,
            };
            let before = src.bytes_read();
            let read = read_to_host(&src, &names, DType::BF16, &Device::Cpu, &opts, false).unwrap();
            let ahead = if readers == 0 { 0 } else { stored };
            assert_eq!(src.bytes_read() - before, ahead, "{opts:?}: read up front");
            assert_eq!(read.waiting_bytes(), ahead, "{opts:?}");
            let before = src.bytes_read();
            for name in &names {
                let got = read.load(name, &Device::Cpu).unwrap();
                let want = src.load(name, &Device::Cpu).unwrap();
                assert_eq!(bits(&got), bits(&want), "{name}, {opts:?}");
            }
            // Beside the comparisons' own loads, the checkpoint is read only without readers.
            assert_eq!(src.bytes_read() - before, 2 * stored - ahead, "{opts:?}");
            assert_eq!(read.waiting_bytes(), 0, "{opts:?}");
            let again = src.bytes_read();
            let b = read.load("b.bf16", &Device::Cpu).unwrap();
            assert_eq!(bits(&b), bits(&src.load("b.bf16", &Device::Cpu).unwrap()));
            assert!(
                src.bytes_read() - again > 2 * 300 * 301,
                "{opts:?}: read again"
            );
        }
    }

    /// Onto a GPU, with as many readers and pieces as the CPU test: every tensor arrives on
    /// the device with the source's own bits, and the load ends (readers that made their own
    /// device copies from several threads stalled full-width loads on an H100).
    #[cfg(feature = "cuda")]
    #[test]
    fn device_tensors_read_ahead_onto_the_gpu_equal_the_source_read_alone() {
        let dev = crate::kernels::testing::gpu();
        let path = checkpoint();
        let src = SafetensorsSource::open(&path).unwrap();
        let names = in_file_order(&src, &src.names());
        let mut reversed = names.clone();
        reversed.reverse();
        for readers in [1, 8] {
            for piece_bytes in [64, 1000, 1 << 20] {
                for window in [0, READ_WINDOW] {
                    let opts = ReadOptions {
                        readers,
                        piece_bytes,
                        window,
                    };
                    for dtype in [DType::F32, DType::BF16] {
                        for order in [&names, &reversed] {
                            check_on(&src, &names, order, dtype, opts, &dev);
                        }
                    }
                }
            }
        }
    }

    /// Taken in the order read, no more than the window (or one tensor, when a tensor is
    /// larger) is ever read and not yet taken; every byte is counted as read once.
    #[test]
    fn the_window_bounds_what_is_read_ahead_and_reads_are_counted_once() {
        let path = checkpoint();
        let src = SafetensorsSource::open(&path).unwrap();
        let names = in_file_order(&src, &src.names());
        let largest = names
            .iter()
            .map(|n| src.extent(n).unwrap().bytes as u64 * 2)
            .max()
            .unwrap();
        for window in [0, 50_000, 200_000] {
            let opts = ReadOptions {
                readers: 4,
                piece_bytes: 256,
                window,
            };
            let dev = Device::Cpu;
            let before = src.bytes_read();
            let ahead = ReadAhead::new(&src, &names, DType::F32, &dev, &opts);
            ahead
                .run(|s| {
                    let vb = Vb::new(s, DType::F32, &dev);
                    for name in &names {
                        std::thread::sleep(std::time::Duration::from_millis(2));
                        vb.get(name, &src.shape(name).unwrap())?;
                    }
                    Ok(())
                })
                .unwrap();
            let most = ahead.lock().most_ahead;
            assert!(
                most <= window.max(largest),
                "window {window}: {most} bytes read ahead"
            );
            let stored: u64 = names
                .iter()
                .map(|n| src.extent(n).unwrap().bytes as u64)
                .sum();
            assert_eq!(src.bytes_read() - before, stored, "window {window}");
        }
    }
}
