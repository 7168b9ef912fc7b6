//! The GGUF header (llama.cpp's format, ggml `docs/gguf.md`): the file mapped, its header parsed
//! here, every tensor's extent checked, before anything is read. The GGUF target
//! ([`crate::model::gguf`]) and the tokenizer read it through here.
//!
//! The header is parsed by our own reader rather than candle's `Content::read`, which refuses a
//! file holding any ggml type it cannot decode: llama.cpp writes gpt-oss's experts as MXFP4
//! (ggml type 39, gguf-py 0.19 `GGMLQuantizationType.MXFP4`), which candle 0.11 does not know.
//! Tensors of the types candle decodes land in a candle [`Content`] as before; MXFP4 tensors
//! are listed apart ([`Header::mxfp4`]) and decoded by [`crate::model::gguf`]. Every count,
//! length and dimension is bounded by the bytes left in the file, in checked arithmetic.

use crate::error::{Error, Result};
use candle_core::quantized::GgmlDType;
use candle_core::quantized::gguf_file::{Content, TensorInfo, Value, VersionedMagic};
use memmap2::Mmap;
use std::collections::HashMap;
use std::path::Path;

/// The smallest GGUF: magic, version, two counts.
const MIN_FILE_LEN: u64 = 4 + 4 + 8 + 8;
/// ggml's `GGML_MAX_DIMS`.
const MAX_DIMS: u32 = 4;
/// Arrays nest (an array of arrays); deeper than this is a hostile file.
const MAX_DEPTH: usize = 16;
/// `general.alignment` when the file does not say (ggml `GGUF_DEFAULT_ALIGNMENT`).
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's type id of MXFP4 (`GGML_TYPE_MXFP4`, gguf-py `GGMLQuantizationType.MXFP4`).
pub const GGML_MXFP4: u32 = 39;
/// An MXFP4 block: 32 values in 17 bytes (gguf-py `GGML_QUANT_SIZES[MXFP4] = (32, 1 + 16)`).
pub const MXFP4_BLOCK: usize = 32;
pub const MXFP4_BLOCK_BYTES: usize = 17;

/// A parsed GGUF header.
#[derive(Debug)]
pub struct Header {
    /// The metadata, and every tensor of a type candle decodes.
    pub content: Content,
    /// The MXFP4 tensors, by GGUF name.
    pub mxfp4: HashMap<String, Mxfp4Info>,
}

/// Where an MXFP4 tensor is: its shape (outermost first, as candle's shapes) and its offset in
/// the data section.
#[derive(Debug, Clone)]
pub struct Mxfp4Info {
    pub shape: Vec<usize>,
    pub offset: u64,
}

/// Maps the file and parses its header (the tokenizer reads its metadata through here too).
pub fn read_header(path: &Path) -> Result<(Mmap, Header)> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    if len < MIN_FILE_LEN {
        return Err(too_short(path, len));
    }
    // SAFETY: mapped read-only; eagle-check never writes model files, and every read below is
    // bounds-checked against the mapping's length.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    let header = parse_header(path, &mmap)?;
    Ok((mmap, header))
}

fn too_short(path: &Path, len: u64) -> Error {
    Error::weights(
        path,
        format!("{len} bytes is too short for a GGUF file (header alone is {MIN_FILE_LEN})"),
    )
}

/// Parses the header of a GGUF file held in `bytes`.
pub fn parse_header(path: &Path, bytes: &[u8]) -> Result<Header> {
    if (bytes.len() as u64) < MIN_FILE_LEN {
        return Err(too_short(path, bytes.len() as u64));
    }
    Cursor { bytes, pos: 0 }
        .header()
        .map_err(|why| Error::weights(path, format!("not a readable GGUF file: {why}")))
}

/// A bounds-checked little-endian reader over the file's bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

type Parsed<T> = std::result::Result<T, String>;

