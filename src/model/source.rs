//! Where weights come from: safetensors shards (HF directories, HF cache snapshots) read with
//! positioned reads, or a dequantised GGUF file, behind one trait, named by HF tensor names.
//!
//! Reads are `pread`s into buffers the tensors then own, never a mapping of the files: pages of
//! a mapping count in the process's resident set for as long as it lives, so a target streamed
//! layer by layer would still grow to the size of its checkpoint.

use crate::error::{CandleContext, Error, Result};
use crate::weights::{TensorInfo, WeightIndex};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A store of named tensors.
pub trait WeightSource: Send + Sync {
    /// The shape the store declares for `name`, without loading it.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// The tensor in its stored dtype.
    fn load(&self, name: &str, device: &Device) -> Result<Tensor>;
    /// Rows `ids` of a tensor (`[ids.len(), ..]`), in its stored dtype: the embeddings of a
    /// few tokens without the whole table. By default the whole tensor is loaded and indexed.
    fn load_rows(&self, name: &str, ids: &[u32], device: &Device) -> Result<Tensor> {
        let what = || format!("{}: rows of {name}", self.origin().display());
        let ids = Tensor::new(ids, device).ctx(what)?;
        self.load(name, device)?.index_select(&ids, 0).ctx(what)
    }
    /// Rows `start..start + len` of a tensor, in its stored dtype (a chunk of the output head).
    fn load_row_range(
        &self,
        name: &str,
        start: usize,
        len: usize,
        device: &Device,
    ) -> Result<Tensor> {
        let what = || format!("{}: rows of {name}", self.origin().display());
        self.load(name, device)?
            .narrow(0, start, len)
            .and_then(|t| t.contiguous())
            .ctx(what)
    }
    /// The file or directory the weights came from, for error messages.
    fn origin(&self) -> &Path;
    /// Every tensor name the store holds (to report the ones no loader read).
    fn names(&self) -> Vec<String>;
    /// Bytes read from the files so far (what streaming costs in I/O).
    fn bytes_read(&self) -> u64 {
        0
    }
    /// `rows` of a tensor converted to f32 as they are read, when the stored dtype widens to it
    /// exactly (bf16, f16): one pass over memory where loading and converting take two, and no
    /// stored-dtype copy of the tensor. `None` when the store does not (the caller converts).
    fn load_f32(&self, _name: &str, _rows: Rows, _device: &Device) -> Result<Option<Tensor>> {
        Ok(None)
    }
    /// Where the stored bytes of `name` lie in a file, so that a reader may split the read of
    /// one tensor among threads ([`crate::model::io`]). `None` where a tensor's bytes are not
    /// its values as stored (a GGUF tensor is decoded): such a tensor is read whole by
    /// [`WeightSource::load`].
    fn extent(&self, _name: &str) -> Option<Extent<'_>> {
        None
    }
}

/// A tensor's stored bytes in a file ([`WeightSource::extent`]), checked against the file's
/// length when the store was opened.
#[derive(Clone, Copy)]
pub struct Extent<'a> {
    pub file: &'a File,
    pub path: &'a Path,
    /// Where the tensor's data starts in the file.
    pub offset: u64,
    pub bytes: usize,
    /// As the header spells it (`BF16`, `F8_E4M3`, ...).
    pub dtype: &'a str,
    pub shape: &'a [usize],
    /// The store's count of bytes read ([`WeightSource::bytes_read`]), which a reader of the
    /// extent adds to.
    pub read: &'a AtomicU64,
}

