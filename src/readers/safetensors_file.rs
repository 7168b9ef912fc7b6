//! `.safetensors` capture files: the header goes through the one parser model weights use
//! ([`super::safetensors_header`]), then each tensor shares the file's bytes. Dtypes the format
//! knows but captures never hold (F8, unsigned wider than a byte) are refused by name.

use std::path::Path;
use std::sync::Arc;

use super::safetensors_header::{StDtype, header_len, parse_header};
use super::tensor::{DType, HostTensor};
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
    let header_err = |error| ReadError::Header {
        path: path.to_path_buf(),
        error,
    };
    let file_len = bytes.len() as u64;
    let n = header_len(&bytes, file_len, limits.max_header_bytes as u64).map_err(header_err)?;
    let data_start = 8 + n;
    let header = bytes.get(8..data_start).unwrap_or(&[]);
    let parsed = parse_header(header, file_len - data_start as u64).map_err(header_err)?;
    let mut tensors = Vec::with_capacity(parsed.entries.len());
    for e in parsed.entries {
        let what = format!("tensor {}", e.name);
        let dtype = match e.dtype {
            StDtype::F32 => DType::F32,
            StDtype::F16 => DType::F16,
            StDtype::BF16 => DType::BF16,
            StDtype::F64 => DType::F64,
            StDtype::I64 => DType::I64,
            StDtype::I32 => DType::I32,
            StDtype::I16 => DType::I16,
            StDtype::I8 => DType::I8,
            StDtype::U8 => DType::U8,
            StDtype::Bool => DType::Bool,
            other => {
                return Err(ReadError::UnsupportedDtype {
                    path: path.to_path_buf(),
                    what,
                    dtype: other.name().to_string(),
                });
            }
        };
        let t = HostTensor::from_shared(dtype, e.shape, Arc::clone(&bytes), data_start + e.begin)
            .map_err(|error| ReadError::Tensor {
            path: path.to_path_buf(),
            what,
            error,
        })?;
        tensors.push((e.name, t));
    }
    Ok(SafetensorsFile {
        tensors,
        metadata: parsed.metadata,
    })
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
            "m.safetensors: tensor x declares 3 F32 (12 bytes) but its data_offsets [0, 8] hold 8 bytes"
        );
        for h in [
            "",
            "[]",
            "{",
            r#"{"x":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}}"#,
            r#"{"x":{"dtype":"U16","shape":[1],"data_offsets":[0,2]}}"#,
            r#"{"x":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
            r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
            r#"{"x":{"dtype":"F32","shape":[1]}}"#,
        ] {
            assert!(safetensors_from_bytes(p, file(h, 8), &lim).is_err(), "{h}");
        }
    }
}
