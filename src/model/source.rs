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
            for (chunk, &start) in buf.chunks_mut(row_bytes.max(1)).zip(starts) {
                file.read_exact_at(chunk, base + start as u64).map_err(io)?;
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
        // Straight into the tensor's own buffer where candle has the element type (no second
        // copy); safetensors data is little-endian, as the hosts eagle-check runs on.
        macro_rules! typed {
            ($zero:expr) => {{
                let mut v = vec![$zero; elems];
                fill(as_bytes_mut(&mut v))?;
                v
            }};
        }
        let t = match info.dtype.as_str() {
            "F32" => Tensor::from_vec(typed!(0f32), shape, device),
            "F64" => Tensor::from_vec(typed!(0f64), shape, device),
            "I64" => Tensor::from_vec(typed!(0i64), shape, device),
            "I32" => Tensor::from_vec(typed!(0i32), shape, device),
            "U32" => Tensor::from_vec(typed!(0u32), shape, device),
            "I16" => Tensor::from_vec(typed!(0i16), shape, device),
            "BF16" => {
                use half::vec::HalfBitsVecExt;
                Tensor::from_vec(typed!(0u16).reinterpret_into::<half::bf16>(), shape, device)
            }
            "F16" => {
                use half::vec::HalfBitsVecExt;
                Tensor::from_vec(typed!(0u16).reinterpret_into::<half::f16>(), shape, device)
            }
            // candle has no bool dtype; a BOOL tensor (a draft's `t2d`) loads as u8 0/1.
            "U8" | "BOOL" => Tensor::from_vec(typed!(0u8), shape, device),
            "F8_E4M3" => {
                let mut v = vec![0u8; total];
                fill(&mut v)?;
                Tensor::from_raw_buffer(&v, DType::F8E4M3, &shape, device)
            }
            other => {
                return Err(Error::weights(
                    &*info.file,
                    format!("tensor {name}: dtype {other} cannot be loaded"),
                ));
            }
        };
        t.ctx(what)
    }

    /// Bytes per row of a tensor (its first axis).
    fn row_bytes(&self, name: &str, info: &TensorInfo) -> Result<usize> {
        let rows = info.shape.first().copied().unwrap_or(0);
        let bytes = info.data_offsets.1 - info.data_offsets.0;
        if rows == 0 || bytes % rows != 0 {
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
        let info = self.info(name)?;
        let bytes = info.data_offsets.1 - info.data_offsets.0;
        self.read(name, info, &[0], bytes, info.shape.clone(), device)
    }

    fn load_rows(&self, name: &str, ids: &[u32], device: &Device) -> Result<Tensor> {
        let info = self.info(name)?;
        let row = self.row_bytes(name, info)?;
        let rows = info.shape[0];
        if let Some(&bad) = ids.iter().find(|&&r| r as usize >= rows) {
            return Err(Error::weights(
                &*info.file,
                format!("tensor {name}: row {bad} asked for, it has {rows}"),
            ));
        }
        let starts: Vec<usize> = ids.iter().map(|&r| r as usize * row).collect();
        let mut shape = info.shape.clone();
        shape[0] = ids.len();
        self.read(name, info, &starts, row, shape, device)
    }

    fn load_row_range(
        &self,
        name: &str,
        start: usize,
        len: usize,
        device: &Device,
    ) -> Result<Tensor> {
        let info = self.info(name)?;
        let row = self.row_bytes(name, info)?;
        let rows = info.shape[0];
        if start.checked_add(len).is_none_or(|end| end > rows) {
            return Err(Error::weights(
                &*info.file,
                format!(
                    "tensor {name}: rows {start}..{} asked for, it has {rows}",
                    start + len
                ),
            ));
        }
        let mut shape = info.shape.clone();
        shape[0] = len;
        self.read(name, info, &[start * row], len * row, shape, device)
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
        let raw = self.src.load(&full, &self.device)?;
        self.mark(&full);
        let t = match self.fp8_scale(&full, &raw)? {
            Some((scale, block)) => self.dequantize(&full, &raw, &scale, block)?,
            None => raw,
        };
        t.to_dtype(self.dtype).ctx(|| format!("converting {full}"))
    }

    /// Rows `ids` of the matrix `name` (exactly `shape`, [rows, cols]) in the compute dtype,
    /// without loading the rest: the embeddings of a sequence's tokens. Equal, bit for bit, to
    /// the same rows of [`Vb::get`] (FP8 rows take their own row of block scales).
    pub fn get_rows(&self, name: &str, shape: &[usize], ids: &[u32]) -> Result<Tensor> {
        let full = self.checked(name, shape)?;
        let raw = self.src.load_rows(&full, ids, &self.device)?;
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
        t.to_dtype(self.dtype).ctx(|| format!("converting {full}"))
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
        let raw = self.src.load_row_range(&full, start, len, &self.device)?;
        self.mark(&full);
        let t = match self.fp8_scale(&full, &raw)? {
            Some((scale, [br, bc])) => {
                if start % br != 0 {
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
        t.to_dtype(self.dtype).ctx(|| format!("converting {full}"))
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