impl Extent<'_> {
    /// Reads `buf.len()` bytes from `at` bytes into the tensor's data, counted as read.
    pub fn read_at(&self, buf: &mut [u8], at: usize) -> Result<()> {
        self.file
            .read_exact_at(buf, self.offset + at as u64)
            .map_err(|e| Error::io(self.path, e))?;
        self.read.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// A host buffer of one stored dtype, for a tensor's bytes to be read into: straight into the
/// tensor's own buffer where candle has the element type (no second copy). safetensors data is
/// little-endian, as the hosts eagle-check runs on.
pub(crate) enum HostBuf {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I64(Vec<i64>),
    I32(Vec<i32>),
    U32(Vec<u32>),
    I16(Vec<i16>),
    Bf16(Vec<u16>),
    F16(Vec<u16>),
    /// `U8`, and `BOOL` (candle has no bool dtype; a draft's `t2d` loads as u8 0/1).
    U8(Vec<u8>),
    F8E4M3(Vec<u8>),
}

impl HostBuf {
    /// A zeroed buffer of `elems` elements of the safetensors dtype `dtype`; `None` for a dtype
    /// candle cannot hold. (Zeroed by the allocator's fresh pages: no pass over memory.)
    pub(crate) fn zeroed(dtype: &str, elems: usize) -> Option<HostBuf> {
        Some(match dtype {
            "F32" => HostBuf::F32(vec![0.0; elems]),
            "F64" => HostBuf::F64(vec![0.0; elems]),
            "I64" => HostBuf::I64(vec![0; elems]),
            "I32" => HostBuf::I32(vec![0; elems]),
            "U32" => HostBuf::U32(vec![0; elems]),
            "I16" => HostBuf::I16(vec![0; elems]),
            "BF16" => HostBuf::Bf16(vec![0; elems]),
            "F16" => HostBuf::F16(vec![0; elems]),
            "U8" | "BOOL" => HostBuf::U8(vec![0; elems]),
            "F8_E4M3" => HostBuf::F8E4M3(vec![0; elems]),
            _ => return None,
        })
        .map(|mut buf| {
            advise_huge_pages(buf.bytes_mut());
            buf
        })
    }

    /// The buffer's bytes, for reads to fill.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        match self {
            HostBuf::F32(v) => as_bytes_mut(v),
            HostBuf::F64(v) => as_bytes_mut(v),
            HostBuf::I64(v) => as_bytes_mut(v),
            HostBuf::I32(v) => as_bytes_mut(v),
            HostBuf::U32(v) => as_bytes_mut(v),
            HostBuf::I16(v) => as_bytes_mut(v),
            HostBuf::Bf16(v) | HostBuf::F16(v) => as_bytes_mut(v),
            HostBuf::U8(v) | HostBuf::F8E4M3(v) => v,
        }
    }

    /// The tensor of `shape` over the buffer (moved, not copied, on the CPU).
    pub(crate) fn into_tensor(
        self,
        shape: &[usize],
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        use half::vec::HalfBitsVecExt;
        match self {
            HostBuf::F32(v) => Tensor::from_vec(v, shape, device),
            HostBuf::F64(v) => Tensor::from_vec(v, shape, device),
            HostBuf::I64(v) => Tensor::from_vec(v, shape, device),
            HostBuf::I32(v) => Tensor::from_vec(v, shape, device),
            HostBuf::U32(v) => Tensor::from_vec(v, shape, device),
            HostBuf::I16(v) => Tensor::from_vec(v, shape, device),
            HostBuf::Bf16(v) => Tensor::from_vec(v.reinterpret_into::<half::bf16>(), shape, device),
            HostBuf::F16(v) => Tensor::from_vec(v.reinterpret_into::<half::f16>(), shape, device),
            HostBuf::U8(v) => Tensor::from_vec(v, shape, device),
            HostBuf::F8E4M3(v) => Tensor::from_raw_buffer(&v, DType::F8E4M3, shape, device),
        }
    }
}

/// Rows a task of a scattered read takes ([`SafetensorsSource::load_rows`]).
const ROWS_A_TASK: usize = 128;

/// A zeroed f32 buffer of `elems` values for a tensor widened as it is read, backed by huge
/// pages where it is large ([`advise_huge_pages`]).
pub(crate) fn zeroed_f32(elems: usize) -> Vec<f32> {
    let mut v = vec![0f32; elems];
    advise_huge_pages(as_bytes_mut(&mut v));
    v
}

