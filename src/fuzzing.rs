//! Entry points for the fuzz targets in `fuzz/` and for the corpus replay test that CI runs
//! without a nightly toolchain (`tests/fuzz_corpus.rs`): untrusted bytes in, `Ok` or a typed
//! error out. None may panic, hang, or allocate what the bytes merely declare.
//!
//! Each takes the bytes as a file would hold them and goes through the same code the CLI does
//! for that surface, from the first byte to the resolved value.

use std::path::Path;
use std::sync::Arc;

use crate::commands::gate::gate;
use crate::config::draft::DraftConfigFile;
use crate::config::{ConfigFile, DraftConfig, ModelConfig, TargetInfo};
use crate::engine::{Engine, EngineSel};
use crate::judge::StaticInput;
use crate::readers::pickle::{StorageSource, unpickle};
use crate::readers::safetensors_header::{MAX_HEADER_BYTES, header_len, parse_header};
use crate::readers::tensor::checked_nbytes;
use crate::readers::{DType, Limits, ReadError};
use crate::spec::Spec;

/// One entry point: bytes in, nothing out but the absence of a panic.
pub type Entry = fn(&[u8]);

/// The targets, by the name of their fuzz target and corpus folder.
pub const TARGETS: [(&str, Entry); 7] = [
    ("pickle", pickle),
    ("npy", npy),
    ("npz", npz),
    ("safetensors_header", safetensors_header),
    ("gguf", gguf),
    ("spec", spec),
    ("config", config),
];

/// Limits small enough that a fuzz input cannot make one run slow, large enough to reach every
/// branch.
fn limits() -> Limits {
    Limits {
        max_file_bytes: 1 << 20,
        max_gzip_bytes: 1 << 20,
        max_pickle_bytes: 1 << 20,
        max_header_bytes: 1 << 16,
        max_pickle_stack: 1 << 12,
        max_pickle_memo: 1 << 12,
        max_pickle_objects: 1 << 14,
        max_pickle_nodes: 1 << 14,
        max_view_copy_bytes: 1 << 20,
        inflate_floor_bytes: 1 << 16,
        ..Limits::default()
    }
}

/// Storages of up to 64 KiB, zero-filled; larger ones are refused as a real archive would
/// refuse an entry it does not hold.
struct ZeroStorages;

impl StorageSource for ZeroStorages {
    fn load(&mut self, key: &str, dtype: DType, numel: usize) -> Result<Arc<Vec<u8>>, ReadError> {
        match checked_nbytes(dtype, &[numel]) {
            Some(n) if n <= 1 << 16 => Ok(Arc::new(vec![0u8; n])),
            _ => Err(ReadError::Format {
                path: "fuzz.pkl".into(),
                detail: format!("storage {key}: no such entry"),
            }),
        }
    }
}

/// A `data.pkl` through the restricted unpickler.
pub fn pickle(data: &[u8]) {
    let _ = unpickle(Path::new("fuzz.pkl"), data, &mut ZeroStorages, &limits());
}

/// An `.npy` file.
pub fn npy(data: &[u8]) {
    let _ = crate::readers::numpy::npy_from_bytes(
        Path::new("fuzz.npy"),
        "header",
        Arc::new(data.to_vec()),
        &limits(),
    );
}

/// An `.npz` archive (zip reading, member inflation, each member's `.npy`).
pub fn npz(data: &[u8]) {
    let _ = crate::readers::numpy::npz_from_reader(
        Path::new("fuzz.npz"),
        std::io::Cursor::new(data),
        data.len() as u64,
        &limits(),
    );
}

/// A safetensors file: the one header parser, then the capture reader on the same bytes.
pub fn safetensors_header(data: &[u8]) {
    let len = data.len() as u64;
    if let Ok(n) = header_len(data, len, MAX_HEADER_BYTES) {
        let header = data.get(8..8 + n).unwrap_or(&[]);
        let _ = parse_header(header, len - 8 - n as u64);
    }
    let _ = crate::readers::safetensors_file::safetensors_from_bytes(
        Path::new("fuzz.safetensors"),
        Arc::new(data.to_vec()),
        &limits(),
    );
}

/// A GGUF file: header, tensor extents, the config its metadata stands for, tensor names.
pub fn gguf(data: &[u8]) {
    let _ = crate::model::gguf::check_gguf_bytes(Path::new("fuzz.gguf"), data);
}

/// A capture spec (YAML).
pub fn spec(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = Spec::parse(text, Path::new("fuzz.yaml"));
    }
}

/// A `config.json`, resolved as a target (full and lenient) and as a draft, then judged by the
/// static gate on every engine (the same bytes as draft and target: the gate's arithmetic on
/// whatever dims and ids they hold is what this reaches).
pub fn config(data: &[u8]) {
    let path = Path::new("fuzz.json");
    let target = match serde_json::from_slice::<ConfigFile>(data) {
        Ok(raw) => {
            let _ = ModelConfig::resolve(&raw, path);
            TargetInfo::resolve(&raw, path).ok()
        }
        Err(_) => None,
    };
    let Ok(raw) = serde_json::from_slice::<DraftConfigFile>(data) else {
        return;
    };
    let Ok(draft) = DraftConfig::resolve(&raw, path) else {
        return;
    };
    let Ok(spec) = Spec::parse(
        "name: fuzz\ncapture: { boundaries: [2, 3, 4] }\n",
        Path::new("fuzz.yaml"),
    ) else {
        return;
    };
    let engines = Engine::ALL.map(EngineSel::newest);
    for target in [None, target.as_ref()] {
        let _ = gate(
            &StaticInput {
                spec: &spec,
                draft: Some(&draft),
                draft_weights: None,
                target,
                target_weights: None,
            },
            &engines,
        );
    }
}
