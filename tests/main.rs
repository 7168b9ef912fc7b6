//! Integration tests: one binary, one module per capability (ripgrep's layout).

mod support;

mod deepseek;
mod deepseek_cli;
mod diff;
mod fuzz_corpus;
mod gate;
mod gguf;
#[cfg(feature = "cuda")]
mod gpu;
mod incidents;
mod malformed;
mod mla_draft;
mod run_cli;
mod runner;