/// Buffers at least this large ask for transparent huge pages ([`advise_huge_pages`]). glibc
/// (`malloc/malloc.c`, `DEFAULT_MMAP_THRESHOLD_MAX`: 32 MiB on 64-bit) gives an allocation
/// this large a mapping of its own, so the advice covers that mapping whole and splits no
/// other.
const HUGE_PAGE_BUFFER: usize = 32 << 20;

/// Asks the kernel to back `buf` (fresh, not yet written: [`HostBuf::zeroed`]) with
/// transparent huge pages where it allows them (`madvise` mode included): a layer read into it
/// then takes one page fault per 2 MiB instead of 512 (the streamed diff's first pass on an
/// H100 machine, 2.04 s with 4 KiB pages and 1.36-1.49 s with these, BENCHMARKS.md runs 72-74;
/// locking and unlocking for a GPU's copies cost the same either way there). Only for
/// buffers of [`HUGE_PAGE_BUFFER`] or more, on Linux; `EAGLE_CHECK_HUGE_PAGES=0` leaves the
/// pages as the system gives them. Advice only: where the kernel refuses it nothing changes.
pub(crate) fn advise_huge_pages(buf: &mut [u8]) {
    #[cfg(target_os = "linux")]
    if buf.len() >= HUGE_PAGE_BUFFER && huge_pages_wanted() {
        const PAGE: usize = 4096;
        let start = buf.as_mut_ptr() as usize;
        let first = start / PAGE * PAGE;
        let end = (start + buf.len()).next_multiple_of(PAGE);
        // SAFETY: madvise changes no contents and no mapping's extent; MADV_HUGEPAGE only
        // marks the pages covering `buf` (its own mapping: HUGE_PAGE_BUFFER) as eligible for
        // huge pages.
        let _ =
            unsafe { libc::madvise(first as *mut libc::c_void, end - first, libc::MADV_HUGEPAGE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

/// Whether host buffers ask for huge pages: yes unless `EAGLE_CHECK_HUGE_PAGES=0`.
fn huge_pages_wanted() -> bool {
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WANTED
        .get_or_init(|| std::env::var("EAGLE_CHECK_HUGE_PAGES").map_or(true, |v| v.trim() != "0"))
}

/// `src` (bf16 bits, or f16 bits unless `bf16`) widened to f32 into `dst`, element by element
/// ([`bf16_to_f32`]; half's f16 conversion), the same values as candle's `to_dtype`.
pub(crate) fn widen(dst: &mut [f32], src: &[u16], bf16: bool) {
    if bf16 {
        widen_into(dst, src, bf16_to_f32);
    } else {
        widen_into(dst, src, |x| half::f16::from_bits(x).to_f32());
    }
}

/// Which rows of a tensor to read.
#[derive(Debug, Clone, Copy)]
pub enum Rows<'a> {
    All,
    Ids(&'a [u32]),
    /// `start..start + len`.
    Range(usize, usize),
}

/// safetensors shards, headers validated by [`WeightIndex`] (every extent checked against its
/// file's length) before anything is read.
pub struct SafetensorsSource {
    dir: PathBuf,
    index: WeightIndex,
    files: HashMap<Arc<Path>, File>,
    bytes_read: AtomicU64,
}

impl SafetensorsSource {
    pub fn open(dir: &Path) -> Result<SafetensorsSource> {
        let index = WeightIndex::open(dir)?;
        if index.is_empty() {
            return Err(Error::weights(dir, "no .safetensors weights found"));
        }
        let mut files = HashMap::new();
        for info in index.tensors.values() {
            if !files.contains_key(&info.file) {
                let file = File::open(&info.file).map_err(|e| Error::io(&*info.file, e))?;
                files.insert(info.file.clone(), file);
            }
        }
        Ok(SafetensorsSource {
            dir: dir.to_path_buf(),
            index,
            files,
            bytes_read: AtomicU64::new(0),
        })
    }

    fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.index.get(name).ok_or_else(|| Error::MissingTensor {
            path: self.dir.clone(),
            name: name.to_string(),
        })
    }

    /// Reads `rows` runs of `row_bytes` bytes (run k starting `starts[k]` bytes into the
    /// tensor's data) as one tensor of `shape` in the stored dtype.
    fn read(
        &self,
        name: &str,
        info: &TensorInfo,
        starts: &[usize],
        row_bytes: usize,
        shape: Vec<usize>,
        device: &Device,
    ) -> Result<Tensor> {
        let file = &self.files[&info.file];
        let base = (info.data_start + info.data_offsets.0) as u64;
        let io = |e| Error::io(&*info.file, e);
        let fill = |buf: &mut [u8]| -> Result<()> {
            let row_bytes = row_bytes.max(1);
            let read_rows = |(chunk, starts): (&mut [u8], &[usize])| -> Result<()> {
                for (row, &start) in chunk.chunks_mut(row_bytes).zip(starts) {
                    file.read_exact_at(row, base + start as u64).map_err(io)?;
                }
                Ok(())
            };
            // Rows scattered over a table (the embeddings of a pass's tokens: thousands of
            // 8-16 KiB reads) are read by the pool's threads, ROWS_A_TASK at a time: one
            // thread's reads, one after the other, held the forward 0.09-0.19 s a pass
            // (BENCHMARKS.md, run 71).
            if starts.len() >= 2 * ROWS_A_TASK {
                use rayon::prelude::*;
                buf.par_chunks_mut(row_bytes * ROWS_A_TASK)
                    .zip(starts.par_chunks(ROWS_A_TASK))
                    .try_for_each(read_rows)?;
            } else {
                read_rows((buf, starts))?;
            }
            self.bytes_read
                .fetch_add(buf.len() as u64, Ordering::Relaxed);
            Ok(())
        };
        let total = starts.len() * row_bytes;
        let elems: usize = shape.iter().product();
        let size = crate::weights::header::dtype_size(&info.dtype).unwrap_or(0);
        if elems.checked_mul(size) != Some(total) {
            return Err(Error::weights(
                &*info.file,
                format!(
                    "tensor {name}: {total} bytes do not hold {shape:?} of {}",
                    info.dtype
                ),
            ));
        }
        let what = || format!("{}: loading {name}", self.dir.display());
        let Some(mut buf) = HostBuf::zeroed(&info.dtype, elems) else {
            return Err(Error::weights(
                &*info.file,
                format!("tensor {name}: dtype {} cannot be loaded", info.dtype),
            ));
        };
        fill(buf.bytes_mut())?;
        buf.into_tensor(&shape, device).ctx(what)
    }

    /// Where `rows` of `name` lie: (info, byte offset of each run in the tensor's data, bytes
    /// per run, the shape read).
    fn layout(
        &self,
        name: &str,
        rows: Rows,
    ) -> Result<(&TensorInfo, Vec<usize>, usize, Vec<usize>)> {
        let info = self.info(name)?;
        let bad = |what: String| {
            let n_rows = info.shape.first().copied().unwrap_or(0);
            Error::weights(
                &*info.file,
                format!("tensor {name}: {what} asked for, it has {n_rows} rows"),
            )
        };
        let mut shape = info.shape.clone();
        let (starts, run) = match rows {
            Rows::All => (vec![0], info.data_offsets.1 - info.data_offsets.0),
            Rows::Ids(ids) => {
                let row = self.row_bytes(name, info)?;
                if let Some(&r) = ids.iter().find(|&&r| r as usize >= info.shape[0]) {
                    return Err(bad(format!("row {r}")));
                }
                shape[0] = ids.len();
                (ids.iter().map(|&r| r as usize * row).collect(), row)
            }
            Rows::Range(start, len) => {
                let row = self.row_bytes(name, info)?;
                if start.checked_add(len).is_none_or(|end| end > info.shape[0]) {
                    return Err(bad(format!("rows {start}..{}", start.saturating_add(len))));
                }
                shape[0] = len;
                (vec![start * row], len * row)
            }
        };
        Ok((info, starts, run, shape))
    }

    /// Bytes per row of a tensor (its first axis).
    fn row_bytes(&self, name: &str, info: &TensorInfo) -> Result<usize> {
        let rows = info.shape.first().copied().unwrap_or(0);
        let bytes = info.data_offsets.1 - info.data_offsets.0;
        if rows == 0 || !bytes.is_multiple_of(rows) {
            return Err(Error::weights(
                &*info.file,
                format!(
                    "tensor {name} of shape {:?} has no rows to read",
                    info.shape
                ),
            ));
        }
        Ok(bytes / rows)
    }
}

/// `dst[i] = f(src[i])`, `f` inlined (a loop the compiler vectorises).
#[inline]
fn widen_into(dst: &mut [f32], src: &[u16], f: impl Fn(u16) -> f32) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f(s);
    }
}

/// bf16 bits to f32, exactly as `half::bf16::to_f32` (and so candle's `to_dtype`) converts,
/// NaNs quieted alike, without a branch.
#[inline]
fn bf16_to_f32(x: u16) -> f32 {
    let bits = (x as u32) << 16;
    let nan = (x & 0x7FFF) > 0x7F80;
    f32::from_bits(bits | ((nan as u32) << 22))
}

/// The bytes of a buffer of plain numbers, for a read to fill.
fn as_bytes_mut<T: Plain>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: `Plain` types are integers and floats: no padding, every bit pattern is a valid
    // value, and u8 has alignment 1. The slice covers exactly the initialised elements.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Number types whose every bit pattern is a value (see [`as_bytes_mut`]).
trait Plain: Copy {}
impl Plain for u8 {}
impl Plain for u16 {}
impl Plain for i16 {}
impl Plain for u32 {}
impl Plain for i32 {}
impl Plain for i64 {}
impl Plain for f32 {}
impl Plain for f64 {}

impl WeightSource for SafetensorsSource {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.index.get(name).map(|t| t.shape.clone())
    }

    fn load(&self, name: &str, device: &Device) -> Result<Tensor> {
        let (info, starts, row, shape) = self.layout(name, Rows::All)?;
        self.read(name, info, &starts, row, shape, device)
    }

    fn load_rows(&self, name: &str, ids: &[u32], device: &Device) -> Result<Tensor> {
        let (info, starts, row, shape) = self.layout(name, Rows::Ids(ids))?;
        self.read(name, info, &starts, row, shape, device)
    }

    fn load_row_range(
        &self,
        name: &str,
        start: usize,
        len: usize,
        device: &Device,
    ) -> Result<Tensor> {
        let (info, starts, row, shape) = self.layout(name, Rows::Range(start, len))?;
        self.read(name, info, &starts, row, shape, device)
    }

    fn load_f32(&self, name: &str, rows: Rows, device: &Device) -> Result<Option<Tensor>> {
        let bf16 = match self.info(name)?.dtype.as_str() {
            "BF16" => true,
            "F16" => false,
            _ => return Ok(None),
        };
        let (info, starts, row, shape) = self.layout(name, rows)?;
        let file = &self.files[&info.file];
        let base = (info.data_start + info.data_offsets.0) as u64;
        // 4 MiB at a time: large reads, and a buffer that stays in cache while it is widened.
        let mut buf = vec![0u16; 2 << 20];
        let mut out = vec![0f32; starts.len() * row / 2];
        let mut at = 0;
        for &start in &starts {
            let mut done = 0;
            while done < row {
                let n = (row - done).min(2 * buf.len());
                let part = &mut buf[..n / 2];
                file.read_exact_at(as_bytes_mut(part), base + (start + done) as u64)
                    .map_err(|e| Error::io(&*info.file, e))?;
                widen(&mut out[at..at + part.len()], part, bf16);
                at += part.len();
                done += n;
            }
        }
        self.bytes_read
            .fetch_add((starts.len() * row) as u64, Ordering::Relaxed);
        let what = || format!("{}: loading {name}", self.dir.display());
        Tensor::from_vec(out, shape, device).ctx(what).map(Some)
    }

    fn origin(&self) -> &Path {
        &self.dir
    }

    fn names(&self) -> Vec<String> {
        self.index.tensors.keys().cloned().collect()
    }

    fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    fn extent(&self, name: &str) -> Option<Extent<'_>> {
        let info = self.index.get(name)?;
        Some(Extent {
            file: self.files.get(&info.file)?,
            path: &info.file,
            offset: (info.data_start + info.data_offsets.0) as u64,
            bytes: info.data_offsets.1 - info.data_offsets.0,
            dtype: &info.dtype,
            shape: &info.shape,
            read: &self.bytes_read,
        })
    }
}

