//! Readers for the hidden-state capture files real EAGLE-3 pipelines write, normalised into
//! [`Sample`]s; they never trust a header and never execute anything.
//!
//! Formats (docs: shared/docs/eagle3-capture.md section 5):
//! - torch.save zip archives (`.pt`, `.pth`, `.ckpt`, and the same gzip-wrapped, `.ckpt.gz`),
//!   decoded by a restricted unpickler ([`pickle`]) that accepts only tensor-dict opcodes and
//!   globals;
//! - `.safetensors`, `.npy` (v1/v2/v3), `.npz` (stored or deflated).
//!
//! Layouts recognised ([`Format`]): SpecForge `data_{i}.ckpt(.gz)`, NVIDIA Model-Optimizer
//! `{id}.pt`, vLLM `hs_{i}.safetensors`, sglang dumper `...___name=X.pt` and sglang
//! `Pass{NNNNN}.pt`, plus plain files with recognisable tensor names.
//!
//! Use [`capture_files`] to list a directory and [`read_capture_path`] to read one file at a
//! time. Every error is a [`ReadError`] whose message names the file and the problem on one line.

mod layout;
pub(crate) mod numpy;
pub mod pickle;
pub(crate) mod safetensors_file;
pub mod safetensors_header;
pub mod sglang;
pub mod tensor;
mod torch;

#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

pub use layout::{Format, Sample, capture_files, read_capture_path, read_capture_path_with};
pub use numpy::{read_npy, read_npz};
pub use pickle::Value;
pub use safetensors_file::{SafetensorsFile, read_safetensors};
pub use tensor::{DType, HostTensor, TensorError};
pub use torch::read_torch;

use tensor::{fmt_bytes, fmt_shape};

/// Everything that can go wrong reading a capture file. Each message starts with the file.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{}: cannot read: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(
        "{}: not a capture file (known extensions: .pt .pth .ckpt .ckpt.gz .safetensors .npy .npz)",
        path.display()
    )]
    UnknownExtension { path: PathBuf },
    /// A structural problem of the container: broken zip or gzip, bad header, missing entry.
    #[error("{}: {detail}", path.display())]
    Format { path: PathBuf, detail: String },
    #[error(
        "{}: unsupported legacy torch format (a pre-1.6 torch.save pickle stream, not a zip archive); re-save it with torch >= 1.6",
        path.display()
    )]
    LegacyTorch { path: PathBuf },
    #[error(
        "{}: pickle global {global} (at byte {offset}) is not allowed (only tensor-dict globals are)",
        path.display()
    )]
    PickleGlobal {
        path: PathBuf,
        global: String,
        offset: usize,
    },
    #[error(
        "{}: pickle opcode {opcode} at byte {offset} is not allowed (only the opcodes torch.save uses for tensor dicts are)",
        path.display()
    )]
    PickleOpcode {
        path: PathBuf,
        opcode: String,
        offset: usize,
    },
    #[error("{}: malformed pickle at byte {offset}: {detail}", path.display())]
    Pickle {
        path: PathBuf,
        offset: usize,
        detail: String,
    },
    #[error("{}: pickle exceeds the limit of {limit} {what}", path.display())]
    PickleLimit {
        path: PathBuf,
        what: &'static str,
        limit: usize,
    },
    /// A header's shape and dtype need more (or other) bytes than are there.
    #[error(
        "{}: {what} declares {} {dtype} ({}) but {holder} holds {} of data",
        path.display(), fmt_shape(.shape), fmt_bytes(*.expected), fmt_bytes(*.got)
    )]
    SizeMismatch {
        path: PathBuf,
        what: String,
        dtype: DType,
        shape: Vec<usize>,
        expected: usize,
        got: usize,
        holder: &'static str,
    },
    #[error("{}: {what} declares shape {shape:?}, whose size overflows", path.display())]
    ShapeOverflow {
        path: PathBuf,
        what: String,
        shape: Vec<u64>,
    },
    #[error("{}: {what} has dtype {dtype}, which eagle-check does not read", path.display())]
    UnsupportedDtype {
        path: PathBuf,
        what: String,
        dtype: String,
    },
    #[error("{}: {what}: {error}", path.display())]
    Tensor {
        path: PathBuf,
        what: String,
        error: TensorError,
    },
    #[error("{}: {what} exceeds the limit of {}", path.display(), fmt_bytes(*.limit))]
    TooLarge {
        path: PathBuf,
        what: String,
        limit: usize,
    },
    /// A safetensors header the one header parser refused.
    #[error("{}: {error}", path.display())]
    Header {
        path: PathBuf,
        error: safetensors_header::HeaderError,
    },
    /// The file decoded, but its tensors do not fit the layout its names promise.
    #[error("{}: {detail}", path.display())]
    Layout { path: PathBuf, detail: String },
}

impl ReadError {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            ReadError::Io { path, .. }
            | ReadError::UnknownExtension { path }
            | ReadError::Format { path, .. }
            | ReadError::LegacyTorch { path }
            | ReadError::PickleGlobal { path, .. }
            | ReadError::PickleOpcode { path, .. }
            | ReadError::Pickle { path, .. }
            | ReadError::PickleLimit { path, .. }
            | ReadError::SizeMismatch { path, .. }
            | ReadError::ShapeOverflow { path, .. }
            | ReadError::UnsupportedDtype { path, .. }
            | ReadError::Tensor { path, .. }
            | ReadError::TooLarge { path, .. }
            | ReadError::Header { path, .. }
            | ReadError::Layout { path, .. } => path,
        }
    }
}

