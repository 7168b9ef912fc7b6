//! `.safetensors`: an 8-byte little-endian header length, a JSON header
//! `{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}`, then the
//! data. Parsed here rather than through the safetensors crate so that each refusal names the
//! tensor and both numbers; the checks follow the crate's `Metadata::validate`
//! (safetensors/src/tensor.rs): checked sizes, offsets inside the data, `end - begin` equal to
//! the tensor's byte count.

use std::path::Path;
use std::sync::Arc;

use serde_json::Value as J;

use super::tensor::{DType, HostTensor, checked_nbytes};
use super::{Limits, ReadError};

/// The tensors of a safetensors file, in data order, and its `__metadata__`.
#[derive(Debug, Clone)]
pub struct SafetensorsFile {
    pub tensors: Vec<(String, HostTensor)>,
    pub metadata: Vec<(String, String)>,
}

/// Reads a `.safetensors` file.
pub fn read_safetensors(path: &Path, limits: &Limits) -> Result<SafetensorsFile, ReadError> {
    let bytes = super::read_file(path, limits.max_file_bytes)?;
    safetensors_from_bytes(path, Arc::new(bytes), limits)
}

pub(crate) fn safetensors_from_bytes(
    path: &Path,
    bytes: Arc<Vec<u8>>,
    limits: &Limits,
) -> Result<SafetensorsFile, ReadError> {
    let bad = |detail: String| ReadError::Format {
        path: path.to_path_buf(),
        detail,
    };
    let n = match bytes.get(..8) {
        Some(b) => {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_le_bytes(a)
        }
        None => {
            return Err(bad(format!(
                "{} bytes is too short for a safetensors header",
                bytes.len()
            )));
        }
    };
    if n > limits.max_header_bytes as u64 {
        return Err(ReadError::TooLarge {
            path: path.to_path_buf(),
            what: format!("safetensors header of {n} bytes"),
            limit: limits.max_header_bytes,
        });
    }
    let n = n as usize;
    let header = bytes.get(8..8 + n).ok_or_else(|| {
        bad(format!(
            "safetensors header of {n} bytes runs past the end of the file ({} bytes)",
            bytes.len()
        ))
    })?;
    let data_start = 8 + n;
    let data_len = bytes.len() - data_start;
    let json: J = serde_json::from_slice(header)
        .map_err(|e| bad(format!("safetensors header is not JSON: {e}")))?;
    let J::Object(map) = json else {
        return Err(bad("safetensors header is not a JSON object".into()));
    };
    let mut metadata = Vec::new();
    let mut entries = Vec::new();
    for (name, info) in map {
        if name == "__metadata__" {
            let J::Object(m) = info else {
                return Err(bad("__metadata__ is not an object".into()));
            };
            for (k, v) in m {
                match v {
                    J::String(s) => metadata.push((k, s)),
                    other => return Err(bad(format!("__metadata__.{k} is {other}, not a string"))),
                }
            }
            continue;
        }
        let what = format!("tensor {name}");
        let field = |f: &str| info.get(f).ok_or_else(|| bad(format!("{what} has no {f}")));
        let dtype_s = field("dtype")?
            .as_str()
            .ok_or_else(|| bad(format!("{what}: dtype is not a string")))?;
        let dtype = match dtype_s {
            "F32" => DType::F32,
            "F16" => DType::F16,
            "BF16" => DType::BF16,
            "F64" => DType::F64,
            "I64" => DType::I64,
            "I32" => DType::I32,
            "I16" => DType::I16,
            "I8" => DType::I8,
            "U8" => DType::U8,
            "BOOL" => DType::Bool,
            other => {
                return Err(ReadError::UnsupportedDtype {
                    path: path.to_path_buf(),
                    what,
                    dtype: other.to_string(),
                });
            }
        };
        let shape64: Vec<u64> = field("shape")?
            .as_array()
            .and_then(|a| a.iter().map(J::as_u64).collect())
            .ok_or_else(|| {
                bad(format!(
                    "{what}: shape is not a list of non-negative integers"
                ))
            })?;
        let overflow = || ReadError::ShapeOverflow {
            path: path.to_path_buf(),
            what: what.clone(),
            shape: shape64.clone(),
        };
        let shape: Vec<usize> = shape64
            .iter()
            .map(|&d| usize::try_from(d).ok())
            .collect::<Option<_>>()
            .ok_or_else(overflow)?;
        let nbytes = checked_nbytes(dtype, &shape).ok_or_else(overflow)?;
        let offsets: Vec<u64> = field("data_offsets")?
            .as_array()
            .and_then(|a| a.iter().map(J::as_u64).collect())
            .ok_or_else(|| bad(format!("{what}: data_offsets is not a list of integers")))?;
        let [begin, end] = offsets.as_slice() else {
            return Err(bad(format!(
                "{what}: data_offsets has {} entries, not 2",
                offsets.len()
            )));
        };
        let (begin, end) = (*begin, *end);
        if begin > end || end > data_len as u64 {
            return Err(bad(format!(
                "{what}: data_offsets [{begin}, {end}] lie outside the {data_len} bytes of data"
            )));
        }
        let got = (end - begin) as usize;
        if got != nbytes {
            return Err(ReadError::SizeMismatch {
                path: path.to_path_buf(),
                what,
                dtype,
                shape,
                expected: nbytes,
                got,
                holder: "its data_offsets range",
            });
        }
        entries.push((begin as usize, name, dtype, shape));
    }
    entries.sort_by(|a, b| (a.0, &a.1).cmp(&(b.0, &b.1)));
    let mut tensors = Vec::with_capacity(entries.len());
    for (begin, name, dtype, shape) in entries {
        let t = HostTensor::from_shared(dtype, shape, Arc::clone(&bytes), data_start + begin)
            .map_err(|error| ReadError::Tensor {
                path: path.to_path_buf(),
                what: format!("tensor {name}"),
                error,
            })?;
        tensors.push((name, t));
    }
    Ok(SafetensorsFile { tensors, metadata })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &str, data: usize) -> Arc<Vec<u8>> {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.extend(std::iter::repeat_n(0u8, data));
        Arc::new(b)
    }

    #[test]
    fn reads_in_offset_order_with_metadata() {
        let b = file(
            r#"{"b":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},"a":{"dtype":"F16","shape":[2],"data_offsets":[8,12]},"__metadata__":{"k":"v"}}"#,
            12,
        );
        let f = safetensors_from_bytes(Path::new("m.safetensors"), b, &Limits::default()).unwrap();
        let names: Vec<_> = f.tensors.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["b", "a"]);
        assert_eq!(f.metadata, vec![("k".to_string(), "v".to_string())]);
    }

    #[test]
    fn refuses_wrong_byte_counts_and_bad_json() {
        let p = Path::new("m.safetensors");
        let lim = Limits::default();
        let e = safetensors_from_bytes(
            p,
            file(
                r#"{"x":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
                8,
            ),
            &lim,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "m.safetensors: tensor x declares 3 f32 (12 bytes) but its data_offsets range holds 8 bytes of data"
        );
        for h in [
            "",
            "[]",
            "{",
            r#"{"x":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}}"#,
            r#"{"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
            r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
            r#"{"x":{"dtype":"F32","shape":[1]}}"#,
        ] {
            assert!(safetensors_from_bytes(p, file(h, 8), &lim).is_err(), "{h}");
        }
    }
}
