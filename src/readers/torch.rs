//! `torch.save` archives: `.pt`/`.pth`/`.ckpt` zips (`<archive>/data.pkl`,
//! `<archive>/data/<key>`, `<archive>/byteorder`) and the same zip gzip-wrapped (`.ckpt.gz`).
//!
//! The layout is torch/serialization.py `_save` (zip format, torch >= 1.6): one pickle whose
//! persistent ids `('storage', torch.FloatStorage, key, location, numel)` name the raw
//! little-endian storage entries. The pickle is decoded by [`super::pickle`], which never
//! executes anything.

use std::io::{Read, Seek};
use std::path::Path;
use std::sync::Arc;

use super::pickle::{StorageSource, Value, unpickle};
use super::tensor::{DType, checked_nbytes, fmt_bytes};
use super::{Limits, ReadError};

/// Reads a torch.save file (zip, or gzip-wrapped zip) into a [`Value`].
pub fn read_torch(path: &Path, limits: &Limits) -> Result<Value, ReadError> {
    let io = |error| ReadError::Io {
        path: path.to_path_buf(),
        error,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let file_len = f.metadata().map_err(io)?.len();
    let mut magic = [0u8; 4];
    let n = read_up_to(&mut f, &mut magic).map_err(io)?;
    f.rewind().map_err(io)?;
    match sniff(magic.get(..n).unwrap_or(&[])) {
        Container::Zip => torch_from_zip(path, std::io::BufReader::new(f), file_len, limits),
        Container::Gzip => {
            let bytes = gunzip(path, f, file_len, limits)?;
            torch_from_bytes(path, bytes, limits)
        }
        other => Err(other.error(path, &magic[..n])),
    }
}

/// Reads a torch.save archive held in memory (e.g. a decompressed `.ckpt.gz`).
pub(crate) fn torch_from_bytes(
    path: &Path,
    bytes: Vec<u8>,
    limits: &Limits,
) -> Result<Value, ReadError> {
    match sniff(&bytes) {
        Container::Zip => {
            let len = bytes.len() as u64;
            torch_from_zip(path, std::io::Cursor::new(bytes), len, limits)
        }
        other => Err(other.error(path, bytes.get(..4).unwrap_or(&bytes))),
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Container {
    Zip,
    Gzip,
    /// A bare pickle stream: the pre-1.6 torch.save format.
    LegacyPickle,
    Unknown,
}

impl Container {
    fn error(&self, path: &Path, head: &[u8]) -> ReadError {
        match self {
            Container::LegacyPickle => ReadError::LegacyTorch {
                path: path.to_path_buf(),
            },
            Container::Gzip => ReadError::Format {
                path: path.to_path_buf(),
                detail: "gzip inside gzip is not a torch.save archive".into(),
            },
            _ => ReadError::Format {
                path: path.to_path_buf(),
                detail: format!(
                    "not a torch.save zip archive (starts with {head:02x?}, expected PK\\x03\\x04)"
                ),
            },
        }
    }
}

fn sniff(head: &[u8]) -> Container {
    match head {
        [b'P', b'K', 3, 4, ..] | [b'P', b'K', 5, 6, ..] => Container::Zip,
        [0x1f, 0x8b, ..] => Container::Gzip,
        [0x80, 2..=5, ..] => Container::LegacyPickle,
        _ => Container::Unknown,
    }
}

fn read_up_to(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// Decompresses a gzip stream of `compressed` bytes into memory, refusing more than `cap`
/// bytes (see [`Limits::inflate_cap`]) whatever the stream declares, before holding them.
pub(crate) fn gunzip(
    path: &Path,
    r: impl Read,
    compressed: u64,
    limits: &Limits,
) -> Result<Vec<u8>, ReadError> {
    let cap = limits.inflate_cap(compressed, limits.max_gzip_bytes);
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(r)
        .take(cap as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| ReadError::Format {
            path: path.to_path_buf(),
            detail: format!("broken gzip stream: {e}"),
        })?;
    if out.len() > cap {
        return Err(ReadError::TooLarge {
            path: path.to_path_buf(),
            what: format!(
                "gzip stream of {compressed} bytes, decompressed (at most {}:1 past {}, and {} in all),",
                limits.max_inflate_ratio,
                fmt_bytes(limits.inflate_floor_bytes),
                fmt_bytes(limits.max_gzip_bytes)
            ),
            limit: cap,
        });
    }
    Ok(out)
}

pub(crate) fn zip_error(path: &Path, e: zip::result::ZipError) -> ReadError {
    ReadError::Format {
        path: path.to_path_buf(),
        detail: format!("broken zip archive: {e}"),
    }
}

/// Reads zip member `index` whole, refusing more than `cap` bytes whatever its header says, and
/// more than [`Limits::inflate_cap`] allows for its compressed size (at most the archive's
/// `archive_len`): a deflated member cannot expand past that ratio.
pub(crate) fn read_member<R: Read + Seek>(
    path: &Path,
    archive: &mut zip::ZipArchive<R>,
    index: usize,
    cap: usize,
    archive_len: u64,
    limits: &Limits,
) -> Result<Vec<u8>, ReadError> {
    let mut f = archive.by_index(index).map_err(|e| zip_error(path, e))?;
    let name = String::from_utf8_lossy(f.name_raw()).into_owned();
    let declared = f.size();
    let compressed = f.compressed_size().min(archive_len);
    let (cap, bomb) = match f.compression() {
        zip::CompressionMethod::Stored => (cap, String::new()),
        _ => {
            let c = limits.inflate_cap(compressed, cap);
            let why = if c < cap {
                format!(
                    " (deflated from {compressed} bytes: at most {}:1 is inflated)",
                    limits.max_inflate_ratio
                )
            } else {
                String::new()
            };
            (c, why)
        }
    };
    if declared > cap as u64 {
        return Err(ReadError::TooLarge {
            path: path.to_path_buf(),
            what: format!("zip member {name} of {declared} bytes{bomb}"),
            limit: cap,
        });
    }
    // Capacity from the header is capped: it is only a hint until the data is read.
    let mut out = Vec::with_capacity((declared as usize).min(64 << 20));
    (&mut f)
        .take(cap as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| ReadError::Format {
            path: path.to_path_buf(),
            detail: format!("broken zip member {name}: {e}"),
        })?;
    if out.len() > cap {
        return Err(ReadError::TooLarge {
            path: path.to_path_buf(),
            what: format!("zip member {name}{bomb}"),
            limit: cap,
        });
    }
    Ok(out)
}

fn torch_from_zip<R: Read + Seek>(
    path: &Path,
    reader: R,
    archive_len: u64,
    limits: &Limits,
) -> Result<Value, ReadError> {
    let limits = &Limits {
        max_view_copy_bytes: limits.view_copy_budget(archive_len),
        ..limits.clone()
    };
    let mut archive = zip::ZipArchive::new(reader).map_err(|e| zip_error(path, e))?;
    // torch writes `<archive_name>/data.pkl`; the folder name varies ("archive", the file
    // stem), so take the one data.pkl at depth 0 or 1.
    let mut pkls = Vec::new();
    for i in 0..archive.len() {
        let Some(Ok(name)) = archive.name_for_index(i) else {
            continue;
        };
        if let Some(prefix) = name.strip_suffix("data.pkl")
            && (prefix.is_empty() || (prefix.ends_with('/') && prefix.matches('/').count() == 1))
        {
            pkls.push((i, prefix.to_string()));
        }
    }
    let (pkl_index, prefix) = match pkls.as_slice() {
        [one] => one.clone(),
        [] => {
            let has_code = archive
                .file_names()
                .any(|n| n.is_ok_and(|n| n.contains("code/")));
            return Err(ReadError::Format {
                path: path.to_path_buf(),
                detail: if has_code {
                    "zip archive is a TorchScript module, not a torch.save file".into()
                } else {
                    "zip archive has no data.pkl (not a torch.save file)".into()
                },
            });
        }
        many => {
            return Err(ReadError::Format {
                path: path.to_path_buf(),
                detail: format!("zip archive has {} data.pkl entries", many.len()),
            });
        }
    };
    if let Some(i) = archive.index_for_name(&format!("{prefix}byteorder")) {
        let order = read_member(path, &mut archive, i, 64, archive_len, limits)?;
        if order.trim_ascii() != b"little" {
            return Err(ReadError::Format {
                path: path.to_path_buf(),
                detail: format!(
                    "byteorder is {:?}; only little-endian archives are read",
                    String::from_utf8_lossy(&order)
                ),
            });
        }
    }
    let pkl = read_member(
        path,
        &mut archive,
        pkl_index,
        limits.max_pickle_bytes,
        archive_len,
        limits,
    )?;
    let mut source = ZipStorages {
        path,
        archive: &mut archive,
        archive_len,
        prefix: &prefix,
        limits,
    };
    unpickle(path, &pkl, &mut source, limits)
}

struct ZipStorages<'a, R> {
    path: &'a Path,
    archive: &'a mut zip::ZipArchive<R>,
    archive_len: u64,
    prefix: &'a str,
    limits: &'a Limits,
}

impl<R: Read + Seek> StorageSource for ZipStorages<'_, R> {
    fn load(&mut self, key: &str, dtype: DType, numel: usize) -> Result<Arc<Vec<u8>>, ReadError> {
        let what = format!("storage {key}");
        let expected = checked_nbytes(dtype, &[numel]).ok_or_else(|| ReadError::ShapeOverflow {
            path: self.path.to_path_buf(),
            what: what.clone(),
            shape: vec![numel as u64],
        })?;
        let name = format!("{}data/{key}", self.prefix);
        let index = self
            .archive
            .index_for_name(&name)
            .ok_or_else(|| ReadError::Format {
                path: self.path.to_path_buf(),
                detail: format!("{what}: the archive has no entry {name}"),
            })?;
        let declared = self
            .archive
            .by_index_raw(index)
            .map(|f| f.size())
            .map_err(|e| zip_error(self.path, e))?;
        let mismatch = |got: usize| ReadError::SizeMismatch {
            path: self.path.to_path_buf(),
            what: what.clone(),
            dtype,
            shape: vec![numel],
            expected,
            got,
            holder: "the archive entry",
        };
        if declared != expected as u64 {
            return Err(mismatch(usize::try_from(declared).unwrap_or(usize::MAX)));
        }
        if expected > self.limits.max_file_bytes {
            return Err(ReadError::TooLarge {
                path: self.path.to_path_buf(),
                what: format!("{what} of {}", fmt_bytes(expected)),
                limit: self.limits.max_file_bytes,
            });
        }
        let bytes = read_member(
            self.path,
            self.archive,
            index,
            expected,
            self.archive_len,
            self.limits,
        )
        .map_err(|e| match e {
            // The entry holds more than its header said (the cap was the expected size itself);
            // a smaller cap is the inflate-ratio limit, reported as it is.
            ReadError::TooLarge { limit, .. } if limit == expected => {
                mismatch(expected.saturating_add(1))
            }
            other => other,
        })?;
        if bytes.len() != expected {
            return Err(mismatch(bytes.len()));
        }
        Ok(Arc::new(bytes))
    }
}
