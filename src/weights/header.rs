//! safetensors headers read without trusting them, and model directories resolved to shards.
//!
//! The gate reads headers only (no weights), so a 671B directory is checked in milliseconds.
//! Every size comes from untrusted bytes and is checked against the file's real length, by the
//! one header parser ([`crate::readers::safetensors_header`]) capture files go through too.

use crate::error::{Error, Result};
use crate::readers::safetensors_header::{MAX_HEADER_BYTES, StDtype, header_len, parse_header};
use serde::Deserialize;
use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

/// A tensor as a safetensors header declares it, validated against the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub file: Arc<Path>,
    /// As the header spells it (`BF16`, `F8_E4M3`, `BOOL`, ...).
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Byte range inside the data section (after the 8-byte length and the header).
    pub data_offsets: (usize, usize),
    /// Start of the data section in the file.
    pub data_start: usize,
}

/// Bytes per element of a safetensors dtype, or `None` for one we do not know.
pub fn dtype_size(dtype: &str) -> Option<usize> {
    StDtype::parse(dtype).map(StDtype::size)
}

/// Reads and validates the header of one `.safetensors` file (the header only: the data is
/// never read), through the parser capture files use too.
pub fn read_header(path: &Path) -> Result<Vec<(String, TensorInfo)>> {
    let header_err = |error| Error::Header {
        path: path.to_path_buf(),
        error: Box::new(error),
    };
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut prefix = [0u8; 8];
    let got = read_up_to(&mut file, &mut prefix).map_err(|e| Error::io(path, e))?;
    let header_len = header_len(&prefix[..got], file_len, MAX_HEADER_BYTES).map_err(header_err)?;
    let mut header = vec![0u8; header_len];
    file.read_exact(&mut header)
        .map_err(|e| Error::io(path, e))?;
    let data_start = 8 + header_len;
    let parsed = parse_header(&header, file_len - data_start as u64).map_err(header_err)?;
    let file_name: Arc<Path> = Arc::from(path);
    Ok(parsed
        .entries
        .into_iter()
        .map(|e| {
            let info = TensorInfo {
                file: file_name.clone(),
                dtype: e.dtype.name().to_string(),
                shape: e.shape,
                data_offsets: (e.begin, e.end),
                data_start,
            };
            (e.name, info)
        })
        .collect())
}

/// Reads until `buf` is full or the file ends; returns how many bytes were read.
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

#[derive(Deserialize)]
struct IndexFile {
    weight_map: HashMap<String, String>,
}

/// The safetensors files of a model directory: the shards `model.safetensors.index.json` names,
/// else `model.safetensors`, else every `*.safetensors` in it. A path to one `.safetensors` file
/// is taken as is.
pub fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    if dir.is_file() {
        return Ok(vec![dir.to_path_buf()]);
    }
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let parsed: IndexFile = serde_json::from_str(&text).map_err(|error| Error::Json {
            path: index.clone(),
            error,
        })?;
        let mut files: Vec<String> = parsed.weight_map.into_values().collect();
        files.sort();
        files.dedup();
        let mut out = Vec::with_capacity(files.len());
        for name in files {
            // Only plain relative names below the directory: no `..`, no root, no prefix.
            let inside = !name.is_empty()
                && Path::new(&name)
                    .components()
                    .all(|c| matches!(c, Component::Normal(_) | Component::CurDir));
            if !inside {
                return Err(Error::weights(
                    &index,
                    format!("shard name `{name}` leaves the model directory"),
                ));
            }
            let shard = dir.join(&name);
            if !shard.is_file() {
                return Err(Error::weights(
                    &index,
                    format!("names shard {name}, which does not exist"),
                ));
            }
            out.push(shard);
        }
        return Ok(out);
    }
    // transformers reads `model.safetensors` when there is no index; other safetensors files
    // beside it (reference dumps, adapters) are not part of the model.
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let mut out = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    for entry in entries {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        if path.extension().is_some_and(|x| x == "safetensors") {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// Every tensor of a model directory by name, from headers alone.
#[derive(Debug, Default)]
pub struct WeightIndex {
    pub dir: PathBuf,
    pub tensors: HashMap<String, TensorInfo>,
}

impl WeightIndex {
    pub fn open(dir: &Path) -> Result<WeightIndex> {
        let mut tensors = HashMap::new();
        for shard in shard_files(dir)? {
            for (name, info) in read_header(&shard)? {
                if let Some(prev) = tensors.insert(name.clone(), info) {
                    return Err(Error::weights(
                        &shard,
                        format!("tensor {name} also appears in {}", prev.file.display()),
                    ));
                }
            }
        }
        Ok(WeightIndex {
            dir: dir.to_path_buf(),
            tensors,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.get(name)
    }

    /// The first of `names` present (drafts are saved under several naming schemes).
    pub fn find(&self, names: &[&str]) -> Option<(&str, &TensorInfo)> {
        names
            .iter()
            .find_map(|n| self.tensors.get_key_value(*n).map(|(k, v)| (k.as_str(), v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_raw(path: &Path, header: &str, data_len: usize) {
        let mut f = File::create(path).unwrap();
        f.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
        f.write_all(header.as_bytes()).unwrap();
        f.write_all(&vec![0u8; data_len]).unwrap();
    }

    #[test]
    fn header_is_validated_against_the_file() {
        let dir = std::env::temp_dir().join(format!("ec-header-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.safetensors");
        write_raw(
            &good,
            r#"{"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}"#,
            24,
        );
        let t = read_header(&good).unwrap();
        assert_eq!(t[0].1.shape, vec![2, 3]);

        let lying = dir.join("lying.safetensors");
        write_raw(
            &lying,
            r#"{"a":{"dtype":"F32","shape":[4096,4096],"data_offsets":[0,24]}}"#,
            24,
        );
        let err = read_header(&lying).unwrap_err().to_string();
        assert!(
            err.contains("lying.safetensors") && err.contains("4096"),
            "{err}"
        );

        let overflow = dir.join("overflow.safetensors");
        let h = format!(
            r#"{{"a":{{"dtype":"F32","shape":[{},{}],"data_offsets":[0,0]}}}}"#,
            usize::MAX,
            3
        );
        write_raw(&overflow, &h, 0);
        assert!(
            read_header(&overflow)
                .unwrap_err()
                .to_string()
                .contains("overflows")
        );

        let short = dir.join("short.safetensors");
        std::fs::write(&short, [1u8, 0, 0]).unwrap();
        assert!(
            read_header(&short)
                .unwrap_err()
                .to_string()
                .contains("too short")
        );

        let huge = dir.join("huge.safetensors");
        std::fs::write(&huge, u64::MAX.to_le_bytes()).unwrap();
        assert!(
            read_header(&huge)
                .unwrap_err()
                .to_string()
                .contains("limit")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