impl Cursor<'_> {
    fn left(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Parsed<&[u8]> {
        if n > self.left() {
            return Err(format!(
                "{what} needs {n} bytes at byte {}, only {} left",
                self.pos,
                self.left()
            ));
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self, what: &str) -> Parsed<[u8; N]> {
        let b = self.take(N as u64, what)?;
        Ok(b.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> Parsed<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Parsed<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count or length: u32 in GGUF v1, u64 after.
    fn len(&mut self, v1: bool, what: &str) -> Parsed<u64> {
        if v1 {
            self.u32(what).map(u64::from)
        } else {
            self.u64(what)
        }
    }

    fn string(&mut self, v1: bool) -> Parsed<String> {
        let n = self.len(v1, "a string length")?;
        if n > self.left() {
            return Err(format!(
                "string length {n} at byte {} is past the end of the file ({} bytes left)",
                self.pos,
                self.left()
            ));
        }
        let mut v = self.take(n, "a string")?.to_vec();
        // Strings are not NUL-terminated, but some writers add one.
        while v.last() == Some(&0) {
            v.pop();
        }
        Ok(String::from_utf8_lossy(&v).into_owned())
    }

    /// One metadata value of GGUF type `ty` (ggml docs/gguf.md `gguf_metadata_value_type`).
    fn value(&mut self, ty: u32, v1: bool, depth: usize) -> Parsed<Value> {
        if depth > MAX_DEPTH {
            return Err(format!("arrays nested deeper than {MAX_DEPTH}"));
        }
        let w = "a metadata value";
        Ok(match ty {
            0 => Value::U8(self.array::<1>(w)?[0]),
            1 => Value::I8(self.array::<1>(w)?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array(w)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(w)?)),
            4 => Value::U32(u32::from_le_bytes(self.array(w)?)),
            5 => Value::I32(i32::from_le_bytes(self.array(w)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(w)?)),
            7 => Value::Bool(self.array::<1>(w)?[0] != 0),
            8 => Value::String(self.string(v1)?),
            9 => {
                let item = self.u32("an array's item type")?;
                let n = self.len(v1, "an array length")?;
                // Every item takes at least one byte: a longer array cannot be in the file.
                if n > self.left() {
                    return Err(format!(
                        "array of {n} items at byte {} is longer than the {} bytes left",
                        self.pos,
                        self.left()
                    ));
                }
                let items = (0..n)
                    .map(|_| self.value(item, v1, depth + 1))
                    .collect::<Parsed<Vec<_>>>()?;
                Value::Array(items)
            }
            10 => Value::U64(u64::from_le_bytes(self.array(w)?)),
            11 => Value::I64(i64::from_le_bytes(self.array(w)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(w)?)),
            other => return Err(format!("unknown metadata value type {other}")),
        })
    }

    fn header(&mut self) -> Parsed<Header> {
        if &self.array::<4>("the magic")? != b"GGUF" {
            return Err("bad magic (expected `GGUF`)".into());
        }
        let magic = match self.u32("the version")? {
            1 => VersionedMagic::GgufV1,
            2 => VersionedMagic::GgufV2,
            3 => VersionedMagic::GgufV3,
            v => return Err(format!("unsupported GGUF version {v} (1 to 3 are known)")),
        };
        let v1 = magic == VersionedMagic::GgufV1;
        let tensor_count = self.len(v1, "the tensor count")?;
        let kv_count = self.len(v1, "the metadata count")?;
        // A metadata entry takes at least 13 bytes, a tensor info at least 24 (v2+).
        if tensor_count > self.left() / 24 {
            return Err(format!(
                "tensor_count {tensor_count} cannot fit in the {} bytes left",
                self.left()
            ));
        }
        if kv_count > self.left() / 13 {
            return Err(format!(
                "metadata count {kv_count} cannot fit in the {} bytes left",
                self.left()
            ));
        }
        let mut metadata = HashMap::new();
        for _ in 0..kv_count {
            let key = self.string(v1)?;
            let ty = self.u32("a metadata value type")?;
            let value = self
                .value(ty, v1, 0)
                .map_err(|e| format!("metadata `{key}`: {e}"))?;
            metadata.insert(key, value);
        }
        let mut tensor_infos = HashMap::new();
        let mut mxfp4 = HashMap::new();
        for _ in 0..tensor_count {
            let name = self.string(v1)?;
            let n_dims = self.u32("a tensor's dimension count")?;
            if n_dims > MAX_DIMS {
                return Err(format!(
                    "tensor `{name}` has {n_dims} dimensions, ggml allows {MAX_DIMS}"
                ));
            }
            let mut dims = (0..n_dims)
                .map(|_| {
                    let d = self.len(v1, "a tensor dimension")?;
                    usize::try_from(d).map_err(|_| format!("tensor `{name}`: dimension {d}"))
                })
                .collect::<Parsed<Vec<usize>>>()?;
            // ggml lists the innermost dimension first; candle's shapes list it last.
            dims.reverse();
            let ty = self.u32("a tensor's type")?;
            let offset = self.u64("a tensor's offset")?;
            if ty == GGML_MXFP4 {
                mxfp4.insert(
                    name,
                    Mxfp4Info {
                        shape: dims,
                        offset,
                    },
                );
                continue;
            }
            let ggml_dtype = ggml_dtype(ty)
                .ok_or_else(|| format!("tensor `{name}` has the unknown ggml type {ty}"))?;
            tensor_infos.insert(
                name,
                TensorInfo {
                    ggml_dtype,
                    shape: candle_core::Shape::from(dims),
                    offset,
                },
            );
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match unsigned(v) {
                Some(a) if a > 0 && a <= 1 << 20 => a,
                _ => return Err(format!("general.alignment {v:?} is not a usable alignment")),
            },
        };
        let tensor_data_offset = (self.pos as u64).div_ceil(alignment) * alignment;
        Ok(Header {
            content: Content {
                magic,
                metadata,
                tensor_infos,
                tensor_data_offset,
            },
            mxfp4,
        })
    }
}

/// The ggml types candle decodes, by their ggml id (ggml.h `enum ggml_type`).
fn ggml_dtype(ty: u32) -> Option<GgmlDType> {
    Some(match ty {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        9 => GgmlDType::Q8_1,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        15 => GgmlDType::Q8K,
        30 => GgmlDType::BF16,
        _ => return None,
    })
}

/// Every tensor's element count, byte size and extent, in checked arithmetic, before any read.
pub fn validate_tensor_extents(path: &Path, header: &Header, file_len: usize) -> Result<()> {
    let content = &header.content;
    // (name, shape, block elements, block bytes, type, offset) of every tensor.
    let candle = content.tensor_infos.iter().map(|(name, info)| {
        let t = info.ggml_dtype;
        let dims = info.shape.dims();
        (
            name,
            dims,
            t.block_size(),
            t.type_size(),
            format!("{t:?}"),
            info.offset,
        )
    });
    let mxfp4 = header.mxfp4.iter().map(|(name, info)| {
        let dims = info.shape.as_slice();
        (
            name,
            dims,
            MXFP4_BLOCK,
            MXFP4_BLOCK_BYTES,
            "MXFP4".to_string(),
            info.offset,
        )
    });
    for (name, dims, block, type_size, kind, offset) in candle.chain(mxfp4) {
        let bad = |msg: String| Error::weights(path, format!("GGUF tensor `{name}`: {msg}"));
        let elems = dims
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| bad(format!("shape {dims:?} overflows")))?;
        // ggml quantises along rows (the last HF dimension), one block never spans two rows.
        let row = dims.last().copied().unwrap_or(1);
        if block == 0 || row % block != 0 {
            return Err(bad(format!(
                "rows of {row} elements do not divide into {kind} blocks of {block}"
            )));
        }
        let bytes = (elems / block)
            .checked_mul(type_size)
            .ok_or_else(|| bad(format!("shape {dims:?} overflows")))?;
        let end = content
            .tensor_data_offset
            .checked_add(offset)
            .and_then(|start| start.checked_add(bytes as u64))
            .ok_or_else(|| bad(format!("offset {offset} overflows")))?;
        if end > file_len as u64 {
            return Err(bad(format!(
                "data ends at byte {end}, past the end of the file ({file_len} bytes)"
            )));
        }
    }
    Ok(())
}

/// A metadata integer as u64, whatever its stored width (`general.alignment` is u32 in
/// llama.cpp's files); `None` for a negative or non-integer value.
pub fn unsigned(v: &Value) -> Option<u64> {
    match *v {
        Value::U8(x) => Some(x.into()),
        Value::U16(x) => Some(x.into()),
        Value::U32(x) => Some(x.into()),
        Value::U64(x) => Some(x),
        Value::I8(x) => u64::try_from(x).ok(),
        Value::I16(x) => u64::try_from(x).ok(),
        Value::I32(x) => u64::try_from(x).ok(),
        Value::I64(x) => u64::try_from(x).ok(),
        _ => None,
    }
}
