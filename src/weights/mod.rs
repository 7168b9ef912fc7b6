//! Model weights on disk: safetensors headers (for the gate) and tensors (for the runner), and
//! the GGUF header.

pub mod gguf;
pub mod header;

pub use header::{TensorInfo, WeightIndex, read_header, shard_files};
