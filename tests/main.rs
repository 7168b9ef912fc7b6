//! Integration tests: one binary, one module per capability (ripgrep's layout).

mod support;

mod architecture;
mod deepseek;
mod deepseek_cli;
mod dense_families;
mod diff;
mod engine_dumps;
mod engine_support;
mod fuzz_corpus;
mod gate;
mod gguf;
#[cfg(feature = "cuda")]
mod gpu;
mod hub;
mod incidents;
mod load;
mod malformed;
mod mla_draft;
mod moe_families;
mod output;
mod plan;
mod probe;
mod run_cli;
mod runner;
mod spec_init;
mod stream;
mod workflow;
