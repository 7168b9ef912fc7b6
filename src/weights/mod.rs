//! Model weights: safetensors headers (for the gate) and tensors (for the runner).

pub mod header;

pub use header::{TensorInfo, WeightIndex, read_header, shard_files};