/// Bounds that keep hostile or corrupt files from exhausting memory or the stack. The defaults
/// fit real captures (a 16k-token DeepSeek-V3 sample is ~0.7 GiB of bf16 aux states) on a
/// 24 GiB machine.
#[derive(Debug, Clone)]
pub struct Limits {
    /// Largest file (or zip member) read into memory.
    pub max_file_bytes: usize,
    /// Largest decompressed `.ckpt.gz`.
    pub max_gzip_bytes: usize,
    /// Largest `data.pkl`.
    pub max_pickle_bytes: usize,
    /// Largest `.npy` or safetensors JSON header (safetensors' own limit is 100 MB,
    /// [`safetensors_header::MAX_HEADER_BYTES`]).
    pub max_header_bytes: usize,
    /// Pickle stack depth (items and marks).
    pub max_pickle_stack: usize,
    /// Pickle memo entries.
    pub max_pickle_memo: usize,
    /// Containers a pickle may create.
    pub max_pickle_objects: usize,
    /// Values the result may expand to once shared references are copied out.
    pub max_pickle_nodes: usize,
    /// Nesting depth of the result.
    pub max_pickle_depth: usize,
    /// Bytes that gathering non-contiguous tensor views (e.g. `x.t()`, or a zero-stride
    /// `expand`, which can describe far more elements than its storage holds) may copy, per
    /// file.
    pub max_view_copy_bytes: usize,
    /// Decompressed bytes a gzip stream or a zip member may yield per compressed byte, once
    /// past `inflate_floor_bytes`. Deflate reaches ~1032:1, so a few MB can hold gigabytes of
    /// zeros (a "bomb"); real captures compress ~1.1-1.5:1 (bf16/f32 states) and token ids
    /// ~10:1, so 100:1 refuses bombs long before memory runs out and no real capture.
    pub max_inflate_ratio: u64,
    /// Decompressed bytes always allowed, whatever the ratio (small, very regular members such
    /// as an all-ones loss mask compress far better than 100:1).
    pub inflate_floor_bytes: usize,
    /// Read `.npy` descr `<V2` (how numpy stores ml_dtypes' bfloat16) as bf16; a note on the
    /// sample says so. When false such files are refused.
    pub npy_void2_as_bf16: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_file_bytes: 32 << 30,
            max_gzip_bytes: 8 << 30,
            max_pickle_bytes: 256 << 20,
            max_header_bytes: safetensors_header::MAX_HEADER_BYTES as usize,
            max_pickle_stack: 1 << 20,
            max_pickle_memo: 1 << 20,
            max_pickle_objects: 1 << 22,
            max_pickle_nodes: 1 << 22,
            max_pickle_depth: 200,
            max_view_copy_bytes: 4 << 30,
            max_inflate_ratio: 100,
            inflate_floor_bytes: 64 << 20,
            npy_void2_as_bf16: true,
        }
    }
}

impl Limits {
    /// Bytes that `compressed` bytes may decompress to: at most `cap`, and at most
    /// `max_inflate_ratio` times `compressed` past the floor.
    pub fn inflate_cap(&self, compressed: u64, cap: usize) -> usize {
        let by_ratio = compressed.saturating_mul(self.max_inflate_ratio);
        let by_ratio = usize::try_from(by_ratio).unwrap_or(usize::MAX);
        cap.min(by_ratio.max(self.inflate_floor_bytes))
    }

    /// The copy budget for non-contiguous views of one file of `file_bytes`: a view can only
    /// describe more bytes than its storage holds through zero strides (`expand`), which real
    /// captures do not save, so a file may not copy out more than a few times its own size.
    pub fn view_copy_budget(&self, file_bytes: u64) -> usize {
        let scaled = usize::try_from(file_bytes.saturating_mul(4)).unwrap_or(usize::MAX);
        self.max_view_copy_bytes
            .min(scaled.saturating_add(self.inflate_floor_bytes))
    }
}

/// Reads a whole file, refusing one larger than `limit` before allocating.
pub(crate) fn read_file(path: &Path, limit: usize) -> Result<Vec<u8>, ReadError> {
    use std::io::Read;
    let io = |error| ReadError::Io {
        path: path.to_path_buf(),
        error,
    };
    let f = std::fs::File::open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    if len > limit as u64 {
        return Err(ReadError::TooLarge {
            path: path.to_path_buf(),
            what: format!(
                "file of {}",
                fmt_bytes(usize::try_from(len).unwrap_or(usize::MAX))
            ),
            limit,
        });
    }
    let mut buf = Vec::with_capacity(len as usize);
    // take(): the file may grow while we read it.
    f.take(limit as u64 + 1).read_to_end(&mut buf).map_err(io)?;
    if buf.len() > limit {
        return Err(ReadError::TooLarge {
            path: path.to_path_buf(),
            what: "file".into(),
            limit,
        });
    }
    Ok(buf)
}