/// HF-style access to a weight source: a name prefix, a compute dtype and a device.
#[derive(Clone)]
pub struct Vb<'a> {
    src: &'a dyn WeightSource,
    prefix: String,
    pub dtype: DType,
    pub device: Device,
    /// The checkpoint's declared FP8 block (`quantization_config.weight_block_size`); when
    /// absent the block is inferred from the weight and scale shapes.
    pub fp8_block: Option<[usize; 2]>,
    /// Every full name loaded through this builder or its children.
    loaded: Arc<Mutex<BTreeSet<String>>>,
}

impl<'a> Vb<'a> {
    pub fn new(src: &'a dyn WeightSource, dtype: DType, device: &Device) -> Vb<'a> {
        Vb {
            src,
            prefix: String::new(),
            dtype,
            device: device.clone(),
            fp8_block: None,
            loaded: Arc::default(),
        }
    }

    fn mark(&self, full: &str) {
        if let Ok(mut set) = self.loaded.lock() {
            set.insert(full.to_string());
        }
    }

    /// The store's tensors that nothing loaded through this builder (or its children).
    pub fn unread(&self) -> Vec<String> {
        let loaded = self.loaded.lock().map(|s| s.clone()).unwrap_or_default();
        let mut out: Vec<String> = self
            .src
            .names()
            .into_iter()
            .filter(|n| !loaded.contains(n))
            .collect();
        out.sort();
        out
    }

    /// A builder one level down: `vb.pp("model").pp("layers.3")`.
    pub fn pp(&self, part: impl AsRef<str>) -> Vb<'a> {
        let part = part.as_ref();
        let prefix = if self.prefix.is_empty() {
            part.to_string()
        } else {
            format!("{}.{part}", self.prefix)
        };
        Vb {
            prefix,
            ..self.clone()
        }
    }

    pub fn path(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.prefix)
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.src.shape(&self.path(name)).is_some()
    }

    pub fn origin(&self) -> &Path {
        self.src.origin()
    }

    /// The full name of `name` after checking that the store declares exactly `shape`.
    pub(crate) fn checked(&self, name: &str, shape: &[usize]) -> Result<String> {
        let full = self.path(name);
        let found = self.src.shape(&full).ok_or_else(|| Error::MissingTensor {
            path: self.src.origin().to_path_buf(),
            name: full.clone(),
        })?;
        if found != shape {
            return Err(Error::Shape {
                path: self.src.origin().to_path_buf(),
                name: full,
                expected: shape.to_vec(),
                got: found,
            });
        }
        Ok(full)
    }

    /// `rows` of `full` as stored, or already in f32 when the compute dtype is f32 on the CPU
    /// and the store widens while reading ([`WeightSource::load_f32`]; the same values).
    fn stored(&self, full: &str, rows: Rows) -> Result<Tensor> {
        if self.dtype == DType::F32
            && self.device.is_cpu()
            && let Some(t) = self.src.load_f32(full, rows, &self.device)?
        {
            return Ok(t);
        }
        match rows {
            Rows::All => self.src.load(full, &self.device),
            Rows::Ids(ids) => self.src.load_rows(full, ids, &self.device),
            Rows::Range(start, len) => self.src.load_row_range(full, start, len, &self.device),
        }
    }

    /// The FP8 scale grid of `full` when it is block-quantised (a `weight_scale_inv` beside an
    /// F8E4M3 weight), with the block size (declared, else inferred from the two shapes).
    fn fp8_scale(&self, full: &str, raw: &Tensor) -> Result<Option<(Tensor, [usize; 2])>> {
        let scale_name = format!("{full}_scale_inv");
        if raw.dtype() != DType::F8E4M3 || self.src.shape(&scale_name).is_none() {
            return Ok(None);
        }
        let scale = self.src.load(&scale_name, &self.device)?;
        self.mark(&scale_name);
        let block = match self.fp8_block {
            Some(block) => block,
            None => {
                let declared = self.src.shape(full).unwrap_or_default();
                let rows_cols = (
                    declared.first().copied().unwrap_or(0),
                    declared.get(1).copied().unwrap_or(0),
                );
                scale
                    .dims2()
                    .and_then(|s| crate::model::fp8::infer_block(rows_cols, s))
                    .ctx(|| format!("dequantising {full}"))?
            }
        };
        Ok(Some((scale, block)))
    }

    /// `raw` (F8E4M3) times its block scales, in the compute dtype: one kernel pass on the
    /// device, the CPU reference elsewhere.
    fn dequantize(
        &self,
        full: &str,
        raw: &Tensor,
        scale: &Tensor,
        block: [usize; 2],
    ) -> Result<Tensor> {
        let t = if raw.device().is_cuda() {
            crate::kernels::fp8_dequant(raw, scale, block, self.dtype)
        } else {
            crate::model::fp8::dequantize_blocks_with(raw, scale, block)
        };
        t.ctx(|| format!("dequantising {full}"))
    }

    /// The tensor `name` with exactly `shape`, in the compute dtype. FP8 block-quantised weights
    /// (a `weight_scale_inv` beside them) are dequantised here.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let full = self.checked(name, shape)?;
        let raw = self.stored(&full, Rows::All)?;
        self.mark(&full);
        let t = match self.fp8_scale(&full, &raw)? {
            Some((scale, block)) => self.dequantize(&full, &raw, &scale, block)?,
            None => raw,
        };
        self.converted(&full, t)
    }

    /// Rows `ids` of the matrix `name` (exactly `shape`, [rows, cols]) in the compute dtype,
    /// without loading the rest: the embeddings of a sequence's tokens. Equal, bit for bit, to
    /// the same rows of [`Vb::get`] (FP8 rows take their own row of block scales).
    pub fn get_rows(&self, name: &str, shape: &[usize], ids: &[u32]) -> Result<Tensor> {
        let full = self.checked(name, shape)?;
        let raw = self.stored(&full, Rows::Ids(ids))?;
        self.mark(&full);
        let t = match self.fp8_scale(&full, &raw)? {
            Some((scale, [br, bc])) => {
                let block_rows: Vec<u32> = ids.iter().map(|&r| r / br as u32).collect();
                let idx = Tensor::new(block_rows.as_slice(), &self.device)
                    .ctx(|| format!("scales of {full}"))?;
                let scale = scale
                    .index_select(&idx, 0)
                    .ctx(|| format!("scales of {full}"))?;
                self.dequantize(&full, &raw, &scale, [1, bc])?
            }
            None => raw,
        };
        self.converted(&full, t)
    }

    /// Rows `start..start + len` of the matrix `name` (exactly `shape`) in the compute dtype:
    /// a chunk of the output head. For FP8 weights `start` must sit on a block edge.
    pub fn get_row_range(
        &self,
        name: &str,
        shape: &[usize],
        start: usize,
        len: usize,
    ) -> Result<Tensor> {
        let full = self.checked(name, shape)?;
        let raw = self.stored(&full, Rows::Range(start, len))?;
        self.mark(&full);
        let t = match self.fp8_scale(&full, &raw)? {
            Some((scale, [br, bc])) => {
                if !start.is_multiple_of(br) {
                    return Err(Error::weights(
                        self.src.origin(),
                        format!("{full}: rows from {start} do not start on a {br}-row FP8 block"),
                    ));
                }
                let first = start / br;
                let n = (start + len).div_ceil(br) - first;
                let scale = scale
                    .narrow(0, first, n)
                    .and_then(|s| s.contiguous())
                    .ctx(|| format!("scales of {full}"))?;
                self.dequantize(&full, &raw, &scale, [br, bc])?
            }
            None => raw,
        };
        self.converted(&full, t)
    }

    /// `t` in the compute dtype ([`crate::kernels::to_dtype`]: on the GPU a tensor of more
    /// than 2^32 elements is cast in chunks).
    fn converted(&self, full: &str, t: Tensor) -> Result<Tensor> {
        crate::kernels::to_dtype(&t, self.dtype).ctx(|| format!("converting {full}"))
    }

    /// Every full name read through this builder (or its children) so far.
    pub fn read_names(&self) -> BTreeSet<String> {
        self.loaded.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Like [`Vb::get`] when the tensor may be absent.
    pub fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.contains(name) {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A tensor of any shape (index tensors such as `d2t`), in its stored dtype.
    pub fn get_raw(&self, name: &str) -> Result<Tensor> {
        let full = self.path(name);
        let t = self.src.load(&full, &self.device)?;
        self.mark(&full);
        Ok(t)
    }

    pub fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.src.shape(&self.path(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every bf16 bit pattern (NaNs, infinities, subnormals) widens to the bits candle's
    /// `to_dtype` (half) gives.
    #[test]
    fn bf16_widening_matches_half_on_every_bit_pattern() {
        for x in 0..=u16::MAX {
            let want = half::bf16::from_bits(x).to_f32().to_bits();
            assert_eq!(bf16_to_f32(x).to_bits(), want, "bf16 bits {x:#06x}");
        }
    }

    /// Rows of a table read by the pool's threads, many tasks of them (the embeddings of a
    /// pass's tokens, repeats among them), are the rows the whole table holds at those ids.
    #[test]
    fn scattered_rows_read_together_are_the_tables_rows() {
        let dir = std::env::temp_dir().join(format!("ec-rows-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (vocab, h) = (997, 24);
        let values: Vec<f32> = (0..vocab * h).map(|i| (i as f32 * 0.37).sin()).collect();
        let table = Tensor::from_vec(values, (vocab, h), &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::BF16))
            .unwrap();
        let tensors = HashMap::from([("embed.weight".to_string(), table.clone())]);
        candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
        let src = SafetensorsSource::open(&dir).unwrap();
        let mut x: u32 = 7;
        let ids: Vec<u32> = (0..9 * ROWS_A_TASK + 5)
            .map(|_| {
                x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
                (x >> 8) % vocab as u32
            })
            .collect();
        let got = src.load_rows("embed.weight", &ids, &Device::Cpu).unwrap();
        let at = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
        let want = table.index_select(&at, 0).unwrap();
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap();
        assert_eq!(got.dims(), want.dims());
        assert!(
            bits(&got) == bits(&want),
            "rows read together differ from the table's"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The kilobytes of huge pages (`AnonHugePages`) in the mapping of this process that holds
    /// `addr`, from `/proc/self/smaps`.
    #[cfg(target_os = "linux")]
    fn huge_kb_at(addr: usize) -> Option<u64> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = range.split_once('-')
                && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                inside = (a..b).contains(&addr);
            } else if inside && let Some(kb) = line.strip_prefix("AnonHugePages:") {
                return kb.trim().trim_end_matches("kB").trim().parse().ok();
            }
        }
        None
    }

    /// A buffer a layer's tensor is read into is backed by huge pages once written, where the
    /// system lends them to a process that asks (`madvise` mode; under `always` every buffer
    /// gets them, asked or not, so the test says nothing there and is skipped): a read into it
    /// then takes one page fault per 2 MiB, not 512.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_read_buffer_is_backed_by_huge_pages() {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .unwrap_or_default();
        if !mode.contains("[madvise]") {
            eprintln!("transparent huge pages are not lent on request here ({mode:?}): skipped");
            return;
        }
        let elems = 48 << 20;
        let mut buf = HostBuf::zeroed("BF16", elems).unwrap();
        // Written as a read writes it: every page touched once.
        for chunk in buf.bytes_mut().chunks_mut(4096) {
            chunk[0] = 1;
        }
        let addr = buf.bytes_mut().as_ptr() as usize + elems;
        let huge = huge_kb_at(addr).expect("the buffer's mapping in /proc/self/smaps");
        assert!(
            huge >= 2048,
            "{huge} kB of huge pages in a 96 MiB buffer written through"
        );
    }
}
